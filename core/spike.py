"""Loss-spike detection as pure tensor math carried in the train state (PaLM / OPT practice).

An EMA z-score detector on the loss and on the gradient norm: ``mu <- a*mu +
(1-a)*x``, ``var <- a*var + (1-a)*(x - mu)**2`` and ``z = (x - mu_prev) / (sqrt(var_prev) + eps)``
computed with the *pre-update* statistics, so a spike is judged against the past and, when flagged,
does not pollute the statistics (they are not updated on a flagged or non-finite step). No flag is
raised during the first ``warmup`` observations.

A step is *suspect* when its loss or gradient norm has ``z > z_threshold``, or it is non-finite. A
*hard spike* is ``consecutive`` suspect steps in a row, or a loss above ``loss_factor`` x its EMA: the
state then records ``hard = 1`` and the step at which the streak began (``onset``). The loop reads
``hard`` with the metrics it pulls anyway (one transfer per log interval) and rolls back to an
in-memory snapshot or an on-disk checkpoint taken before the onset (``recipes/train/rollback.py``).
Everything is ``torch.where``: the detector compiles into the step without a graph break.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from purestep.core.config import option


@dataclass
class SpikeConfig:
    enabled: bool = option(True, "detect loss/grad-norm spikes in the step and roll back on a hard one")
    warmup: int = option(50, "observations before any flag is raised", min=0)
    ema: float = option(0.98, "EMA decay of the loss and grad-norm mean/variance", min=0, below=1)
    z_threshold: float = option(4.0, "a step is suspect when the loss or grad norm is this many sigmas high", above=0)
    consecutive: int = option(3, "suspect steps in a row that make a hard spike", min=1)
    loss_factor: float = option(1.5, "a loss above this many times its EMA is a hard spike at once", above=1)
    rollback_back: int = option(100, "roll back to a snapshot or checkpoint at least this many steps before the "
                                     "onset", min=0)
    snapshots: int = option(1, "copies of the train state kept in host memory for rollback (each the state's "
                               "size; 0: on-disk checkpoints only); a fixed number, so runs are reproducible "
                               "across machines", min=0)
    snapshot_every: int = option(50, "the in-memory copies are 2*rollback_back/snapshots steps apart, rounded up "
                                     "to a multiple of this", min=1)
    skip_ahead: int = option(100, "after a rollback also skip this many batches past the spike (bad data "
                                  "comes in runs; PaLM skipped 200-500 batches in all)", min=0)
    lr_factor: float = option(1.0, "multiply the learning rate by this after a rollback (OPT used 0.9)", above=0)
    max_rollbacks: int = option(3, "at most this many rollbacks per window; then the run stops", min=1)
    window: int = option(1000, "the window (steps) for max_rollbacks", min=1)


def init_monitor(device=None) -> dict:
    z = lambda dtype=torch.float32: torch.zeros((), dtype=dtype, device=device)  # noqa: E731
    return {"count": z(torch.int64), "loss_mean": z(), "loss_var": z(), "gn_mean": z(), "gn_var": z(),
            "streak": z(torch.int64), "onset": z(torch.int64), "hard": z(torch.int64), "z_loss": z(),
            "z_grad": z()}


def _zscore(x, mean, var):
    return (x - mean) / (var.sqrt() + 1e-8)


def _ema(mean, var, x, a: float, first):
    new_mean = torch.where(first, x, a * mean + (1 - a) * x)
    new_var = torch.where(first, torch.zeros_like(var), a * var + (1 - a) * (x - mean) ** 2)
    return new_mean, new_var


def update_monitor(m: dict, loss: torch.Tensor, grad_norm: torch.Tensor, step: torch.Tensor,
                   cfg: SpikeConfig) -> dict:
    """The detector's next state after observing this step's (pre-update) loss and gradient norm."""
    loss, grad_norm = loss.float(), grad_norm.float()
    finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
    warm = m["count"] >= cfg.warmup
    z_loss = torch.where(finite, _zscore(loss, m["loss_mean"], m["loss_var"]), torch.full_like(loss, float("inf")))
    z_grad = torch.where(finite, _zscore(grad_norm, m["gn_mean"], m["gn_var"]), torch.full_like(loss, float("inf")))
    suspect = ~finite | (warm & ((z_loss > cfg.z_threshold) | (z_grad > cfg.z_threshold)))
    streak = torch.where(suspect, m["streak"] + 1, torch.zeros_like(m["streak"]))
    onset = torch.where(suspect & (m["streak"] == 0), step, m["onset"])
    jump = warm & finite & (loss > cfg.loss_factor * m["loss_mean"])
    hard = (m["hard"] > 0) | (streak >= cfg.consecutive) | jump
    onset = torch.where(jump & (m["streak"] == 0) & (m["hard"] == 0), step, onset)
    observe = finite & ~suspect & ~jump
    first = m["count"] == 0
    loss_mean, loss_var = _ema(m["loss_mean"], m["loss_var"], loss, cfg.ema, first)
    gn_mean, gn_var = _ema(m["gn_mean"], m["gn_var"], grad_norm, cfg.ema, first)
    keep = lambda new, old: torch.where(observe, new, old)  # noqa: E731
    return {"count": m["count"] + observe.long(), "loss_mean": keep(loss_mean, m["loss_mean"]),
            "loss_var": keep(loss_var, m["loss_var"]), "gn_mean": keep(gn_mean, m["gn_mean"]),
            "gn_var": keep(gn_var, m["gn_var"]), "streak": streak, "onset": onset, "hard": hard.long(),
            "z_loss": z_loss, "z_grad": z_grad}


def clear(m: dict) -> dict:
    """The detector after a rollback: statistics kept, flags cleared, each in a tensor of its own (one zero shared by
    three leaves is an input dynamo's guards see as duplicated: the compiled step would compile again)."""
    return {**m, **{k: torch.zeros_like(m[k]) for k in ("streak", "onset", "hard")}}
