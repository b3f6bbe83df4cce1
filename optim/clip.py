"""Gradient clipping by global norm, with no host sync.

``g <- g * min(1, max_norm / (||g|| + 1e-6))``: the same formula as ``torch.nn.utils.clip_grad_norm_``
so the plain-PyTorch baseline and the functional step agree to float tolerance. The norm is computed in
float32 over all leaves and the scaling is tensor math (``torch.clamp``), never a Python ``if``.
"""
from __future__ import annotations

from typing import NamedTuple

from purestep.core.tree import global_norm, leaves_of, like
from purestep.optim import foreach
from purestep.optim.base import GradientTransformation, hparams


class ClipState(NamedTuple):
    hparams: dict   # max_norm


def clip_factor(norm, max_norm):
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """The norm is the transform's own (``core.tree.global_norm``; of sharded gradients, DTensors, the whole-model
    norm): a compiled step that also reports the gradients' norm computes it once (the
    compiler merges the two reductions)."""
    def init(params):
        return ClipState(hparams(params, max_norm=max_norm))

    def update(updates, state, params=None):
        factor = clip_factor(global_norm(updates), state.hparams["max_norm"])
        return like(updates, foreach.scale(leaves_of(updates), factor)), state

    return GradientTransformation(init, update)
