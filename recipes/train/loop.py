"""The training loop every recipe shares: step, log, evaluate, sample, checkpoint, stop.

A recipe builds a pure ``train_step`` and hands it here with the data and the sinks. The loop is the
only place that talks to the host: it pulls the step's 0-d metrics every ``log_every`` steps in one
transfer (Levanter's deferred metrics), evaluates on fixed validation windows, keeps checkpoints
(every ``save_every``, the best by validation loss, a final one) and stops early after ``patience``
evaluations without improvement. Everything needed to resume exactly is in the checkpoint: the train
state (with its data cursor) and the loop's own counters.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

import optim
from core import checkpoint as ckpt
from core.config import UserError
from core.distributed import Dist
from core.logging import Logger, memory_mb
from core.spike import clear as clear_monitor
from core.state import TrainState
from core.telemetry import Preemption, peak_flops
from core.step import make_eval_step, make_train_step
from core.tree import cast, tree_map
from optim.health import GradientHealth
from recipes.train.faults import FaultyBatches, with_faults
from recipes.train.config import TrainConfig


def evaluate(eval_step: Callable, params, batches, frozen=None, dist: Dist = Dist()) -> float:
    """Mean validation loss over fixed batches (one host transfer at the end).

    With several ranks each evaluates its own rows of every (global) batch and the means are averaged,
    so the validation set and the result do not depend on the number of ranks.
    """
    losses = []
    for batch in batches:
        if dist.enabled:
            rows = batch["x"].shape[0] // dist.world_size
            batch = {k: v[dist.rank * rows:(dist.rank + 1) * rows] for k, v in batch.items()}
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
    history: list = field(default_factory=list)   # (step, val_loss) of every evaluation


@dataclass
class Steps:
    """What ``build_steps`` wires for a recipe."""
    train: Callable
    eval: Callable
    health: Optional[GradientHealth]
    batches: object      # the batch source the loop reads (with faults when configured)


def build_steps(cfg: TrainConfig, loss_fn: Callable, optimizer, params, batches, device: torch.device,
                vocab_size: int, dist: Dist = Dist()) -> Steps:
    """The train and eval steps every training recipe uses, configured from the common keys.

    ``loss_fn(params, batch, key[, frozen])``: precision, accumulation, remat, the spike detector,
    gradient health and fault injection all come from ``cfg``; with several ranks the step averages
    gradients across them (``dist``).
    """
    health = GradientHealth(params, clip_norm=cfg.grad_clip if cfg.clipping == "global" else None) \
        if cfg.health else None
    train_loss = loss_fn
    if cfg.fault.active:
        train_loss = with_faults(loss_fn)
        batches = FaultyBatches(batches, cfg.fault, vocab_size, cfg.seed)
    train = make_train_step(train_loss, optimizer, grad_accum=cfg.grad_accum, precision=cfg.dtype,
                            device_type=device.type, compile=cfg.compile, remat=cfg.remat,
                            extra_metrics=health.metrics if health else None,
                            spike=cfg.spike if cfg.spike.enabled else None,
                            reduce=dist.all_reduce_mean if dist.enabled else None)
    evaluate_step = make_eval_step(loss_fn, precision=cfg.dtype, device_type=device.type, compile=cfg.compile)
    return Steps(train, evaluate_step, health, batches)


class SnapshotRing:
    """Recent copies of the train state in host memory, for rolling back past a loss spike."""

    def __init__(self, every: int, keep: int):
        self.every, self.keep = max(every, 1), max(keep, 1)
        self.snaps: list[tuple[int, TrainState]] = []   # (step, state on the CPU)

    def offer(self, step: int, state: TrainState) -> None:
        if step % self.every == 0 and (not self.snaps or self.snaps[-1][0] != step):
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


def fit(cfg: TrainConfig, state: TrainState, steps: Steps, *, logger: Logger,
        checkpoints: Optional[ckpt.CheckpointManager], checkpoint_extra: Callable[[], dict],
        evaluate_fn: Optional[Callable[[object], float]] = None, sample_fn: Optional[Callable[[object], str]] = None,
        loop: Optional[LoopState] = None, frozen=None, tokens_per_step: int = 0, flops_per_token: float = 0.0,
        expected_initial_loss: Optional[float] = None, dist: Dist = Dist(), orchestrator=None,
        perplexity: bool = True) -> FitResult:
    """Train ``state`` until ``cfg.steps``; returns the final state and what happened.

    ``checkpoints`` is None on data-parallel ranks other than 0 (rank 0 alone writes); ``dist`` makes
    the ranks agree on host-side stops (preemption, budget) at log steps. ``perplexity`` says the
    validation loss is a next-token NLL, so ``exp`` of it is reported too.

    Stops early, always with a checkpoint, on: ``patience`` evaluations without improvement, SIGTERM or
    SIGINT (preemption: finish the step, save, return so the program exits 0), the cost ``budget``, or
    too many rollbacks. ``orchestrator`` (``recipes/orchestrator/driver.py``, built by the recipe when
    ``orchestrator.enabled``) is called after every step and from the rollback; its state is checkpointed.
    """
    if cfg.orchestrator.enabled and orchestrator is None:   # orchestrator: never silently ignored
        raise UserError("orchestrator.enabled=true, but this recipe does not build an orchestrator "
                        "(recipes/orchestrator/driver.py; recipes/standard.py shows the wiring)")
    loop = loop or LoopState()
    session_start, wall_before = time.perf_counter(), loop.wall_seconds
    peak = peak_flops(state.step.device, cfg.peak_flops)
    step, cursor = int(state.step), int(state.cursor)
    result = FitResult(state, loop)
    device = state.step.device
    spike = cfg.spike if cfg.spike.enabled else None
    ring = SnapshotRing(spike.snapshot_every, spike.rollback_back // spike.snapshot_every + 2) if spike else None
    pending: list[dict] = []
    last_log_time, last_log_tokens = time.perf_counter(), loop.tokens
    excluded = 0.0   # seconds spent evaluating/saving since the last log (not training throughput)

    def save(val_loss=None, final=False):
        nonlocal excluded
        t0 = time.perf_counter()
        loop.wall_seconds = wall_before + (t0 - session_start)
        if checkpoints is None:
            return None
        extra = {**checkpoint_extra(), "loop": loop.to_dict()}
        if orchestrator is not None:  # orchestrator: its strategy, bandit and counters resume with the run
            extra["orchestrator"] = orchestrator.state_dict()
        path = checkpoints.save(step, result.state, extra=extra, val_loss=val_loss, final=final)
        excluded += time.perf_counter() - t0
        return path

    def run_eval():
        nonlocal excluded
        t0 = time.perf_counter()
        val = evaluate_fn(result.state.params)
        result.val_loss = val
        result.history.append((step, val))
        improved = val < loop.best_val
        loop.best_val, loop.bad_evals = (val, 0) if improved else (loop.best_val, loop.bad_evals + 1)
        values = {"val/loss": val}
        if perplexity:
            values["val/perplexity"] = math.exp(min(val, 50.0))
        logger.scalars(step, values)
        shown = f"{val:.4f}, perplexity {values['val/perplexity']:.2f}" if perplexity else f"{val:.6g}"
        logger.print(f"step {step}: val loss {shown}"
                     + ("" if improved else f" (no improvement for {loop.bad_evals} evaluation(s))"))
        if sample_fn is not None:
            text = sample_fn(result.state.params)
            logger.text(step, "samples", "```\n" + text + "\n```")
            logger.print(f"sample at step {step}:\n{text}\n")
        excluded += time.perf_counter() - t0

    def roll_back() -> bool:
        """Restore a snapshot from before the spike's onset, skip the batches since, maybe lower the LR.
        Returns False when the rollback cap is reached (the run then stops)."""
        nonlocal step, cursor
        onset = int(result.state.monitor["onset"])
        recent = [t for t in loop.rollbacks if loop.ticks - t < spike.window]
        target = ring.before(onset - spike.rollback_back)
        if target is None:
            return False
        to_step, snap = target
        cursor += spike.skip_ahead
        skipped = cursor - int(snap.cursor)
        restored = cast(snap, device=device)
        if orchestrator is not None:  # orchestrator: continue the restored state with the safety strategy
            restored = orchestrator.on_rollback(step, to_step, restored)
        restored = restored._replace(cursor=torch.tensor(cursor, dtype=torch.int64, device=device),
                                     monitor=clear_monitor(restored.monitor),
                                     opt_state=optim.scale_lr(restored.opt_state, spike.lr_factor))
        logger.event(step, "rollback", onset=onset, to_step=to_step, skipped_batches=skipped,
                     lr_factor=spike.lr_factor, number=len(recent) + 1)
        logger.print(f"loss spike (onset step {onset}) detected at step {step}: rolled back to step {to_step}, "
                     f"skipping {skipped} batches" + (f", lr x{spike.lr_factor}" if spike.lr_factor != 1 else ""))
        result.state, step = restored, to_step
        loop.rollbacks.append(loop.ticks)
        return len(recent) + 1 < spike.max_rollbacks

    if ring is not None:
        ring.offer(step - step % ring.every, result.state)   # a starting point to roll back to
    with Preemption() as preemption:
        while step < cfg.steps:
            batch = steps.batches.get(cursor)
            result.state, metrics = steps.train(result.state, batch, frozen)
            step, cursor = step + 1, cursor + 1
            loop.tokens += tokens_per_step
            loop.ticks += 1
            pending.append(metrics)

            if loop.ticks == 1:
                _first_step_checks(metrics, steps.health, logger, expected_initial_loss)

            # --- orchestrator hook (recipes/orchestrator/driver.py): decisions, safety, nowcasting -----------------
            if orchestrator is not None:
                jump = orchestrator.after_step(result.state, metrics, step=step, cursor=cursor, frozen=frozen)
                if jump is not None:  # the winner's branch (its steps kept), a nowcast, or a safety flag
                    result.state, step, cursor = jump.state, jump.step, jump.cursor
                    pending.extend(jump.metrics)
                    loop.ticks += jump.ticks
                    loop.tokens += jump.ticks * tokens_per_step
            # --- end of the orchestrator hook --------------------------------------------------------------

            last = step == cfg.steps
            if step % cfg.log_every == 0 or last:
                values, health = _pull(pending)
                interval = len(pending)
                pending.clear()
                now = time.perf_counter()
                seconds = max(now - last_log_time - excluded, 1e-9)
                tps = (loop.tokens - last_log_tokens) / seconds
                wall = wall_before + (now - session_start)
                values.update({"tokens_per_sec": tps, "memory_mb": memory_mb(device), "wall_hours": wall / 3600})
                if peak and flops_per_token:
                    values["mfu"] = tps * flops_per_token / peak
                if cfg.cost_per_hour:
                    values["cost"] = wall / 3600 * cfg.cost_per_hour
                logged = logger.scalars(step, {f"train/{k}" if k in ("loss", "grad_norm") else k: v
                                               for k, v in values.items()})
                if health is not None and steps.health is not None:
                    logger.scalars(step, steps.health.to_scalars(health))
                    for tag, hist in steps.health.histograms(health).items():
                        logger.histogram(step, tag, hist)
                logger.progress(step, cfg.steps, loss=logged["train/loss"], tokens_per_sec=tps,
                                extra={"lr": logged["lr"]} if "lr" in logged else None)
                last_log_time, last_log_tokens, excluded = now, loop.tokens, 0.0
                if values.get("spike", 0.0) > 0:
                    if not roll_back():
                        result.stop_reason = (f"{spike.max_rollbacks} rollbacks within {spike.window} steps: stopping "
                                              f"(the state is the last rollback's; lower lr or inspect the data)")
                        logger.event(step, "rollback_cap", max_rollbacks=spike.max_rollbacks, window=spike.window)
                        logger.print(result.stop_reason)
                        save(final=True)
                        break
                    continue
                if values.get("skipped", 0.0) > 0:
                    logger.print(f"warning: {round(values['skipped'] * interval)} non-finite step(s) up to step {step} "
                                 f"were skipped (parameters untouched)")
            if ring is not None:
                ring.offer(step, result.state)

            evaluated = False
            if evaluate_fn is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or last):
                run_eval()
                evaluated = True
                if cfg.patience and loop.bad_evals >= cfg.patience:
                    logger.print(f"early stopping at step {step}: no better validation loss in "
                                 f"{cfg.patience} evaluations (best {loop.best_val:.4f})")
                    logger.event(step, "early_stop", best_val=loop.best_val, patience=cfg.patience)
                    result.stopped_early = True
                    save(val_loss=result.val_loss, final=True)
                    break
            if last:
                path = save(val_loss=result.val_loss if evaluated else None, final=True)
                logger.print(f"saved final checkpoint {path}")
            elif evaluated or (checkpoints is not None and checkpoints.should_save(step)):
                save(val_loss=result.val_loss if evaluated else None)
            if last:
                break
            cost = (wall_before + time.perf_counter() - session_start) / 3600 * cfg.cost_per_hour
            stop = preemption.requested or bool(cfg.budget and cost >= cfg.budget)
            if dist.enabled:   # every rank must stop at the same step: decide together at log steps
                stop = dist.agree(stop) if step % cfg.log_every == 0 else False
            if stop:
                path = save()
                if preemption.requested:
                    result.stop_reason = f"{preemption.signal} at step {step}"
                    logger.event(step, "preempted", signal=preemption.signal)
                elif cfg.budget and cost >= cfg.budget:
                    result.stop_reason = f"budget {cfg.budget:g} reached (cost {cost:.4g}) at step {step}"
                    logger.event(step, "budget", budget=cfg.budget, cost=cost)
                else:
                    result.stop_reason = f"another rank stopped (preemption or budget) at step {step}"
                if checkpoints is not None:
                    logger.print(f"{result.stop_reason}: checkpoint {path}; to resume, run again: "
                                 f"{resume_command(checkpoints.folder)}")
                break
    logger.flush()
    return result


def resume_command(folder: Path) -> str:
    """This process's own command line, pointed at ``folder`` (what to run to continue this run)."""
    args = [a for a in sys.argv[1:] if not a.startswith(("out=", "resume="))]
    return " ".join(["bin/run", *args, f"out={folder}"])


