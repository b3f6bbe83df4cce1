"""The training loop every recipe shares: step, log, evaluate, sample, checkpoint, stop.

A recipe builds a pure ``train_step`` (:func:`build_steps`) and writes its loop out over :class:`Loop`, which
holds the data, the sinks and the hooks between steps. The loop is the only place that talks to the host: it
pulls the step's 0-d metrics every ``log_every`` steps in one transfer (Levanter's deferred metrics), evaluates
on fixed validation windows, keeps checkpoints (every ``save_every``, the best by validation loss, a final one)
and stops early after ``patience`` evaluations without improvement. Everything needed to resume exactly is in
the checkpoint: the train state (with its data cursor), the loop's own counters and its hooks' state. Each of
those pieces is a hook (``recipes/train/hooks.py``: metrics in ``metrics.py``, rollback in ``rollback.py``,
checkpoints and stops in ``checkpointing.py``), and so is anything a recipe adds (a strategy layer's branches and
switches).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from purestep.core.compile import compile_seconds
from purestep.core.io import checkpoint as ckpt
from purestep.core.config import UserError, to_dict
from purestep.core.parallel.distributed import Dist
from purestep.core.exits import RunStopped
from purestep.core.io.logging import Logger, memory_mb, reset_peak_memory
from purestep.core.parallel.shard import Layout, full_bytes, state_bytes
from purestep.core.state import TrainState
from purestep.core.io.telemetry import Preemption
from purestep.core.step import Compile, Gradients, Parallel, make_eval_step, make_train_step, per_block
from purestep.optim.health import GradientHealth
from purestep.recipes.train import backend
from purestep.recipes.train.checkpointing import Checkpointing, Stopping
from purestep.recipes.train.config import TrainConfig, fused_refusal
from purestep.recipes.train.faults import FaultyBatches, with_faults
from purestep.recipes.train.hooks import Hook, Jump, Meter, Run, StepContext, Stop
from purestep.recipes.train.metrics import Evaluation, FirstStepCheck, TrainLog
from purestep.recipes.train.prefetch import Prefetch
from purestep.recipes.train.rollback import Rollback
from purestep.core.update import Monitors


def evaluate(eval_step: Callable, params, batches, frozen=None, dist: Dist = Dist()) -> float:
    """Mean validation loss over fixed batches (one host transfer at the end).

    With several ranks each evaluates its own rows of every (global) batch and the means are averaged,
    so the validation set and the result do not depend on the number of ranks.
    """
    losses = []
    for batch in batches:
        if dist.enabled:
            rows = batch["x"].shape[0] // dist.data_world
            batch = {k: v[dist.data_rank * rows:(dist.data_rank + 1) * rows] for k, v in batch.items()}
        losses.append(eval_step(params, batch, frozen)["loss"])
    return dist.all_reduce_mean([torch.stack(losses).mean()])[0].item()


@dataclass
class LoopState:
    """The loop's own counters, saved in every checkpoint next to the train state."""
    best_val: float = math.inf
    bad_evals: int = 0
    tokens: int = 0
    ticks: int = 0                                     # steps executed, rollbacks included (never rewinds)
    rollbacks: list = field(default_factory=list)      # ticks at which rollbacks happened
    wall_seconds: float = 0.0                          # wall time of all sessions of this run (cost meter)

    def to_dict(self) -> dict:
        return {"best_val": self.best_val if math.isfinite(self.best_val) else None, "bad_evals": self.bad_evals,
                "tokens": self.tokens, "ticks": self.ticks,
                "rollbacks": list(self.rollbacks), "wall_seconds": self.wall_seconds}

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "LoopState":
        d = d or {}
        best = d.get("best_val")
        return cls(best_val=math.inf if best is None else best, bad_evals=d.get("bad_evals", 0),
                   tokens=d.get("tokens", 0), ticks=d.get("ticks", 0), rollbacks=list(d.get("rollbacks", [])),
                   wall_seconds=d.get("wall_seconds", 0.0))


@dataclass
class FitResult:
    state: TrainState
    loop: LoopState
    val_loss: Optional[float] = None
    stopped_early: bool = False
    stop_reason: str = ""
    unfinished: bool = False                       # stopped without finishing (fit raises core.exits.RunStopped)
    history: list = field(default_factory=list)   # (step, val_loss) of every evaluation
    checkpoint: Optional[Path] = None             # the newest checkpoint written


@dataclass
class Steps:
    """What ``build_steps`` wires for a recipe."""
    train: Callable
    eval: Callable
    health: Optional[GradientHealth]
    batches: object      # the batch source the loop reads (with faults when configured)
    layout: Optional[Layout] = None   # parallel=fsdp: the state's leaves are this rank's shards (core.parallel.shard)
    per_block: bool = False           # and the steps gather them one block at a time (core.parallel.shard_blocks)


