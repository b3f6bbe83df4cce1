"""recipe=distill's objective: the knowledge-distillation loss of a run's config (online against the frozen
teacher's logits, or against its cached top-k or sampled targets; plus hidden-state targets) and the batches that
carry the step for the temperature schedules and the cached targets.

The losses are ``models.losses``: Hinton et al. 2015's temperature-scaled KL blended with the CE, the reverse KL and
GKD's generalized JSD (Agarwal et al. 2024), top-k and sampled KD from cached teacher targets; the learnable
temperature and its gradient reversal are CTKD's (Li et al. 2023); hidden-state terms are ``recipes.distill.hidden``.
"""
from __future__ import annotations

import torch

from purestep.core.config import UserError
from purestep.models import llama, losses
from purestep.recipes.distill import hidden as hidden_targets
from purestep.recipes.distill.cache import TOPK
from purestep.recipes.distill.student import THETA


def check_temperature(cfg):
    """The run's temperature and alpha keys checked; the learnable temperature's starting logit, else None."""
    if cfg.temperature <= 0 or (cfg.temperature_mode == "scheduled" and cfg.temperature_end <= 0):
        raise UserError("temperatures must be > 0")
    if not 0.0 <= cfg.alpha <= 1.0:
        raise UserError(f"bad value for 'alpha': {cfg.alpha}; it must be in [0, 1]")
    if cfg.temperature_mode == "learnable":
        try:
            return losses.temperature_logit(cfg.temperature, cfg.temperature_min, cfg.temperature_max)
        except ValueError:
            raise UserError(f"temperature_mode=learnable starts at temperature={cfg.temperature}, which must lie "
                            f"strictly between temperature_min={cfg.temperature_min} and "
                            f"temperature_max={cfg.temperature_max} (e.g. temperature=2)") from None
    return None


def make_loss(cfg, student_cfg: llama.LlamaConfig, teacher_cfg: llama.LlamaConfig, cache_mode: str = "",
              layer_pairs=()):
    """``loss_fn(params, batch, key, frozen)``: the KD objective, online (``frozen["teacher"]``) or cached, plus
    the hidden-state term of ``layer_pairs`` (``recipes.distill.hidden``; online only)."""

    def temperature(params, step):
        if cfg.temperature_mode == "learnable":
            return losses.learnable_temperature(params[THETA], step, t_min=cfg.temperature_min,
                                                t_max=cfg.temperature_max, ramp_steps=cfg.temperature_ramp_steps)
        if cfg.temperature_mode == "scheduled":
            return losses.scheduled_temperature(step, cfg.steps, cfg.temperature, cfg.temperature_end)
        return cfg.temperature

    def loss_fn(params, batch, key, frozen=None, layers=None):
        doc = batch.get("doc")   # packed JSONL documents (core.data.documents): attention and positions per document
        hidden = bool(layer_pairs)
        out = llama.apply(params, batch["x"], student_cfg, key=key if student_cfg.dropout > 0 else None,
                          remat=cfg.remat, doc=doc, layers=layers, return_hidden=hidden)
        logits, states = out if hidden else (out, None)
        t, y = temperature(params, batch["step"]), batch["y"]
        if not cache_mode:
            with torch.no_grad():   # the step's layers: its compiled block; the student's layers alone are its own
                out = llama.apply(frozen["teacher"], batch["x"], teacher_cfg, doc=doc, layers=layers,
                                  return_hidden=hidden)
            teacher_logits, teacher_states = out if hidden else (out, None)
            kd_mask = batch.get("kd_mask")     # on_policy: the KL's positions include the student's own tokens
            loss, aux = losses.distill_objective(logits, y, teacher_logits, alpha=cfg.alpha, temperature=t,
                                                 direction=cfg.kl, symmetric_lambda=cfg.symmetric_lambda, beta=cfg.beta,
                                                 kd_mask=kd_mask)
            if kd_mask is not None:   # the share of the KL's positions that score the student's own tokens
                aux["on_policy"] = (kd_mask & (y < 0)).sum() / kd_mask.sum().clamp(min=1)
            if hidden:
                term = hidden_targets.hidden_term(params, states, teacher_states, layer_pairs, cfg.hidden_loss,
                                                  y >= 0 if kd_mask is None else kd_mask)
                loss, aux["hidden"] = loss + cfg.hidden_weight * term, term.detach()
            return loss, aux
        if cache_mode in TOPK:   # forward or jsd (TeacherCache.check_run refuses the others)
            kl = losses.topk_kd_loss(logits, batch["topk_ids"], batch["topk_logprobs"], batch["topk_missing"],
                                     t, mask=y >= 0, direction=cfg.kl, beta=cfg.beta)
        else:
            counts = batch["sample_counts"].float()
            kl = losses.sampled_kd_loss(logits, batch["sample_ids"], counts / counts.sum(-1, keepdim=True), t,
                                        mask=y >= 0)
        return losses.blend(kl, losses.cross_entropy(logits, y), alpha=cfg.alpha, temperature=t)

    return loss_fn


class DistillBatches:
    """The data's batches plus ``step`` (the cursor, for temperature schedules) and, with a cache, the
    teacher's cached targets for that cursor. ``get(cursor)`` stays a pure function of the cursor."""

    def __init__(self, batches, cache=None):
        self.batches, self.cache = batches, cache

    def get(self, cursor: int) -> dict:
        batch = self.batches.get(cursor)
        x = batch["x"]
        lead = x.shape[:1] if x.dim() == 3 else ()          # one step value per micro-batch
        batch["step"] = torch.full(lead, int(cursor), dtype=torch.int64, device=x.device)
        if self.cache is not None:
            batch.update(self.cache.targets(cursor, x.device))
        return batch
