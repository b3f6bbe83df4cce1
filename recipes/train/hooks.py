"""The one interface between the training loop and everything that acts on it between steps.

``recipes.train.loop.Loop`` steps the state and then hands a :class:`StepContext` to its hooks in order: the
first-step checks, the recipe's own hooks (a strategy layer a recipe switches on), the metrics log, the spike
rollback, evaluation, checkpointing and the stop conditions. A hook may move the state (return a :class:`Jump`)
or end the run (return a :class:`Stop`); its ``state_dict`` is saved in every checkpoint under its ``key`` and
handed back on resume. The structure follows the callback interfaces of Keras and PyTorch Lightning, with the
loop's own pieces written as callbacks too.

A layer that a recipe's config adds to a run (its own config section, its own loop hook) may also need a say
before the loop starts: the optimizer the state is built with, whether the steps may donate their input state,
whether ``dry_run=true`` can project the run. It answers as a :class:`RunHook`, which a config lists in its
``run_hooks()``; the shared trainer asks every one of them and never names any.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from purestep.optim.base import GradientTransformation


@dataclass
class Jump:
    """The main state moved: continue from ``state`` at ``step``/``cursor``, ``ticks`` kept steps with
    ``metrics`` (a branch a hook trained and kept), or, with ``restart``, skip this step's remaining hooks (a
    rollback)."""
    state: Any
    step: int
    cursor: int
    metrics: list = field(default_factory=list)
    ticks: int = 0
    restart: bool = False


@dataclass
class Stop:
    """End the run after this step with a checkpoint (``final``: kept as the run's final one). ``reason`` is
    the run's stop reason ("" when it ended normally); ``announce(path)`` runs once the checkpoint is written.
    ``unfinished``: the run failed (diverged, too many rollbacks): the checkpoint is kept as ``stopped.msgpack``,
    not final, and the loop raises ``core.exits.RunStopped`` with ``reason`` (exit code 4)."""
    reason: str = ""
    final: bool = False
    val_loss: Optional[float] = None
    early: bool = False
    announce: Optional[Callable[[Optional[Path]], None]] = None
    unfinished: bool = False


class Hook:
    """A piece of the training loop, called once per step after the train step. Every method is optional."""
    key: Optional[str] = None   # checkpoint entry for ``state_dict`` (None: nothing to save)

    def after_step(self, ctx: "StepContext") -> "Optional[Jump | Stop]":
        return None

    def on_rollback(self, step: int, to_step: int, restored):
        """The loop rolled back from ``step`` to the snapshot of ``to_step``: may adjust ``restored``."""
        return restored

    def on_stop(self, ctx: "StepContext", stop: Stop) -> None:
        """The run ends at this step (``stop``)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass


class RunHook:
    """What a layer a recipe's config adds to its runs says about a run before and around its loop (module
    docstring). A config lists its layers in ``run_hooks()`` (``TrainConfig``: none); each answers from its own
    config section, so a layer that is switched off changes nothing. Every member is optional."""
    fixed_keys: tuple[str, ...] = ()   # keys a resumed run cannot change (``recipes.train.changes``), on or off
    loop_key: Optional[str] = None     # when on: the ``key`` of the loop Hook the recipe must hand the loop
    keeps_states: bool = False         # when on: the loop steps one state more than once (branches): no donation

    def optimizer(self, psum: Optional[Callable], resumed: dict) -> Optional[GradientTransformation]:
        """The optimizer the run's state is built with, or None for the run's own (``recipes.train.optimizer``).
        ``psum``: sums over the ranks of a sharded state (parallel=fsdp), else None; ``resumed``: the top level of
        the checkpoint the run resumes (``core.io.checkpoint.read_meta``; {} for a fresh run)."""
        return None

    def dry_run_refusal(self) -> Optional[str]:
        """Why ``dry_run=true`` cannot project this run (None: it can)."""
        return None

    def check(self) -> None:
        """Raise ``core.config.ConfigError`` for settings of the run this layer cannot work with (the config's
        ``__post_init__`` asks, so a bad combination stops before anything is read)."""


@dataclass
class Clock:
    """The loop's timekeeping: wall time of the whole run (its earlier sessions ``before``), and what of the time
    since the last log step was not training (evaluating, saving: ``excluded``) or waited for data."""
    before: float = 0.0                      # wall seconds of the run's earlier sessions
    start: float = field(default_factory=time.perf_counter)   # this session's start
    excluded: float = 0.0                    # seconds evaluating/saving since the last log (not throughput)
    data_seconds: float = 0.0                # seconds the steps since the last log waited for their batch

    def wall(self, now: Optional[float] = None) -> float:
        """Wall seconds of the whole run so far, earlier sessions included."""
        return self.before + ((time.perf_counter() if now is None else now) - self.start)

    @contextmanager
    def timed(self):
        """Time spent inside is not training time (excluded from the throughput)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - t0


@dataclass
class StepContext:
    """Where the loop is (the state after this step, its position, this step's metrics) and what the hooks share
    during a run: the loop's counters and result (``recipes.train.loop``), the hooks themselves (rollback and
    checkpointing ask every one), the metrics not yet pulled and, at log steps, the pulled ones, and the clock."""
    state: Any
    step: int
    cursor: int
    metrics: Optional[dict] = None
    frozen: Any = None
    total: int = 0                          # the run's last step
    loop: Any = None                        # recipes.train.loop.LoopState
    result: Any = None                      # recipes.train.loop.FitResult
    tokens_per_step: int = 0
    hooks: list = field(default_factory=list)
    pending: list = field(default_factory=list)      # step metrics not yet pulled to the host
    values: Optional[dict] = None           # this step's pulled metrics (log steps only)
    clock: Clock = field(default_factory=Clock)

    @property
    def last(self) -> bool:
        return self.step == self.total

    @property
    def evaluated(self) -> bool:
        """Validation ran at this step (its loss is the result's newest)."""
        history = self.result.history if self.result is not None else ()
        return bool(history) and history[-1][0] == self.step

    def advance(self, state, metrics: dict) -> None:
        """One train step happened."""
        self.state, self.metrics = state, metrics
        self.step, self.cursor = self.step + 1, self.cursor + 1
        self.loop.tokens += self.tokens_per_step
        self.loop.ticks += 1
        self.pending.append(metrics)
        self.values = None

    def apply(self, jump: Jump) -> None:
        self.state, self.step, self.cursor = jump.state, jump.step, jump.cursor
        self.pending.extend(jump.metrics)
        self.loop.ticks += jump.ticks
        self.loop.tokens += jump.ticks * self.tokens_per_step
