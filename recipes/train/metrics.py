"""The training loop's host-side reporting hooks: first-step checks, the metrics log and evaluation.

The step's metrics stay 0-d device tensors; every ``log_every`` steps they are pulled in one transfer (the
deferred metrics of Levanter) and logged with the throughput, memory, MFU and cost. Evaluation runs on
fixed validation windows; ``patience`` evaluations without improvement stop the run (early stopping), and a
non-finite validation loss stops it without finishing (diverged: ``core.exits.RunStopped``, exit code 4).

Divergence, checked on those pulls only (no extra host sync): a step whose loss or gradient norm is not finite is
skipped (``core.update.if_finite``, optax's ``apply_if_finite``), which rides out a bad batch but not a run that
cannot take a finite step any more. The log stops the run the same way (exit 4, ``stopped.msgpack``) when the last
``max_skipped_steps`` steps in a row were all skipped (counted since the run started or last rolled back), and, with
the spike detector off, when the kept weights' global norm is not finite (a weight is inf or NaN, or their squares
overflow float32: a norm beyond about 1.8e19). With the detector on, a log step that flags a hard spike is left to
its rollback, which restores weights from before the onset (``recipes.train.rollback``).
"""
from __future__ import annotations

import math
import re
import time
from typing import Callable, Optional

import torch

from purestep.core.io.board import board_tag, exact, training_charts
from purestep.core.io.logging import Logger, memory_mb
from purestep.core.io.telemetry import peak_flops
from purestep.optim.health import COLUMNS, GLOBAL, GradientHealth, computed
from purestep.recipes.train.hooks import Hook, StepContext, Stop

LAST_VALUE = ("lr", "muon_lr", "loss_scale", "spike", "z_loss", "z_grad")


def pull(pending: list[dict]) -> tuple[dict, Optional[torch.Tensor], int, list]:
    """Means of the buffered 0-d step metrics (the loss, clip activity, ...), the last value of the rest, the
    newest packed health tensor that holds statistics (``optim.health.computed``: with ``every`` only the due
    steps compute them), how many steps before the last it came from, and each step's ``skipped`` flag (oldest
    first, for :func:`skipped_run`): one host transfer for the interval."""
    keys = [k for k, v in pending[-1].items() if v.dim() == 0]
    alike = [m for m in pending if all(k in m for k in keys)]   # a strategy switch may change the keys
    stacked = torch.stack([torch.stack([m[k].float() for k in keys]) for m in alike]).cpu()
    means, lasts = stacked.mean(0).tolist(), stacked[-1].tolist()
    values = {k: (lasts[i] if k in LAST_VALUE else means[i]) for i, k in enumerate(keys)}
    skips = stacked[:, keys.index("skipped")].tolist() if "skipped" in keys else []
    for age, metrics in enumerate(reversed(pending)):
        health = metrics.get("health")
        if health is not None and computed(health):
            return values, health.cpu(), age, skips
    return values, None, 0, skips


def skipped_run(skips: list, before: int) -> int:
    """Steps in a row skipped as non-finite up to the last of an interval's ``skipped`` flags (oldest first), plus
    ``before`` (the count at the previous pull) when every step of the interval was skipped."""
    run = 0
    for skipped in reversed(skips):
        if not skipped > 0:
            break
        run += 1
    return run if run < len(skips) else before + run


def too_many_skipped(run: int, limit: int, step: int) -> Optional[str]:
    """The divergence reason when ``run`` steps in a row were skipped and that reaches ``limit`` (0: never)."""
    if limit and run >= limit:
        return (f"diverged: the last {run} steps up to step {step} were all non-finite and skipped "
                f"(max_skipped_steps={limit})")
    return None


def board_layout(health: Optional[GradientHealth]) -> dict:
    """The run's custom-scalars layout (``Logger.layout``): loss, learning rate and tokens/s first; then, per
    gradient-health statistic, one chart of every tensor and layer, one per layer-stacked tensor (a line per
    layer) and one of the whole tensors and the global row; the clip ratio when there is a clip threshold."""
    categories = {"training": training_charts()}
    if health is None:
        return categories
    for column in COLUMNS:
        prefix = re.escape(board_tag(f"health/{column}/"))
        charts = {f"{column}: every tensor and layer": [f"^{prefix}"]}
        for name, stacked, _ in health.leaves:
            if stacked:
                charts[f"{column}: {name} by layer"] = [f"^{prefix}{re.escape(name)}/\\d+$"]
        whole = [name for name, stacked, _ in health.leaves if not stacked] + [GLOBAL]
        charts[f"{column}: whole tensors, global"] = [exact(f"health/{column}/{name}") for name in whole]
        categories[f"health: {column}"] = charts
    if health.clip_norm is not None:
        categories["health: clip"] = {"global norm / clip_norm, clipped": [exact("health/clip/ratio"),
                                                                           exact("health/clip/clipped")]}
    return categories


