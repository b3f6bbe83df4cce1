"""Loss-spike rollback: a bounded ring of train-state copies in host memory, the run's checkpoints on disk
behind it, and the hook that restores one.

PaLM (Chowdhery et al. 2022, section 5.1) restarted from a checkpoint about 100 steps before a spike and
skipped 200-500 batches; OPT-175B (Zhang et al. 2022, logbook) lowered the learning rate after such restarts.
The step's detector (``core.spike``) flags a hard spike and its onset; at the next log step the loop restores
the newest state at least ``rollback_back`` steps before the onset, skips ``skip_ahead`` batches and scales
the learning rate by ``lr_factor``; more than ``max_rollbacks`` within ``window`` steps stops the run without
finishing (its state written as ``stopped.msgpack``, exit code 4: ``core.exits.RunStopped``), and so does a spike
with nothing before its onset to roll back to.

Where that state comes from:

- The ring: ``spike.snapshots`` copies in host memory (default one: host memory for rollback is one state's
  size), a fixed number, so a run rolls back the same way on every machine. A copy is taken at a log step
  whose pulled metrics and detector show no spike and no suspect streak in progress (so it predates every
  onset still to come) once the newest copy is ``2 * rollback_back / snapshots`` steps old (rounded up to a
  multiple of ``snapshot_every``); the oldest is freed before the new one is made. With two or more copies one
  is always at least ``rollback_back`` steps old (once the session is). The single default copy (the session's starting state until
  the first renewal) is renewed every ``2 * rollback_back`` steps: it reaches back far enough for the onsets in
  the second half of each period, and is never more than ``2 * rollback_back`` steps behind them.
- The disk, for the onsets the ring does not reach: the run's step checkpoints (``core.io.checkpoint``), loaded
  with the current state as template. The newest copy or checkpoint at or before ``onset - rollback_back``
  wins (the copy on a tie); if none reaches that far, the oldest one before the onset. A checkpoint that a
  rollback abandoned (newer than the state the run continued from, and not rewritten since) is never used.
  The checkpoint manager's ``keep_last`` pruning spares the newest checkpoint at or before
  ``step - rollback_back``; when a rollback still falls back to an older state (the checkpoint it wanted was
  pruned or unreadable) the log says so. Data-parallel runs use the ring alone (rank 0 alone sees the files).

The printed line and the ``rollback`` event (metrics.jsonl, TensorBoard) name the source used.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch

from purestep import optim
from purestep.core.io import checkpoint as ckpt
from purestep.core.io.logging import Logger
from purestep.core.spike import SpikeConfig, clear as clear_monitor
from purestep.core.state import TrainState
from purestep.core.tree import tree_map
from purestep.recipes.train.hooks import Hook, Jump, StepContext, Stop


def state_copy(state: TrainState, device="cpu") -> TrainState:
    """A copy of ``state`` on ``device`` (host memory by default)."""
    return tree_map(lambda t: t.detach().to(device, copy=True), state)


def ring_gap(spike: SpikeConfig) -> int:
    """Steps between the ring's copies: ``2 * rollback_back / snapshots`` rounded up to a multiple of
    ``snapshot_every``, at least ``snapshot_every``."""
    every = spike.snapshot_every
    return every * max(1, math.ceil(2 * spike.rollback_back / (max(spike.snapshots, 1) * every)))


class SnapshotRing:
    """At most ``keep`` copies of the train state in host memory, ``gap`` steps apart, for rolling back past
    a loss spike."""

    def __init__(self, keep: int, gap: int):
        self.keep, self.gap = keep, max(gap, 1)
        self.snaps: list[tuple[int, TrainState]] = []   # (step, state on the CPU), oldest first

    def due(self, step: int) -> bool:
        """A copy of the state at ``step`` would be taken (the newest is ``gap`` steps old, or none is held)."""
        return self.keep > 0 and (not self.snaps or step - self.snaps[-1][0] >= self.gap)

    def take(self, step: int, state: TrainState) -> None:
        """Keep a copy of ``state`` under ``step``, freeing the oldest first when the ring is full, so it never
        holds more than ``keep`` copies, not even while copying."""
        if self.keep == 0 or (self.snaps and self.snaps[-1][0] == step):
            return
        del self.snaps[:max(len(self.snaps) - self.keep + 1, 0)]
        self.snaps.append((step, state_copy(state)))

    def steps(self) -> list[int]:
        return [s for s, _ in self.snaps]

    def get(self, step: int) -> TrainState:
        return next(snap for s, snap in self.snaps if s == step)

    def drop_after(self, step: int) -> None:
        """Forget the copies newer than ``step`` (the run continues from ``step``)."""
        self.snaps = [(s, snap) for s, snap in self.snaps if s <= step]


def _settled(state: TrainState) -> bool:
    """The detector in ``state`` shows no hard spike and no suspect streak in progress (one transfer)."""
    monitor = state.monitor
    if not monitor:
        return True
    streak, hard = torch.stack([monitor["streak"], monitor["hard"]]).tolist()
    return streak == 0 and hard == 0


def _file_key(path: Path) -> Optional[tuple[int, int]]:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


class Rollback(Hook):
    """Keeps the snapshot ring; on a hard spike (``ctx.window.values["spike"]``) restores a snapshot or checkpoint
    from before the onset, letting every hook adjust it (``on_rollback``), or stops the run at the rollback
    cap. ``checkpoints``: the run's checkpoint manager, None for the ring alone."""

    def __init__(self, spike: SpikeConfig, logger: Logger, ctx: StepContext,
                 checkpoints: Optional[ckpt.CheckpointManager] = None):
        self.spike, self.logger, self.checkpoints = spike, logger, checkpoints
        self.ring = SnapshotRing(spike.snapshots, ring_gap(spike))
        self.ring.take(ctx.step, ctx.state)   # a starting point to roll back to
        self.abandoned: dict[str, tuple[int, int]] = {}   # step file -> (inode, mtime) when it was abandoned
        if checkpoints is not None:
            checkpoints.keep_back = spike.rollback_back   # pruning spares what a rollback may need
            self._abandon_after(ctx.step)                 # files of a later step are another history's

    def after_step(self, ctx: StepContext):
        if ctx.window.values is None:   # not a log step: nothing pulled, nothing vetted
            return None
        if ctx.window.values.get("spike", 0.0) > 0:
            return self.roll_back(ctx)
        if self.ring.due(ctx.step) and _settled(ctx.state):
            self.ring.take(ctx.step, ctx.state)
        return None

    def roll_back(self, ctx: StepContext):
        """Restore a state from before the spike's onset, skip the batches since, maybe lower the LR."""
        spike, loop, step = self.spike, ctx.run.loop, ctx.step
        onset = int(ctx.state.monitor["onset"])
        recent = [t for t in loop.rollbacks if loop.ticks - t < spike.window]
        device = ctx.state.step.device
        found = self.restore(onset, ctx.state, device)
        if found is None:
            return self.stop(ctx, f"loss spike (onset step {onset}) at step {step} and no snapshot or checkpoint "
                                  f"from before it to roll back to")
        to_step, restored, path, note = found
        cursor = ctx.cursor + spike.skip_ahead
        skipped = cursor - int(restored.cursor)
        for hook in ctx.run.hooks:   # a hook may adjust the restored state (a strategy layer: switch to its safe one)
            restored = hook.on_rollback(step, to_step, restored)
        restored = restored._replace(cursor=torch.tensor(cursor, dtype=torch.int64, device=device),
                                     monitor=clear_monitor(restored.monitor),
                                     opt_state=optim.scale_lr(restored.opt_state, spike.lr_factor))
        source = {"source": "memory"} if path is None else {"source": "checkpoint", "checkpoint": str(path)}
        if note:
            source["note"] = note
        self.logger.event(step, "rollback", onset=onset, to_step=to_step, skipped_batches=skipped,
                          lr_factor=spike.lr_factor, number=len(recent) + 1, **source)
        origin = "from the in-memory snapshot" if path is None else f"from checkpoint {path}"
        self.logger.print(f"loss spike (onset step {onset}) detected at step {step}: rolled back to step {to_step} "
                          f"{origin}, skipping {skipped} batches"
                          + (f", lr x{spike.lr_factor}" if spike.lr_factor != 1 else "")
                          + (f" ({note})" if note else ""))
        jump = Jump(restored, to_step, cursor, restart=True)
        loop.rollbacks.append(loop.ticks)
        if len(recent) + 1 < spike.max_rollbacks:
            return jump
        ctx.apply(jump)
        return self.cap(ctx, step)

    def candidates(self, onset: int) -> list[tuple[int, Optional[Path]]]:
        """Where a rollback from a spike at ``onset`` may go, best first: ``(step, None)`` for a copy in memory,
        ``(step, path)`` for a checkpoint. The newest at or before ``onset - rollback_back`` (the copy on a tie)
        and older ones; then, when none reaches that far, the oldest before the onset and newer ones."""
        limit = onset - self.spike.rollback_back
        latest = max(limit, onset - 1)
        found = [(s, None) for s in self.ring.steps() if s <= latest]
        found += [(s, p) for s, p in self._disk() if s <= latest]
        reaching = sorted((c for c in found if c[0] <= limit), key=lambda c: (c[0], c[1] is None), reverse=True)
        short = sorted((c for c in found if c[0] > limit), key=lambda c: (c[0], c[1] is not None))
        return reaching + short

    def restore(self, onset: int, template: TrainState,
                device) -> Optional[tuple[int, TrainState, Optional[Path], str]]:
        """The first candidate that loads: its step, the state on ``device``, its checkpoint (None: the ring)
        and a note when it is not the newest state ``rollback_back`` steps before the onset; None if none."""
        problems = []
        for to_step, path in self.candidates(onset):
            if path is None:
                # a copy: the train step donates (writes into) the state it is given, and the ring keeps its own
                restored = state_copy(self.ring.get(to_step), device)
            else:
                try:
                    restored = ckpt.load(path, template=template, device=device)["state"]
                except ckpt.CheckpointError as e:
                    problems.append(f"skipped checkpoint {e}")
                    continue
            self.ring.drop_after(to_step)
            self._abandon_after(to_step)
            return to_step, restored, path, self._shortfall(onset, to_step, problems)
        return None

    def _shortfall(self, onset: int, to_step: int, problems: list) -> str:
        """Why the rollback did not go to the newest state ``rollback_back`` steps before the onset ("" if it did)."""
        back, limit = self.spike.rollback_back, onset - self.spike.rollback_back
        notes = list(problems)
        if to_step > limit:
            notes.append(f"nothing in memory or on disk is {back} steps before the onset: the oldest state before it")
        pruned = [s for s in (self.checkpoints.pruned if self.checkpoints is not None else [])
                  if s <= limit and (to_step > limit or s > to_step)]
        if pruned:
            notes.append(f"checkpoint step {max(pruned)}, the one to use, was deleted by "
                         f"keep_last={self.checkpoints.keep_last}: fell back to step {to_step}")
        return "; ".join(notes)

    def _disk(self) -> list[tuple[int, Path]]:
        """The run's step checkpoints on this history (none without a checkpoint manager)."""
        if self.checkpoints is None:
            return []
        return [(s, p) for s, p in self.checkpoints.step_files()
                if p.name not in self.abandoned or _file_key(p) not in (None, self.abandoned[p.name])]

    def _abandon_after(self, step: int) -> None:
        """The checkpoints newer than ``step`` belong to a history the run left: unusable until rewritten."""
        if self.checkpoints is None:
            return
        for s, p in self.checkpoints.step_files():
            if s > step and (key := _file_key(p)) is not None:
                self.abandoned[p.name] = key

    def cap(self, ctx: StepContext, step: int) -> Stop:
        """The rollback at ``step`` was the ``max_rollbacks``-th within ``window`` steps: stop with its state."""
        spike = self.spike
        self.logger.event(ctx.step, "rollback_cap", max_rollbacks=spike.max_rollbacks, window=spike.window)
        return self.stop(ctx, f"{spike.max_rollbacks} rollbacks within {spike.window} steps (the last at step "
                              f"{step}, back to step {ctx.step})")

    def stop(self, ctx: StepContext, reason: str) -> Stop:
        """The run stops without finishing (``core.exits.RunStopped``, exit code 4): its state is not final."""
        self.logger.print(f"{reason}: stopping; lower lr or inspect the data")
        return Stop(reason, unfinished=True)
