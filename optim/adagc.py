"""AdaGC: adaptive per-tensor gradient clipping (Wang et al., arXiv 2502.11034), as a gradient transform.

Follows the official code (lishuai-97/AdaGC @32c249f, ``megatron-gpt2.patch`` ->
``megatron/optimizer/clip_grads.py::AdaGC.clip_by_norm``). Each tensor i keeps one scalar gamma_i; the
step counter t counts updates from 1:

- warm-up, ``t <= t_start``: global-norm clipping, ``c = min(1, lambda_abs / (||g|| + eps))`` on every
  tensor; then gamma_i = running minimum of the clipped norms ``c * ||g_i||``;
- after it: ``h_i = lambda_rel * gamma_i / (||g_i|| + eps)`` scales g_i when ``||g_i|| > lambda_rel * gamma_i``,
  and ``gamma_i <- beta * gamma_i + (1 - beta) * min(||g_i||, lambda_rel * gamma_i)`` (the EMA of the
  clipped norm, as the code and the paper's text have it; the README writes the unclipped one).

Two departures, both for tensors whose gradient is exactly zero (an unused parameter, a layer that has
not been reached), where the official code would set gamma_i = 0 and zero that tensor's gradient forever:

- a zero norm is not an observation in the warm-up minimum: gamma_i keeps its value. gamma starts
  *unset*, stored as +inf so the minimum needs no flag;
- a tensor still unset after the warm-up (zero throughout it) takes its first nonzero norm as gamma_i,
  which is what the official code does for a tensor it first sees after the warm-up (``state["norm_value"]
  = norm_value``): that step is not clipped, and gamma_i = that norm.

After the warm-up the official rule is kept as is, zero norms included (gamma_i decays by beta).

Per layer: a leaf stacked along a leading layer axis (``layers.attn.wq`` is ``[L, out, in]``) holds L
tensors of the reference model, so gamma has shape ``[L]`` and every statistic is taken per slice by one
reduction (``vector_norm(g.reshape(L, -1), dim=1)``); ``stacked`` picks those leaves (see
:func:`optim.health.stacked_predicate`; default: everything under ``layers.``). The warm-up's global norm
still covers all tensors.

Everything is tensor math with ``torch.where`` between the two phases (no host branch, no ``.item()``);
lambda_rel, beta, lambda_abs, eps and t_start are 0-d tensors in the state, editable without recompiling.
Use it in place of global clipping: ``chain(adagc(), adamw(...))``. The step's ``torch.where`` on a
non-finite loss or gradient keeps the old state, so gamma and t never advance on a skipped step (the
official code's caveat (b)); used outside that step, guard the state the same way.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from purestep.core.tree import Tree, named_leaves, tree_flatten, tree_map_with_name, tree_unflatten
from purestep.optim.base import GradientTransformation, counter, find_state, hparam_device, hparam_dtype, hparams
from purestep.optim.health import Stacked, slice_squares, stacked_predicate


class AdaGCState(NamedTuple):
    count: torch.Tensor          # int64 0-d: updates taken (t of the last update)
    gamma: dict                  # like params: 0-d per tensor, [L] per stacked leaf; +inf = unset
    hparams: dict                # lambda_rel, beta, lambda_abs, eps (float 0-d), t_start (int64 0-d)
    clip_fraction: torch.Tensor  # last update: fraction of tensors/slices whose gradient was scaled down
    max_ratio: torch.Tensor      # last update: max over tensors/slices of norm / threshold (> 1: clipped)


def adagc(lambda_rel: float = 1.04, beta: float = 0.99, t_start: int = 100, lambda_abs: float = 1.0,
          eps: float = 1e-6, stacked: Stacked = None) -> GradientTransformation:
    """AdaGC with the official Megatron defaults (``--clip-ratio 1.04 --clip-beta 0.99``, 100 warm-up
    steps, ``--clip-grad 1.0``, eps 1e-6). Over sharded gradients (DTensors: each layer slice split across ranks)
    the squares of every tensor and layer slice are the ranks' partial sums, made whole together by the root (one
    all-reduce)."""
    if lambda_rel < 0 or not 0 <= beta < 1 or eps <= 0 or t_start < 0 or lambda_abs <= 0:
        raise ValueError(f"adagc: need lambda_rel >= 0, 0 <= beta < 1, eps > 0, t_start >= 0, lambda_abs > 0; "
                         f"got {lambda_rel=}, {beta=}, {eps=}, {t_start=}, {lambda_abs=}")
    is_stacked = stacked_predicate(stacked)

    def init(params):
        dtype, device = hparam_dtype(params), hparam_device(params)
        h = hparams(params, lambda_rel=lambda_rel, beta=beta, lambda_abs=lambda_abs, eps=eps)
        h["t_start"] = torch.tensor(int(t_start), dtype=torch.int64, device=device)
        gamma = tree_map_with_name(
            lambda name, p: torch.full((p.shape[0],) if is_stacked(name, p) else (), float("inf"),
                                       dtype=dtype, device=p.device), params)
        zero = torch.zeros((), dtype=dtype, device=device)
        return AdaGCState(counter(params), gamma, h, zero, zero.clone())

    def update(updates, state, params=None):
        h = state.hparams
        count = state.count + 1
        warm = count <= h["t_start"]
        grads, spec = tree_flatten(updates)
        gammas, gamma_spec = tree_flatten(state.gamma)
        # one vector of units (tensors and layer slices) so the rule below is a handful of vector ops
        n = torch.cat([slice_squares(g, is_stacked(name, g)).to(gm.dtype).reshape(-1)
                       for (name, g), gm in zip(named_leaves(updates), gammas)]).sqrt()
        gamma = torch.cat([gm.reshape(-1) for gm in gammas])
        factor, new_gamma, clipped, ratio = _rule(n, gamma, warm, h)
        sizes = [gm.numel() for gm in gammas]
        new_grads = [g * f.reshape(gm.shape + (1,) * (g.ndim - gm.ndim)).to(g.dtype)
                     for g, f, gm in zip(grads, factor.split(sizes), gammas)]
        new_gammas = [x.reshape(gm.shape) for x, gm in zip(new_gamma.split(sizes), gammas)]
        new_state = AdaGCState(count, tree_unflatten(gamma_spec, new_gammas), h,
                               clipped.to(n.dtype).mean(), ratio.max())
        return tree_unflatten(spec, new_grads), new_state

    return GradientTransformation(init, update, adagc_metrics)


def _rule(n: torch.Tensor, gamma: torch.Tensor, warm: torch.Tensor, h: dict):
    """AdaGC's rule on the vector of unit norms ``n`` (tensors and layer slices) and their running ``gamma``:
    the scale factor of each unit, the next gamma, which units clipped and the norm / threshold ratios."""
    total = n.square().sum().sqrt()
    one = torch.ones_like(n)

    # warm-up: global clipping; gamma = running minimum of the clipped norms, zero norms left out
    warm_factor = (h["lambda_abs"] / (total + h["eps"])).clamp(max=1.0)
    m = n * warm_factor
    gamma_warm = torch.where(m > 0, torch.minimum(gamma, m), gamma)
    # per-tensor phase; an unset gamma takes the current norm (its first nonzero one)
    unset = torch.isinf(gamma)
    prev = torch.where(unset, n, gamma)
    threshold = h["lambda_rel"] * prev
    clip = n > threshold
    ada_factor = torch.where(clip, threshold / (n + h["eps"]), one)
    gamma_ada = h["beta"] * prev + (1 - h["beta"]) * torch.where(clip, threshold, n)
    gamma_ada = torch.where(unset & (n == 0), gamma, gamma_ada)

    factor = torch.where(warm, warm_factor * one, ada_factor)
    new_gamma = torch.where(warm, gamma_warm, gamma_ada)
    clipped = torch.where(warm, warm_factor < 1, clip)
    ratio = torch.where(threshold > 0, n / threshold, torch.zeros_like(n))
    ratio = torch.where(warm, total / h["lambda_abs"], ratio)
    return factor, new_gamma, clipped, ratio


def adagc_metrics(opt_state, prefix: str = "adagc/") -> dict[str, torch.Tensor]:
    """Clip activity of the last AdaGC update in ``opt_state`` as 0-d tensors (no host sync):
    ``clip_fraction`` (tensors/slices scaled down; during the warm-up 1 or 0 for the global clip) and
    ``max_ratio`` (largest norm / threshold). Empty if the optimizer has no AdaGC."""
    s = find_state(opt_state, AdaGCState)
    if s is None:
        return {}
    return {f"{prefix}clip_fraction": s.clip_fraction, f"{prefix}max_ratio": s.max_ratio}


def gammas(opt_state) -> Tree:
    """The per-tensor (per-slice) gamma of the AdaGC in ``opt_state`` (``+inf``: not set yet)."""
    s = find_state(opt_state, AdaGCState)
    if s is None:
        raise ValueError("this optimizer has no AdaGC transform")
    return s.gamma