def donates(cfg: TrainConfig) -> bool:
    """Whether the train step of a run of ``cfg`` donates its input state (``core.donate``): the loop never reads a
    state after stepping it, unless a run hook's branches do (one state, many steps: ``RunHook.keeps_states``)."""
    return not any(hook.keeps_states for hook in cfg.run_hooks())


def build_steps(cfg: TrainConfig, loss_fn: Callable, optimizer, params, batches, device: torch.device,
                vocab_size: int, dist: Dist = Dist(), layout: Optional[Layout] = None,
                frozen_shards: Optional[dict] = None) -> Steps:
    """The train and eval steps every training recipe uses, configured from the common keys.

    ``loss_fn(params, batch, key[, frozen])``: precision, accumulation, remat, the spike detector,
    gradient health and fault injection all come from ``cfg``; with several ranks the step averages
    gradients across them (``dist``), or with a ``layout`` (``parallel=fsdp``, ``RunSetup.layout``) takes the
    state as this rank's shards: both steps gather the params, the train step reduce-scatters the gradients.
    ``frozen_shards`` (``{name: layout}``): the train step's frozen inputs held as shards (a sharded teacher;
    ``core.step.Parallel``).
    """
    refusal = fused_refusal(cfg, dist.world_size) if cfg.fused else ""   # parallel=auto under torchrun
    if refusal:
        raise UserError(refusal)
    clip_norm = cfg.grad_clip if cfg.clipping == "global" else None
    health = GradientHealth(params, clip_norm=clip_norm, every=cfg.log_every) if cfg.health else None
    train_loss, mode, scope = loss_fn, backend.compile_mode(cfg, device), backend.compile_scope(cfg, params)
    if cfg.fault.active:
        train_loss = with_faults(loss_fn)
        batches = FaultyBatches(batches, cfg.fault, vocab_size, cfg.seed)
    train = make_train_step(train_loss, optimizer, precision=cfg.dtype,
                            compile=Compile(cfg.compile, scope, mode, backend.cuda_options(cfg)), donate=donates(cfg),
                            gradients=Gradients(backend.grad_mode(cfg, params, scope), cfg.grad_accum, cfg.remat),
                            monitors=Monitors(health, cfg.spike if cfg.spike.enabled else None, cfg.skip_nonfinite),
                            parallel=Parallel(dist.all_reduce_mean if dist.enabled and layout is None else None,
                                              shard=layout, frozen_shards=frozen_shards or {}))
    evaluate_step = make_eval_step(loss_fn, precision=cfg.dtype, shard=layout,
                                   compile=Compile(backend.eval_compiled(cfg), scope, mode))
    return Steps(train, evaluate_step, health, batches, layout, per_block(layout, cfg.compile, scope))


@dataclass
class Validation:
    """What the loop's evaluations run (every ``eval_every`` steps and at the end; ``recipes.train.metrics``):
    ``loss(params) -> float`` on held-out data (the best checkpoint and ``patience`` follow it) and, beside it,
    ``sample(params) -> text``; ``perplexity``: the loss is a next-token NLL, so ``exp`` of it is reported too."""
    loss: Callable[[object], float]
    sample: Optional[Callable[[object], str]] = None
    perplexity: bool = True


@dataclass
class Measures:
    """What the loop measures a run against: tokens per optimizer step over all ranks (throughput, the token
    count), training FLOPs per token (MFU), and the loss a fresh model's first step should show (``log(vocab)``;
    None: not checked)."""
    tokens_per_step: int = 0
    flops_per_token: float = 0.0
    expected_initial_loss: Optional[float] = None


