"""Lion, EvoLved Sign Momentum (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Alg. 2).

``c = b1 * m + (1 - b1) * g``; the update is ``sign(c)``; then ``m <- b2 * m + (1 - b2) * g``;
decoupled weight decay ``p <- p - lr * (sign(c) + wd * p)``. Note the stored momentum is interpolated
with ``b2`` only once per step, after ``c`` is formed (Alg. 2), never a second time.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from purestep.core.tree import like, zeros_like, zip_leaves
from purestep.optim import foreach
from purestep.optim.base import GradientTransformation, chain, hparams
from purestep.optim.common import add_decayed_weights, decay_mask, scale_by_learning_rate
from purestep.optim.schedules import Schedule


class ScaleByLionState(NamedTuple):
    mu: dict
    hparams: dict   # b1, b2


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> GradientTransformation:
    def init(params):
        return ScaleByLionState(zeros_like(params), hparams(params, b1=b1, b2=b2))

    def update(updates, state, params=None):
        beta1, beta2 = state.hparams["b1"], state.hparams["b2"]
        grads, old = zip_leaves(updates, state.mu)
        direction = foreach.moving_average(old, grads, beta1)
        if direction:
            torch._foreach_sign_(direction)
        mu = foreach.moving_average(old, grads, beta2)
        return like(updates, direction), ScaleByLionState(like(state.mu, mu, updates), state.hparams)

    return GradientTransformation(init, update)


def lion(lr: float = 1e-4, b1: float = 0.9, b2: float = 0.99, weight_decay: float = 0.0, mask=decay_mask,
         schedule: Schedule | None = None) -> GradientTransformation:
    return chain(scale_by_lion(b1, b2), add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(lr, schedule))
