"""Adaptive gradient clipping, unit-wise (Brock et al. 2021, "High-Performance Large-Scale Image Recognition
Without Normalization", NFNets; optax ``adaptive_grad_clip``; deepmind-research ``nfnets/agc_optax.py``).

For every unit i (an output row of a weight):

    max_norm_i = clipping * max(||W_i||, eps)
    g_i <- g_i * max_norm_i / max(||g_i||, 1e-6)     where ||g_i|| > max_norm_i, else unchanged

The unit follows torch's ``(out, in)`` layout (DeepMind's code uses HWIO/IO, hence its axis 0): the norm is
over every axis but the first for matrices and convolutions (``dim=-1`` for a Linear weight), over the
whole tensor for vectors and scalars. For a leaf stacked along a leading layer axis (``stacked``, default:
everything under ``layers.``) the same rule applies to each layer slice, so ``[L, out, in]`` is still
clipped row by row (``dim=-1``) and a stacked norm weight ``[L, d]`` per layer. The norms are taken in at
least float32. Stateless: the thresholds are Python floats (``EmptyState``).

Defaults are the NFNet-F0 ones (clipping 0.01, eps 1e-3, batch 4096); the paper finds the best clipping
shrinks as the batch grows and leaves the final classifier unclipped.
"""
from __future__ import annotations

import torch

from purestep.core.tree import tree_map_with_name
from purestep.optim.base import EmptyState, GradientTransformation
from purestep.optim.health import Stacked, stacked_predicate, wide


def unit_norms(t: torch.Tensor, stacked: bool = False) -> torch.Tensor:
    """Per-unit L2 norms of ``t``, kept broadcastable against it (``keepdim``), in at least float32."""
    lead = 1 if stacked else 0
    rest = t.ndim - lead
    dims = tuple(range(lead + (1 if rest >= 2 else 0), t.ndim))
    if not dims:                                   # a scalar (or one per layer): its own norm
        return t.abs().to(wide(t.dtype))
    return torch.linalg.vector_norm(t, dim=dims, keepdim=True, dtype=wide(t.dtype))


def agc(clipping: float = 0.01, eps: float = 1e-3, stacked: Stacked = None) -> GradientTransformation:
    if clipping <= 0 or eps <= 0:
        raise ValueError(f"agc: need clipping > 0 and eps > 0, got {clipping=}, {eps=}")
    is_stacked = stacked_predicate(stacked)

    def clip(name, g, p):
        s = is_stacked(name, p)
        g_norm = unit_norms(g, s)
        max_norm = clipping * unit_norms(p, s).clamp(min=eps)
        scaled = g * (max_norm / g_norm.clamp(min=1e-6)).to(g.dtype)
        return torch.where(g_norm > max_norm, scaled, g)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("agc clips relative to the weights: call update(updates, state, params)")
        return tree_map_with_name(clip, updates, params), state

    return GradientTransformation(lambda params: EmptyState(), update)
