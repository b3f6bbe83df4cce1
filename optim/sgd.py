"""Stochastic gradient descent with heavy-ball or Nesterov momentum (Sutskever et al. 2013).

``sgd = chain(add_decayed_weights, trace, scale_by_learning_rate)``: weight decay is the coupled L2
term added to the gradient and momentum follows ``torch.optim.SGD`` (dampening 0):
``b <- mu * b + g``; the step direction is ``b``, or ``g + mu * b`` with Nesterov. Tested against
``torch.optim.SGD`` in float64.
"""
from __future__ import annotations

from typing import NamedTuple

from purestep.core.tree import like, zeros_like, zip_leaves
from purestep.optim import foreach
from purestep.optim.base import GradientTransformation, chain, hparams
from purestep.optim.common import add_decayed_weights, scale_by_learning_rate
from purestep.optim.schedules import Schedule


class TraceState(NamedTuple):
    trace: dict
    hparams: dict   # momentum as a 0-d tensor


def trace(momentum: float, nesterov: bool = False) -> GradientTransformation:
    def init(params):
        return TraceState(zeros_like(params), hparams(params, momentum=momentum))

    def update(updates, state, params=None):
        mu = state.hparams["momentum"]
        grads, old = zip_leaves(updates, state.trace)
        buf = foreach.add_into(foreach.scale(old, mu), grads)
        out = foreach.add_scaled(grads, buf, mu) if nesterov else buf
        return like(updates, out), TraceState(like(state.trace, buf, updates), state.hparams)

    return GradientTransformation(init, update)


def sgd(lr: float = 1e-2, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
        mask=None, schedule: Schedule | None = None) -> GradientTransformation:
    if nesterov and momentum <= 0:
        raise ValueError("Nesterov momentum needs momentum > 0")
    parts = []
    if weight_decay:
        parts.append(add_decayed_weights(weight_decay, mask))
    if momentum:
        parts.append(trace(momentum, nesterov))
    parts.append(scale_by_learning_rate(lr, schedule))
    return chain(*parts)