def write_health(logger: Logger, health: GradientHealth, step: int, packed: torch.Tensor) -> None:
    """Gradient health's statistics of ``step`` (a packed tensor): a scalar per tensor and statistic, and a
    histogram per statistic."""
    logger.scalars(step, health.to_scalars(packed))
    for tag, values in health.histograms(packed).items():
        logger.histogram(step, tag, values)


class FirstStepCheck(Hook):
    """After the first step: is the loss near ln(vocab), and which parameters got no or a bad gradient."""

    def __init__(self, logger: Logger, health: Optional[GradientHealth], expected_initial_loss: Optional[float]):
        self.logger, self.health, self.expected = logger, health, expected_initial_loss

    def after_step(self, ctx: StepContext):
        if ctx.run.loop.ticks != 1:
            return None
        metrics = ctx.metrics
        if self.expected is not None:
            first = metrics["loss"].item()
            if abs(first - self.expected) > 0.25 * self.expected:
                self.logger.print(f"warning: initial loss {first:.3f} is far from ln(vocab) = {self.expected:.3f}; "
                                  f"check the init and the data")
        if self.health is not None and "health" in metrics and computed(metrics["health"]):
            problems = self.health.report(metrics["health"].cpu())
            for name, problem in problems:
                self.logger.print(f"gradient check after step 1: {name}: {problem}")
            if problems:
                self.logger.event(1, "gradient_report", problems=[f"{n}: {p}" for n, p in problems])
        return None


class TrainLog(Hook):
    """Every ``log_every`` steps (and the last): the interval's metrics, throughput, memory, MFU, cost,
    gradient health and the progress line. Leaves the pulled values in ``ctx.window.values`` for the rollback."""

    def __init__(self, cfg, logger: Logger, health: Optional[GradientHealth], ctx: StepContext,
                 flops_per_token: float = 0.0, epoch_of: Optional[Callable[[int], float]] = None):
        self.cfg, self.logger, self.health, self.flops_per_token = cfg, logger, health, flops_per_token
        self.epoch_of = epoch_of   # cursor -> epochs done once its batch is consumed (JSONL data), or None
        self.device = ctx.state.step.device
        self.peak = peak_flops(self.device, cfg.peak_flops)
        self.last_time, self.last_tokens = time.perf_counter(), ctx.run.loop.tokens
        self.skipped_run = 0      # steps in a row skipped as non-finite, up to the last log step
        logger.layout(board_layout(health))

    def after_step(self, ctx: StepContext):
        cfg, logger = self.cfg, self.logger
        if ctx.step % cfg.log_every != 0 and not ctx.last:
            return None
        values, health, age, skips = pull(ctx.window.pending)
        interval = len(ctx.window.pending)
        self.skipped_run = skipped_run(skips, self.skipped_run)
        ctx.window.pending.clear()
        now = time.perf_counter()
        clock = ctx.run.meter
        seconds = max(now - self.last_time - clock.excluded, 1e-9)
        tps = (ctx.run.loop.tokens - self.last_tokens) / seconds
        wall = clock.wall(now)
        values.update({"tokens_per_sec": tps, "memory_mb": memory_mb(self.device), "wall_hours": wall / 3600,
                       "data_ms": 1000 * clock.data_seconds / max(interval, 1)})
        clock.data_seconds = 0.0
        if self.peak and self.flops_per_token:
            values["mfu"] = tps * self.flops_per_token / self.peak
        if cfg.cost_per_hour:
            values["cost"] = wall / 3600 * cfg.cost_per_hour
        if self.epoch_of is not None and ctx.cursor > 0:
            values["epoch"] = self.epoch_of(ctx.cursor - 1)
        logged = logger.scalars(ctx.step, {f"train/{k}" if k in ("loss", "grad_norm") else k: v
                                           for k, v in values.items()})
        if health is not None and self.health is not None:
            write_health(logger, self.health, ctx.step - age, health)
        logger.progress(ctx.step, cfg.steps, loss=logged["train/loss"], tokens_per_sec=tps,
                        extra={k: logged[k] for k in ("epoch", "lr", "data_ms") if k in logged} or None)
        self.last_time, self.last_tokens, clock.excluded = now, ctx.run.loop.tokens, 0.0
        ctx.window.values = values
        if values.get("skipped", 0.0) > 0 and not values.get("spike", 0.0) > 0:
            logger.print(f"warning: {round(values['skipped'] * interval)} non-finite step(s) up to step {ctx.step} "
                         f"were skipped (parameters untouched)")
        return self.diverged(ctx, values)

    def diverged(self, ctx: StepContext, values: dict) -> Optional[Stop]:
        """The module docstring's divergence check on this log step's pulled ``values``: a Stop (unfinished) or
        None."""
        cfg, step = self.cfg, ctx.step
        if values.get("spike", 0.0) > 0:          # the rollback acts on this step
            return None
        reason = too_many_skipped(self.skipped_run, cfg.max_skipped_steps, step)
        if reason is None and not cfg.spike.enabled and not math.isfinite(values.get("param_norm", 0.0)):
            reason = f"diverged: the weights' global norm is {values['param_norm']} at step {step}"
        if reason is None:
            return None
        self.logger.print(f"{reason}: stopping (lower lr, or inspect the data)")
        self.logger.event(step, "diverged", reason=reason)
        return Stop(reason, unfinished=True)

    def on_rollback(self, step: int, to_step: int, restored):
        self.skipped_run = 0
        return restored