class Loop:
    """The training loop every recipe writes out, stepping ``state`` until ``cfg.steps``::

        with Loop(cfg, run.state, steps, logger, checkpoints, validation=validation) as loop:
            for batch in loop:
                loop.stepped(*steps.train(loop.state, batch))
        result = loop.result

    Iterating gives the batch at the state's data cursor (``steps.batches``; the next one is built while this step
    runs) until ``cfg.steps`` or a stop; :meth:`stepped` hands the step's ``(state, metrics)`` to the hooks in order
    (``recipes.train.hooks``): the first-step checks, the recipe's ``hooks`` (None entries skipped, so a layer
    switched off is passed as is), the metrics log (``log`` replaces it: a phase with its own metrics), the spike
    rollback, evaluation (``validation``), checkpointing into ``checkpoints`` (None on ranks other than 0: rank 0
    alone writes; ``extra()`` adds the recipe's own entries to every checkpoint) and the stop conditions.
    ``measures``: what the log measures the run against. ``dist`` makes the ranks agree on host-side stops
    (preemption, budget) at log steps; ``resume_folder`` is the ``out=`` that resumes the run when it is not the
    checkpoints' folder; ``counters`` are the resumed run's (``RunSetup.loop``).

    Stops early, always with a checkpoint, on: ``patience`` evaluations without improvement, SIGTERM or SIGINT
    (preemption: finish the step, save, leave the loop so the program exits 0), the cost ``budget``, or a hook's
    :class:`~recipes.train.hooks.Stop`. A stop without finishing (too many rollbacks, a non-finite validation loss:
    ``Stop.unfinished``) writes ``stopped.msgpack`` instead of ``final.msgpack`` and raises
    ``core.exits.RunStopped`` as the ``with`` block closes (exit code 4). A lost peer stops at once, naming it.
    """

    def __init__(self, cfg: TrainConfig, state: TrainState, steps: Steps, logger: Logger,
                 checkpoints: Optional[ckpt.CheckpointManager] = None, *, counters: Optional[LoopState] = None,
                 frozen=None, hooks: Sequence[Optional[Hook]] = (), validation: Optional[Validation] = None,
                 measures: Measures = Measures(), extra: Callable[[], dict] = dict, log: Optional[Hook] = None,
                 resume_folder: Optional[Path] = None, dist: Dist = Dist()):
        hooks = [h for h in hooks if h is not None]
        _check_wired(cfg, hooks)
        self.cfg, self.steps, self.logger, self.checkpoints, self.dist = cfg, steps, logger, checkpoints, dist
        counters = counters or LoopState()
        run = Run(cfg.steps, counters, FitResult(state, counters), frozen,
                  meter=Meter(before=counters.wall_seconds, tokens_per_step=measures.tokens_per_step))
        self.ctx = StepContext(state, int(state.step), int(state.cursor), run=run)
        self._preemption = Preemption()
        run.hooks = _pieces(cfg, logger, checkpoints, extra, validation, measures, log,
                            Stopping(cfg, logger, self._preemption, dist, resume_folder), steps, hooks, self.ctx, dist)
        self._stopped = False

    @property
    def state(self) -> TrainState:
        """The state the next step starts from."""
        return self.ctx.state

    @property
    def result(self) -> FitResult:
        """The final state and what happened (complete once the ``with`` block has closed)."""
        return self.ctx.run.result

    def __enter__(self) -> "Loop":
        self._setup_peak = _announce_parallel(self.logger, self.ctx.state, self.steps, self.dist)
        self._compiled_before = compile_seconds()
        self._batches = Prefetch(self.steps.batches)
        self._preemption.__enter__()
        return self

    def __iter__(self):
        ctx = self.ctx
        while not self._stopped and ctx.step < self.cfg.steps:
            t0 = time.perf_counter()
            batch = self._batches.get(ctx.cursor)
            ctx.run.meter.data_seconds += time.perf_counter() - t0
            yield batch

    def stepped(self, state: TrainState, metrics: dict) -> None:
        """One train step happened: its hooks run; a stop ends the iteration."""
        self.ctx.advance(state, metrics)
        stop = _after_step(self.ctx)
        if stop is not None:
            _finish(self.ctx, stop)
            self._stopped = True

    def __exit__(self, kind, error, trace) -> bool:
        try:   # the preemption handler stays while a dead peer is named: torchrun's SIGTERM follows at once
            self._batches.close()
            if error is not None:    # a dead peer: stop at once, naming it, without a (collective) save
                lost = self.dist.lost_peer(error, self.checkpoints.latest() if self.checkpoints else None) \
                    if isinstance(error, Exception) else None
                if lost is not None:
                    raise lost from None
                return False
        finally:
            self._preemption.__exit__(kind, error, trace)
        self._close()
        return False

    def _close(self) -> None:
        ctx, logger = self.ctx, self.logger
        compiling = None if self._compiled_before is None else compile_seconds() - self._compiled_before
        wall = ctx.run.meter.wall()
        logger.print(f"wall time {wall:.1f}s (this session {wall - ctx.run.meter.before:.1f}s"
                     + (f", of which compiling {compiling:.1f}s)" if compiling else ", compile included)"))
        logger.flush()
        ctx.run.result.state = ctx.state
        if self._setup_peak is not None:
            _report_peaks(logger, int(ctx.state.step), ctx.state.step.device, self.dist, self._setup_peak)
        if ctx.run.result.unfinished:
            where = f"{self.checkpoints.folder / ckpt.STOPPED}" if self.checkpoints else \
                f"{ckpt.STOPPED} (written by rank 0)"
            raise RunStopped(f"{ctx.run.result.stop_reason}; its last state is {where}, not final.msgpack")


