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
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional

import torch

import optim
from core import checkpoint as ckpt
from core.logging import Logger, memory_mb
from core.state import TrainState
from optim import schedules
from recipes.train_config import TrainConfig


def run_folder(cfg: TrainConfig, recipe: str) -> Path:
    """``out``, or ``runs/<recipe>-<name>``, or ``runs/<recipe>-<timestamp>``."""
    if cfg.out:
        return Path(cfg.out)
    return Path("runs") / f"{recipe}-{cfg.name or datetime.now().strftime('%Y%m%d-%H%M%S')}"


def make_optimizer(cfg: TrainConfig):
    """Global-norm clipping, then AdamW with the configured schedule (norms/biases/embeddings not decayed)."""
    total = cfg.decay_steps or cfg.steps
    schedule = schedules.make(cfg.lr_schedule, warmup=cfg.warmup_steps, total=total,
                              floor=cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0, every=max(total // 3, 1))
    adamw = optim.adamw(lr=cfg.lr, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay, schedule=schedule)
    return optim.chain(optim.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip > 0 else adamw


def evaluate(eval_step: Callable, params, batches, frozen=None) -> float:
    """Mean validation loss over fixed batches (one host transfer at the end)."""
    losses = [eval_step(params, batch, frozen)["loss"] for batch in batches]
    return torch.stack(losses).mean().item()


@dataclass
class LoopState:
    """The loop's own counters, saved in every checkpoint next to the train state."""
    best_val: float = math.inf
    bad_evals: int = 0
    tokens: int = 0
    train_seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"best_val": self.best_val if math.isfinite(self.best_val) else None, "bad_evals": self.bad_evals,
                "tokens": self.tokens, "train_seconds": self.train_seconds}

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "LoopState":
        d = d or {}
        best = d.get("best_val")
        return cls(math.inf if best is None else best, d.get("bad_evals", 0), d.get("tokens", 0),
                   d.get("train_seconds", 0.0))


@dataclass
class FitResult:
    state: TrainState
    loop: LoopState
    val_loss: Optional[float] = None
    stopped_early: bool = False
    history: list = field(default_factory=list)   # (step, val_loss) of every evaluation


def fit(cfg: TrainConfig, state: TrainState, train_step: Callable, batches, *, logger: Logger,
        checkpoints: ckpt.CheckpointManager, checkpoint_extra: Callable[[], dict],
        evaluate_fn: Optional[Callable[[object], float]] = None, sample_fn: Optional[Callable[[object], str]] = None,
        loop: Optional[LoopState] = None, frozen=None, tokens_per_step: int = 0,
        expected_initial_loss: Optional[float] = None) -> FitResult:
    """Train ``state`` until ``cfg.steps``; returns the final state and what happened."""
    loop = loop or LoopState()
    step, cursor = int(state.step), int(state.cursor)
    result = FitResult(state, loop)
    device = state.step.device
    pending: list[dict] = []
    last_log_time, last_log_tokens = time.perf_counter(), loop.tokens
    excluded = 0.0   # seconds spent evaluating/saving since the last log (not training throughput)

    def save(val_loss=None, final=False):
        nonlocal excluded
        t0 = time.perf_counter()
        extra = {**checkpoint_extra(), "loop": loop.to_dict()}
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
        values = {"val/loss": val, "val/perplexity": math.exp(min(val, 50.0))}
        logger.scalars(step, values)
        logger.print(f"step {step}: val loss {val:.4f}, perplexity {values['val/perplexity']:.2f}"
                     + ("" if improved else f" (no improvement for {loop.bad_evals} evaluation(s))"))
        if sample_fn is not None:
            text = sample_fn(result.state.params)
            logger.text(step, "samples", "```\n" + text + "\n```")
            logger.print(f"sample at step {step}:\n{text}\n")
        excluded += time.perf_counter() - t0
        return val

    while step < cfg.steps:
        t0 = time.perf_counter()
        batch = batches.get(cursor)
        new_state, metrics = train_step(result.state, batch, frozen) if frozen is not None \
            else train_step(result.state, batch)
        result.state = new_state
        step, cursor = step + 1, cursor + 1
        loop.tokens += tokens_per_step
        pending.append(metrics)
        loop.train_seconds += time.perf_counter() - t0

        if step == 1 and expected_initial_loss is not None:
            first = metrics["loss"].item()
            if abs(first - expected_initial_loss) > 0.25 * expected_initial_loss:
                logger.print(f"warning: initial loss {first:.3f} is far from ln(vocab) = "
                             f"{expected_initial_loss:.3f}; check the init and the data")

        last = step == cfg.steps
        if step % cfg.log_every == 0 or last:
            values = _pull(pending)
            pending.clear()
            now = time.perf_counter()
            seconds = max(now - last_log_time - excluded, 1e-9)
            tps = (loop.tokens - last_log_tokens) / seconds
            values.update({"tokens_per_sec": tps, "memory_mb": memory_mb(device)})
            logged = logger.scalars(step, {f"train/{k}" if k in ("loss", "grad_norm") else k: v
                                           for k, v in values.items()})
            logger.progress(step, cfg.steps, loss=logged["train/loss"], tokens_per_sec=tps,
                            extra={"lr": logged["lr"]})
            last_log_time, last_log_tokens, excluded = now, loop.tokens, 0.0
            if not math.isfinite(logged["train/loss"]):
                logger.print(f"warning: non-finite training loss at step {step} (the update was skipped)")

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
        elif evaluated or checkpoints.should_save(step):
            save(val_loss=result.val_loss if evaluated else None)
    logger.flush()
    return result


def _pull(pending: list[dict]) -> dict:
    """Means of the buffered step metrics (the loss, clip activity, ...) and the last value of the rest."""
    keys = pending[-1].keys()
    stacked = torch.stack([torch.stack([m[k].float().reshape(()) for k in keys]) for m in pending]).cpu()
    means, lasts = stacked.mean(0).tolist(), stacked[-1].tolist()
    return {k: (lasts[i] if k in ("lr", "loss_scale") else means[i]) for i, k in enumerate(keys)}
