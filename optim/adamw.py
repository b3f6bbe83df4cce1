"""Adam with decoupled weight decay (Kingma & Ba 2015; Loshchilov & Hutter 2019), optax-shaped.

``adamw = chain(scale_by_adam, add_decayed_weights(mask), scale_by_learning_rate)`` computes exactly
``torch.optim.AdamW``: ``p <- p - lr_t * (m_hat / (sqrt(v_hat) + eps) + wd * p)`` with
``m_hat = m / (1 - b1**t)`` and ``v_hat = v / (1 - b2**t)``; tested against it in float64. The moments
move as ``torch.optim``'s multi-tensor Adam moves its first one, by ``lerp`` (``m + (1 - b1) (g - m)``:
one pass over memory instead of three); the math runs on the list of leaves (:mod:`optim.foreach`), out of
place: a donated compiled step (``core.donate``) lets inductor store each result in the buffer it replaces.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from purestep.core.tree import like, zeros_like, zip_leaves
from purestep.optim import foreach
from purestep.optim.base import GradientTransformation, chain, counter, hparams
from purestep.optim.common import add_decayed_weights, decay_mask, scale_by_learning_rate
from purestep.optim.schedules import Schedule


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor
    mu: dict
    nu: dict
    hparams: dict   # b1, b2, eps as 0-d tensors


def _adam_directions(mu: list, nu: list, bc1: torch.Tensor, bc2_sqrt: torch.Tensor, eps: torch.Tensor) -> list:
    """``(m / (sqrt(v) / bc2_sqrt + eps)) / bc1`` leaf by leaf, one multi-tensor op at a time (the bias
    correction last, as ``m_hat / denominator``), each op after the first into the list the one before allocated."""
    if not mu:
        return []
    denominators = foreach.roots(nu)
    torch._foreach_div_(denominators, bc2_sqrt)
    foreach.add_scalar_(denominators, eps)
    directions = foreach.over(mu, denominators)
    torch._foreach_div_(directions, bc1)
    return directions


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    def init(params):
        return ScaleByAdamState(counter(params), zeros_like(params), zeros_like(params),
                                hparams(params, b1=b1, b2=b2, eps=eps))

    def update(updates, state, params=None):
        h = state.hparams
        beta1, beta2 = h["b1"], h["b2"]
        count = state.count + 1
        grads, old_mu, old_nu = zip_leaves(updates, state.mu, state.nu)
        mu = foreach.lerp(old_mu, grads, 1 - beta1)
        nu = foreach.lerp(old_nu, foreach.squares(grads), 1 - beta2)
        directions = _adam_directions(mu, nu, 1 - beta1 ** count, (1 - beta2 ** count).sqrt(), h["eps"])
        return (like(updates, directions),
                ScaleByAdamState(count, like(state.mu, mu, updates), like(state.nu, nu, updates), h))

    return GradientTransformation(init, update)


def adamw(lr: float = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.01,
          mask=decay_mask, schedule: Schedule | None = None) -> GradientTransformation:
    """AdamW. ``mask`` (default: decay matrices, not norms/biases/embeddings) may be None to decay all."""
    return chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(lr, schedule))