def _first_step_checks(metrics: dict, health: Optional[GradientHealth], logger: Logger,
                       expected_initial_loss: Optional[float]) -> None:
    """After the first step: is the loss near ln(vocab), and which parameters got no or a bad gradient."""
    if expected_initial_loss is not None:
        first = metrics["loss"].item()
        if abs(first - expected_initial_loss) > 0.25 * expected_initial_loss:
            logger.print(f"warning: initial loss {first:.3f} is far from ln(vocab) = {expected_initial_loss:.3f}; "
                         f"check the init and the data")
    if health is not None and "health" in metrics:
        problems = health.report(metrics["health"].cpu())
        for name, problem in problems:
            logger.print(f"gradient check after step 1: {name}: {problem}")
        if problems:
            logger.event(1, "gradient_report", problems=[f"{n}: {p}" for n, p in problems])


def _pull(pending: list[dict]) -> tuple[dict, Optional[torch.Tensor]]:
    """Means of the buffered 0-d step metrics (the loss, clip activity, ...), the last value of the rest,
    and the last packed health tensor: one host transfer for the whole interval."""
    keys = [k for k, v in pending[-1].items() if v.dim() == 0]
    pending = [m for m in pending if all(k in m for k in keys)]   # a strategy switch may change the keys
    stacked = torch.stack([torch.stack([m[k].float() for k in keys]) for m in pending]).cpu()
    means, lasts = stacked.mean(0).tolist(), stacked[-1].tolist()
    values = {k: (lasts[i] if k in LAST_VALUE else means[i]) for i, k in enumerate(keys)}
    health = pending[-1].get("health")
    return values, None if health is None else health.cpu()


LAST_VALUE = ("lr", "loss_scale", "spike", "z_loss", "z_grad")
