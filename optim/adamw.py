"""Adam with decoupled weight decay (Kingma & Ba 2015; Loshchilov & Hutter 2019), optax-shaped.

``adamw = chain(scale_by_adam, add_decayed_weights(mask), scale_by_learning_rate)`` computes exactly
``torch.optim.AdamW``: ``p <- p - lr_t * (m_hat / (sqrt(v_hat) + eps) + wd * p)`` with
``m_hat = m / (1 - b1**t)`` and ``v_hat = v / (1 - b2**t)``; tested against it in float64.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from core.tree import tree_map, zeros_like
from optim.base import GradientTransformation, chain, counter, hparams
from optim.common import add_decayed_weights, decay_mask, scale_by_learning_rate
from optim.schedules import Schedule


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor
    mu: dict
    nu: dict
    hparams: dict   # b1, b2, eps as 0-d tensors


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    def init(params):
        return ScaleByAdamState(counter(params), zeros_like(params), zeros_like(params),
                                hparams(params, b1=b1, b2=b2, eps=eps))

    def update(updates, state, params=None):
        h = state.hparams
        beta1, beta2 = h["b1"], h["b2"]
        count = state.count + 1
        mu = tree_map(lambda m, g: beta1 * m + (1 - beta1) * g, state.mu, updates)
        nu = tree_map(lambda v, g: beta2 * v + (1 - beta2) * g * g, state.nu, updates)
        bc1 = 1 - beta1 ** count
        bc2_sqrt = (1 - beta2 ** count).sqrt()
        updates = tree_map(lambda m, v: (m / bc1) / (v.sqrt() / bc2_sqrt + h["eps"]), mu, nu)
        return updates, ScaleByAdamState(count, mu, nu, h)

    return GradientTransformation(init, update)


def adamw(lr: float = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.01,
          mask=decay_mask, schedule: Schedule | None = None) -> GradientTransformation:
    """AdamW. ``mask`` (default: decay matrices, not norms/biases/embeddings) may be None to decay all."""
    return chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(lr, schedule))
