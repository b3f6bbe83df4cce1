"""The training loop's checkpoint and stop hooks.

Checkpoints are written every ``save_every`` steps, every ``save_every_minutes`` of wall time, after every
evaluation (the manager keeps the best by
validation loss), at the end, and whenever the run stops early (a run that stops without finishing, a
``Stop(unfinished=True)``, as ``stopped.msgpack`` rather than ``final.msgpack``). Each holds the train state (with
its data
cursor), the loop's counters and every hook's ``state_dict``, so a run resumes exactly. The run stops
cleanly, with a checkpoint and the command that resumes it, on SIGTERM/SIGINT (preemption) or once the cost
meter reaches ``budget``; with several ranks they agree at log steps so all stop at the same step.
"""
from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from purestep.core.io import checkpoint as ckpt
from purestep.core.io import checkpoint_shards
from purestep.core.parallel.distributed import Dist
from purestep.core.io.logging import Logger
from purestep.recipes.train.hooks import Hook, StepContext, Stop


def resume_command(folder: Path) -> str:
    """This process's own command line, pointed at ``folder`` (what to run to continue this run)."""
    args = [a for a in sys.argv[1:] if not a.startswith(("out=", "resume="))]
    return shlex.join(["purestep", *args, f"out={folder}"])     # quoted: "sample_prompt=it's a b" survives a shell


class Checkpointing(Hook):
    """Saves at the last step (final), after evaluations, every ``save_every`` steps, once ``every_minutes``
    of wall time (``clock``, seconds) have passed since the last save, and when the run stops. ``manager``
    is None on data-parallel ranks other than 0 (rank 0 alone writes); with several ranks (``dist``) the
    wall-time decision is agreed at log steps (``log_every``), so every rank saves at the same step. ``export``
    (``core.parallel.shard.Layout.deferred`` under parallel=fsdp) turns the state into what is written, its sharded
    leaves gathered one at a time as the writer reaches them; the ranks that do not write make the same gathers.
    ``shards`` (that layout, with ``checkpoint_shards=true``): every rank writes its own pieces instead and rank 0 an
    index naming them (``core.io.checkpoint_shards``)."""
    clock: Callable[[], float] = staticmethod(time.monotonic)     # seconds; a test puts a fake clock here

    def __init__(self, manager: Optional[ckpt.CheckpointManager], extra: Callable[[], dict], logger: Logger,
                 train: Optional[dict] = None, *, every_minutes: float = 0.0, dist: Dist = Dist(),
                 log_every: int = 1, clock: Optional[Callable[[], float]] = None, export: Optional[Callable] = None,
                 save_every: Optional[int] = None, shards=None):
        self.manager, self.extra, self.logger, self.train, self.export = manager, extra, logger, train, export
        # checkpoint_shards=true: every rank writes its pieces (``shards``: the run's core.parallel.shard.Layout)
        # into rank 0's folder, rank 0 the index (core.io.checkpoint_shards)
        self.shards = shards
        self.folder = None if shards is None else Path(dist.share(str(manager.folder) if manager else None))
        # every rank saves at the same steps: under parallel=fsdp the ones without a manager gather for rank 0;
        # they count ``save_every``, rank 0 asks its manager
        self.save_every = save_every
        self.every_minutes, self.dist, self.log_every = every_minutes, dist, log_every
        if clock is not None:
            self.clock = clock
        self.last_saved = self.clock()

    def time_due(self, step: int) -> bool:
        """Whether ``every_minutes`` have passed since the last save (the same answer on every rank)."""
        if self.every_minutes <= 0:
            return False
        due = self.clock() - self.last_saved >= self.every_minutes * 60
        if self.dist.enabled:   # decide together, where the ranks already meet (the metrics pull)
            return self.dist.agree(due) if step % self.log_every == 0 else False
        return due

    def periodic(self, step: int) -> bool:
        """Whether ``step`` is a ``save_every`` step (the manager's rule, or the count given to the others)."""
        if self.manager is not None:
            return self.manager.should_save(step)
        return bool(self.save_every) and step > 0 and step % self.save_every == 0

    def save(self, ctx: StepContext, val_loss: Optional[float] = None, final: bool = False,
             stopped: Optional[str] = None) -> Optional[Path]:
        t0 = time.perf_counter()
        ctx.run.loop.wall_seconds = ctx.run.meter.wall(t0)
        self.last_saved = self.clock()
        if self.shards is not None:
            tree = self._write_shards(ctx)
        else:
            tree = ctx.state if self.export is None else self.export(ctx.state)
        if self.manager is None:
            if self.export is not None and self.shards is None:
                ckpt.make_deferred(tree)     # the writing rank gathers each leaf now: take part
            self.dist.barrier()              # wait (patiently) for rank 0's write
            return None
        extra = {**self.extra(), "loop": ctx.run.loop.to_dict()}
        if self.shards is not None:
            extra[checkpoint_shards.SHARDS] = [checkpoint_shards.shard_name(ctx.step, i, self.shards.writers())
                                               for i in range(self.shards.writers())]
        if self.train is not None:   # the training keys this run used: a resume compares them (setup.start)
            extra["train"] = self.train
        for hook in ctx.run.hooks:   # every hook's state (a strategy layer's choices and counters) resumes with the run
            if hook.key is not None:
                extra[hook.key] = hook.state_dict()
        ctx.run.result.checkpoint = self.manager.save(ctx.step, tree, extra=extra, val_loss=val_loss, final=final,
                                                  stopped=stopped)
        self.dist.barrier()   # the other ranks waited here: none sits in a short-timeout collective meanwhile
        ctx.run.meter.excluded += time.perf_counter() - t0
        return ctx.run.result.checkpoint

    def _write_shards(self, ctx: StepContext):
        """Write this rank's pieces of the state (a writer's), wait for every rank's, and return what rank 0's index
        holds: the state dict with each sharded leaf a marker (``core.io.checkpoint_shards``)."""
        writers, boxes = self.shards.writers(), {}
        if self.dist.rank < writers:    # under hsdp the other replicas hold the same pieces: they only wait
            data, boxes = self.shards.pieces(ctx.state)
            name = checkpoint_shards.shard_name(ctx.step, self.dist.rank, writers)
            ckpt.save(self.folder / name, data, step=ctx.step, extra={checkpoint_shards.BOXES: boxes})
        self.dist.barrier()     # every piece on disk before the index names it
        # rank 0 (a writer, holding a piece of every sharded leaf) builds the index; the others write nothing more
        return checkpoint_shards.split(ckpt.to_state_dict(ctx.state), set(boxes)) if self.manager else None

    def after_step(self, ctx: StepContext):
        val_loss = ctx.run.result.val_loss if ctx.evaluated else None
        if ctx.last:
            path = self.save(ctx, val_loss=val_loss, final=True)
            self.logger.print(f"saved final checkpoint {path}")
        elif (self.time_due(ctx.step) or ctx.evaluated
              or self.periodic(ctx.step)):
            self.save(ctx, val_loss=val_loss)
        return None

    def on_stop(self, ctx: StepContext, stop: Stop) -> None:
        self.save(ctx, val_loss=stop.val_loss, final=stop.final and not stop.unfinished,
                  stopped=stop.reason if stop.unfinished else None)


