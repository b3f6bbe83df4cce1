"""Gradient clipping by global norm, with no host sync.

``g <- g * min(1, max_norm / (||g|| + 1e-6))``: the same formula as ``torch.nn.utils.clip_grad_norm_``
so the plain-PyTorch baseline and the functional step agree to float tolerance. The norm is computed in
float32 over all leaves and the scaling is tensor math (``torch.clamp``), never a Python ``if``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from core.tree import global_norm, leaves_of, like
from optim.base import GradientTransformation, hparams


class ClipState(NamedTuple):
    hparams: dict   # max_norm


def clip_factor(norm, max_norm):
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def _scale(grads: list, factor) -> list:
    """``g * factor.to(g.dtype)`` for every leaf: one ``torch._foreach_mul`` when the leaves share a dtype."""
    if len({g.dtype for g in grads}) == 1:
        return torch._foreach_mul(grads, factor.to(grads[0].dtype))
    return [g * factor.to(g.dtype) for g in grads]


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    def init(params):
        return ClipState(hparams(params, max_norm=max_norm))

    def update(updates, state, params=None):
        factor = clip_factor(global_norm(updates), state.hparams["max_norm"])
        return like(updates, _scale(leaves_of(updates), factor)), state

    return GradientTransformation(init, update)
