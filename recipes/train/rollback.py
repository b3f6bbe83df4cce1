"""Loss-spike rollback: recent copies of the train state in host memory, and the hook that restores one.

PaLM (Chowdhery et al. 2022, section 5.1) restarted from a checkpoint about 100 steps before a spike and
skipped 200-500 batches; OPT-175B (Zhang et al. 2022, logbook) lowered the learning rate after such restarts.
Here the snapshots are in memory (``spike.snapshot_every``), the step's detector (``core.spike``) flags a
hard spike and its onset, and at the next log step the loop restores the newest snapshot at least
``rollback_back`` steps before the onset, skips ``skip_ahead`` batches and scales the learning rate by
``lr_factor``; more than ``max_rollbacks`` within ``window`` steps stops the run.
"""
from __future__ import annotations

from typing import Optional

import torch

import optim
from core.logging import Logger
from core.spike import clear as clear_monitor
from core.state import TrainState
from core.tree import cast, tree_map
from recipes.train.hooks import Hook, Jump, StepContext, Stop


class SnapshotRing:
    """Recent copies of the train state in host memory, for rolling back past a loss spike."""

    def __init__(self, every: int, keep: int):
        self.every, self.keep = max(every, 1), max(keep, 1)
        self.snaps: list[tuple[int, TrainState]] = []   # (step, state on the CPU)

    def offer(self, step: int, state: TrainState, start: bool = False) -> None:
        """Keep a copy of ``state`` at every ``every``-th step, and at the ``start`` of a session (resumed
        anywhere), under its own step."""
        if (start or step % self.every == 0) and (not self.snaps or self.snaps[-1][0] != step):
            self.snaps.append((step, tree_map(lambda t: t.detach().to("cpu", copy=True), state)))
            del self.snaps[:-self.keep]

    def before(self, step: int) -> Optional[tuple[int, TrainState]]:
        """The newest snapshot at or before ``step`` (else the oldest one), dropping everything newer."""
        if not self.snaps:
            return None
        older = [i for i, (s, _) in enumerate(self.snaps) if s <= step]
        i = older[-1] if older else 0
        del self.snaps[i + 1:]
        return self.snaps[i]


class Rollback(Hook):
    """Keeps the snapshot ring; on a hard spike (``ctx.values["spike"]``) restores a snapshot from before the
    onset, letting every hook adjust it (``on_rollback``), or stops the run at the rollback cap."""

    def __init__(self, spike, logger: Logger, ctx: StepContext):
        self.spike, self.logger = spike, logger
        self.ring = SnapshotRing(spike.snapshot_every, spike.rollback_back // spike.snapshot_every + 2)
        self.ring.offer(ctx.step, ctx.state, start=True)   # a starting point to roll back to

    def after_step(self, ctx: StepContext):
        if ctx.values is not None and ctx.values.get("spike", 0.0) > 0:
            return self.roll_back(ctx)
        self.ring.offer(ctx.step, ctx.state)
        return None

    def roll_back(self, ctx: StepContext):
        """Restore a snapshot from before the spike's onset, skip the batches since, maybe lower the LR."""
        spike, loop, step = self.spike, ctx.loop, ctx.step
        onset = int(ctx.state.monitor["onset"])
        recent = [t for t in loop.rollbacks if loop.ticks - t < spike.window]
        target = self.ring.before(onset - spike.rollback_back)
        if target is None:
            return self.cap(ctx)
        to_step, snap = target
        cursor = ctx.cursor + spike.skip_ahead
        skipped = cursor - int(snap.cursor)
        device = ctx.state.step.device
        restored = cast(snap, device=device)
        for hook in ctx.hooks:   # e.g. the orchestrator continues the restored state with its safety strategy
            restored = hook.on_rollback(step, to_step, restored)
        restored = restored._replace(cursor=torch.tensor(cursor, dtype=torch.int64, device=device),
                                     monitor=clear_monitor(restored.monitor),
                                     opt_state=optim.scale_lr(restored.opt_state, spike.lr_factor))
        self.logger.event(step, "rollback", onset=onset, to_step=to_step, skipped_batches=skipped,
                          lr_factor=spike.lr_factor, number=len(recent) + 1)
        self.logger.print(f"loss spike (onset step {onset}) detected at step {step}: rolled back to step {to_step}, "
                          f"skipping {skipped} batches" + (f", lr x{spike.lr_factor}" if spike.lr_factor != 1 else ""))
        jump = Jump(restored, to_step, cursor, restart=True)
        loop.rollbacks.append(loop.ticks)
        if len(recent) + 1 < spike.max_rollbacks:
            return jump
        ctx.apply(jump)
        return self.cap(ctx)

    def cap(self, ctx: StepContext) -> Stop:
        spike = self.spike
        reason = (f"{spike.max_rollbacks} rollbacks within {spike.window} steps: stopping "
                  f"(the state is the last rollback's; lower lr or inspect the data)")
        self.logger.event(ctx.step, "rollback_cap", max_rollbacks=spike.max_rollbacks, window=spike.window)
        self.logger.print(reason)
        return Stop(reason, final=True)