class Evaluation(Hook):
    """Every ``eval_every`` steps and at the last: the validation loss (and perplexity), a sample, and
    early stopping after ``patience`` evaluations without improvement."""

    def __init__(self, cfg, logger: Logger, evaluate_fn: Callable[[object], float],
                 sample_fn: Optional[Callable[[object], str]] = None, perplexity: bool = True):
        self.cfg, self.logger, self.evaluate_fn, self.sample_fn = cfg, logger, evaluate_fn, sample_fn
        self.perplexity = perplexity

    def after_step(self, ctx: StepContext):
        cfg = self.cfg
        if not ((cfg.eval_every and ctx.step % cfg.eval_every == 0) or ctx.last):
            return None
        with ctx.run.meter.timed():
            self.evaluate(ctx)
        loop, val = ctx.run.loop, ctx.run.result.val_loss
        if not math.isfinite(val):   # the weights are broken: training on cannot mend them, nor is this a result
            reason = f"diverged: validation loss {val} at step {ctx.step}"
            self.logger.print(f"{reason}: stopping (lower lr, or inspect the data)")
            self.logger.event(ctx.step, "diverged", val_loss=str(val))
            return Stop(reason, unfinished=True, val_loss=val)
        if cfg.patience and loop.bad_evals >= cfg.patience:
            self.logger.print(f"early stopping at step {ctx.step}: no better validation loss in "
                              f"{cfg.patience} evaluations (best {loop.best_val:.4f})")
            self.logger.event(ctx.step, "early_stop", best_val=loop.best_val, patience=cfg.patience)
            return Stop(early=True, final=True, val_loss=ctx.run.result.val_loss)
        return None

    def evaluate(self, ctx: StepContext) -> None:
        step, loop, logger = ctx.step, ctx.run.loop, self.logger
        val = self.evaluate_fn(ctx.state.params)
        ctx.run.result.val_loss = val
        ctx.run.result.history.append((step, val))
        improved = val < loop.best_val
        loop.best_val, loop.bad_evals = (val, 0) if improved else (loop.best_val, loop.bad_evals + 1)
        values = {"val/loss": val}
        if self.perplexity:
            values["val/perplexity"] = math.exp(min(val, 50.0))
        logger.scalars(step, values)
        shown = f"{val:.4f}, perplexity {values['val/perplexity']:.2f}" if self.perplexity else f"{val:.6g}"
        logger.print(f"step {step}: val loss {shown}"
                     + ("" if improved else f" (no improvement for {loop.bad_evals} evaluation(s))"))
        if self.sample_fn is not None:
            text = self.sample_fn(ctx.state.params)
            logger.text(step, "samples", "```\n" + text + "\n```")
            logger.print(f"sample at step {step}:\n{text}\n")