def _check_wired(cfg: TrainConfig, hooks: list) -> None:
    """A layer that ``cfg`` switches on (``recipes.train.hooks.RunHook``) whose loop hook the recipe did not hand
    the loop is an error naming it, never silently ignored."""
    keys = {h.key for h in hooks}
    for run_hook in cfg.run_hooks():
        if run_hook.loop_key is not None and run_hook.loop_key not in keys:
            raise UserError(f"{run_hook.loop_key}.* is switched on, but this recipe does not hand the training loop "
                            f"its {run_hook.loop_key!r} hook (a recipe whose config has that section must wire it)")


def _report_peaks(logger: Logger, step: int, device, dist: Dist, setup_peak: float) -> None:
    """Every rank's peak memory over the run, and while training: since :func:`_announce_parallel` reset it (CUDA's
    allocator peak, Linux's resident high-water mark; where it cannot be reset, both are the whole run's)."""
    training = dist.each(memory_mb(device))
    peaks = dist.each(max(setup_peak, memory_mb(device)))
    logger.print("peak memory per rank: " + ", ".join(f"rank {r} {mb:.0f} MiB (training {t:.0f} MiB)"
                                                      for r, (mb, t) in enumerate(zip(peaks, training))))
    logger.event(step, "peak_memory", mib=peaks, training_mib=training)


def _announce_parallel(logger: Logger, state: TrainState, steps: Steps, dist: Dist) -> Optional[float]:
    """The run log's first word on parallelism: the layout, and every rank's params + optimizer state bytes next
    to what one process holds (``core.parallel.shard``). Returns this rank's peak memory so far (setup: data, model,
    loading), and starts the peak afresh for the training (``core.io.logging.reset_peak_memory``); None in one
    process."""
    layout = steps.layout
    if not dist.enabled and layout is None:
        return None
    mine, whole = dist.each(state_bytes(state)), full_bytes(layout, state)
    what = layout.describe(steps.per_block) if layout else \
        f"ddp over {dist.world_size} ranks: params and optimizer state replicated"
    logger.print(f"parallel: {what}")
    logger.print("state bytes per rank (params + optimizer): "
                 + ", ".join(f"rank {r} {b / 2**20:.2f} MiB ({b / whole:.3f}x)" for r, b in enumerate(mine))
                 + f" of {whole / 2**20:.2f} MiB in one process")
    logger.event(int(state.step), "parallel", layout=what, state_bytes=mine, one_process_bytes=whole)
    setup_peak = memory_mb(state.step.device)
    reset_peak_memory(state.step.device)
    return setup_peak


def _pieces(cfg: TrainConfig, logger: Logger, checkpoints, extra, validation: Optional[Validation],
            measures: Measures, log: Optional[Hook], stopping: Stopping, steps: Steps, hooks: list,
            ctx: StepContext, dist: Dist) -> list:
    """The loop's hooks in the order they run after a step."""
    pieces = [FirstStepCheck(logger, steps.health, measures.expected_initial_loss), *hooks,
              log or TrainLog(cfg, logger, steps.health, ctx, measures.flops_per_token, _epoch_of(steps.batches))]
    if cfg.spike.enabled:
        # the disk fallback only in one process: rank 0 alone holds the checkpoint manager
        pieces.append(Rollback(cfg.spike, logger, ctx, None if dist.enabled else checkpoints))
    if validation is not None:
        pieces.append(Evaluation(cfg, logger, validation.loss, validation.sample, validation.perplexity))
    saving = Checkpointing(checkpoints, extra, logger, train=to_dict(cfg),
                           every_minutes=cfg.save_every_minutes, dist=dist, log_every=cfg.log_every,
                           export=steps.layout.deferred if steps.layout else None,
                           save_every=None if checkpoints else cfg.save_every,
                           shards=steps.layout if cfg.checkpoint_shards else None)
    return [*pieces, saving, stopping]


def _epoch_of(batches) -> Optional[Callable[[int], float]]:
    """``batches.epoch`` of the data under any wrappers (faults, distill's), or None (raw-text windows)."""
    while batches is not None and not hasattr(batches, "epoch"):
        batches = getattr(batches, "batches", None)
    return getattr(batches, "epoch", None)


def _after_step(ctx: StepContext) -> Optional[Stop]:
    """Run the hooks on this step: apply their jumps; the first stop ends the step (and the run)."""
    for hook in ctx.run.hooks:
        outcome = hook.after_step(ctx)
        if isinstance(outcome, Stop):
            return outcome
        if isinstance(outcome, Jump):
            ctx.apply(outcome)
            if outcome.restart:
                return None
    return None


def _finish(ctx: StepContext, stop: Stop) -> None:
    result = ctx.run.result
    result.stop_reason, result.stopped_early, result.unfinished = stop.reason, stop.early, stop.unfinished
    for hook in ctx.run.hooks:
        hook.on_stop(ctx, stop)
    if stop.announce is not None:
        stop.announce(ctx.run.result.checkpoint)