class Stopping(Hook):
    """Stops before the last step on preemption (SIGTERM/SIGINT) or once the cost reaches ``budget``."""

    def __init__(self, cfg, logger: Logger, preemption, dist: Dist = Dist(), resume_folder: Optional[Path] = None):
        self.cfg, self.logger, self.dist, self.resume_folder = cfg, logger, dist, resume_folder
        self.preemption = preemption   # core.io.telemetry.Preemption: the signal the loop caught, if any

    def after_step(self, ctx: StepContext):
        cfg = self.cfg
        if ctx.last:
            return None
        cost = ctx.run.meter.wall() / 3600 * cfg.cost_per_hour
        preemption = self.preemption
        stop = preemption.requested or bool(cfg.budget and cost >= cfg.budget)
        if self.dist.enabled:   # every rank must stop at the same step: decide together at log steps
            stop = self.dist.agree(stop) if ctx.step % cfg.log_every == 0 else False
        if not stop:
            return None
        if preemption.requested:
            reason = f"{preemption.signal} at step {ctx.step}"
            event = ("preempted", {"signal": preemption.signal})
        elif cfg.budget and cost >= cfg.budget:
            reason = f"budget {cfg.budget:g} reached (cost {cost:.4g}) at step {ctx.step}"
            event = ("budget", {"budget": cfg.budget, "cost": cost})
        else:
            reason, event = f"another rank stopped (preemption or budget) at step {ctx.step}", None
        step = ctx.step

        def announce(path: Optional[Path]) -> None:
            if event is not None:
                self.logger.event(step, event[0], **event[1])
            if path is not None:
                self.logger.print(f"{reason}: checkpoint {path}; to resume, run again: "
                                  f"{resume_command(self.resume_folder or path.parent)}")
        return Stop(reason, announce=announce)
