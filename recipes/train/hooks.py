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

    def optimizer(self, sharded: bool, resumed: dict) -> Optional[GradientTransformation]:
        """The optimizer the run's state is built with, or None for the run's own (``recipes.train.optimizer``).
        ``sharded``: the state is sharded (parallel=fsdp); ``resumed``: the top level of
        the checkpoint the run resumes (``core.io.checkpoint.read_meta``; {} for a fresh run)."""
        return None

    def dry_run_refusal(self) -> Optional[str]:
        """Why ``dry_run=true`` cannot project this run (None: it can)."""
        return None

    def check(self) -> None:
        """Raise ``core.config.ConfigError`` for settings of the run this layer cannot work with (the config's
        ``__post_init__`` asks, so a bad combination stops before anything is read)."""


@dataclass
class Meter:
    """What the loop meters: wall time of the whole run (its earlier sessions ``before``), what of the time since the
    last log step was not training (evaluating, saving: ``excluded``) or waited for data, and the tokens a step
    consumes over all ranks."""
    before: float = 0.0                      # wall seconds of the run's earlier sessions
    start: float = field(default_factory=time.perf_counter)   # this session's start
    excluded: float = 0.0                    # seconds evaluating/saving since the last log (not throughput)
    data_seconds: float = 0.0                # seconds the steps since the last log waited for their batch
    tokens_per_step: int = 0

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
class Run:
    """What the loop keeps across its steps and shares with every hook: the last step, the loop's counters and its
    result (``recipes.train.loop``: ``LoopState``, ``FitResult``), the frozen inputs every step takes (a teacher),
    the hooks themselves (rollback and checkpointing ask every one) and the meter."""
    total: int = 0
    loop: Any = None
    result: Any = None
    frozen: Any = None
    hooks: list = field(default_factory=list)
    meter: Meter = field(default_factory=Meter)


@dataclass
class Window:
    """The step metrics since the last log step: ``pending`` (0-d tensors not yet pulled to the host) and, at a log
    step, the ``values`` the log hook pulled (the rollback reads them)."""
    pending: list = field(default_factory=list)
    values: Optional[dict] = None


@dataclass
class StepContext:
    """Where the loop is after a step: the state, its step and data cursor, the step's metrics, the metrics window
    since the last log, and the run (what lasts across steps)."""
    state: Any
    step: int
    cursor: int
    metrics: Optional[dict] = None
    window: Window = field(default_factory=Window)
    run: Run = field(default_factory=Run)

    @property
    def last(self) -> bool:
        return self.step == self.run.total

    @property
    def evaluated(self) -> bool:
        """Validation ran at this step (its loss is the result's newest)."""
        history = self.run.result.history if self.run.result is not None else ()
        return bool(history) and history[-1][0] == self.step

    def advance(self, state, metrics: dict) -> None:
        """One train step happened."""
        self.state, self.metrics = state, metrics
        self.step, self.cursor = self.step + 1, self.cursor + 1
        self.run.loop.tokens += self.run.meter.tokens_per_step
        self.run.loop.ticks += 1
        self.window.pending.append(metrics)
        self.window.values = None

    def apply(self, jump: Jump) -> None:
        self.state, self.step, self.cursor = jump.state, jump.step, jump.cursor
        self.window.pending.extend(jump.metrics)
        self.run.loop.ticks += jump.ticks
        self.run.loop.tokens += jump.ticks * self.run.meter.tokens_per_step
