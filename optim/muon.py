"""Muon: momentum orthogonalised by Newton-Schulz for the hidden matrices, AdamW for the rest (optax-shaped).

Keller Jordan's Muon (https://kellerjordan.github.io/posts/muon/, github.com/KellerJordan/Muon; the optimizer of
the modded-nanogpt speedrun, github.com/KellerJordan/modded-nanogpt), computed as ``torch.optim.Muon`` computes it
(``torch/optim/_muon.py``; torch 2.14.1 here), per matrix ``W`` of shape ``(A, B) = (out, in)``::

    M <- lerp(M, G, 1 - momentum)                     M <- momentum M + (1 - momentum) G
    U <- lerp(G, M, momentum) if nesterov else M      Nesterov: G + momentum (M - G)
    O <- NS(U)                                        ns_steps quintic Newton-Schulz steps, in bfloat16:
                                                      X = U / max(|U|_F, eps) (eps 1e-7), on U's transpose
                                                      when A > B; then X <- a X + (b S + c S S) X, S = X X^T,
                                                      (a, b, c) = (3.4445, -4.7750, 2.0315)
    W <- W (1 - lr wd) - lr ratio(A, B) O             decoupled weight decay at the unadjusted lr

``ratio`` (``adjust_lr``, torch's ``adjust_lr_fn``): ``original`` sqrt(max(1, A / B)) (Keller Jordan's, torch's
default); ``match_rms_adamw`` 0.2 sqrt(max(A, B)) (Moonshot's: the update's RMS matches AdamW's, so AdamW's lr and
weight decay carry over; Liu et al. 2025, "Muon is Scalable for LLM Training", arXiv 2502.16982);
``spectral_unclamped`` sqrt(A / B) (Bernstein, "Deriving Muon"). As a chain: :func:`scale_by_muon` gives
``ratio * O`` (in the gradients' dtype), ``optim.common.add_decayed_weights`` adds ``wd * W`` and
``optim.common.scale_by_learning_rate`` multiplies by ``-lr * schedule(t)``.

**Stacked layers.** A leaf ``[L, out, in]`` (a model's stacked blocks, ``layers.attn.wq``) is ``L`` matrices: the
Newton-Schulz steps run once over all of them (batched matmuls, the Frobenius norm per matrix), which equals
orthogonalising each layer alone, as ``torch.optim.Muon`` does on ``L`` separate 2-D weights
(``tests/test_muon.py``: to 1e-6 over 20 steps, eager). Any leading dims batch the same way.

**Which leaves** (:func:`muon_mask`): the matrices ``optim.common.decay_mask`` decays (the one rule for "a weight
matrix, not a norm, bias or embedding") that are stacked under ``layers.``: the hidden layers. Everything else
(the embedding, the output head, norms and gains, biases, vectors) goes to AdamW, as Keller Jordan's
``MuonWithAuxAdam`` and torch's documentation prescribe: Muon is for hidden 2-D weights only.

Compiled, inductor may keep the bfloat16 Newton-Schulz intermediates at float32 inside a fused kernel (one rounding
instead of two), so a compiled step matches the eager one to bfloat16 precision, not bit for bit.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from purestep.core.tree import Tree, like, tree_map_with_name, zeros_like, zip_leaves
from purestep.optim.adamw import adamw
from purestep.optim.base import GradientTransformation, chain, hparams, partition
from purestep.optim.common import add_decayed_weights, decay_mask, scale_by_learning_rate
from purestep.optim.schedules import Schedule

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)   # Keller Jordan's quintic, torch's DEFAULT_A, _B, _C
NS_EPS = 1e-7                                 # torch's EPS: the norm is clamped to it
ADJUST_LR = ("original", "match_rms_adamw", "spectral_unclamped")


def lr_ratio(adjust_lr: str, shape) -> float:
    """The factor ``adjust_lr`` puts on the lr of a ``(A, B) = shape[-2:]`` matrix (torch's ``_adjust_lr``)."""
    a, b = shape[-2], shape[-1]
    if adjust_lr == "original":
        return math.sqrt(max(1, a / b))
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    if adjust_lr == "spectral_unclamped":
        return math.sqrt(a / b)
    raise ValueError(f"adjust_lr={adjust_lr!r}: choose one of {', '.join(ADJUST_LR)}")


def orthogonalize(g: torch.Tensor, steps: int = 5, coefficients: tuple = NS_COEFFICIENTS,
                  eps: float = NS_EPS) -> torch.Tensor:
    """Newton-Schulz's approximate ``U V^T`` of every matrix in ``g`` (its last two dims; the leading ones batch),
    in bfloat16, as torch's ``_zeropower_via_newtonschulz`` computes it for one matrix: the same ops, each batched
    (``baddbmm`` for ``addmm``, the norm over the last two dims)."""
    a, b, c = coefficients
    shape = g.shape
    x = g.bfloat16().reshape(-1, shape[-2], shape[-1])
    tall = shape[-2] > shape[-1]
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        polynomial = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, polynomial, x, beta=a)
    if tall:
        x = x.mT
    return x.reshape(shape)


class ScaleByMuonState(NamedTuple):
    mu: dict        # the momentum buffers, shaped like the matrices
    hparams: dict   # momentum, as a 0-d tensor


def scale_by_muon(momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                  adjust_lr: str = "original") -> GradientTransformation:
    """``ratio(shape) * NS(momentum direction)`` for every leaf (each a matrix, or a stack of them)."""
    lr_ratio(adjust_lr, (1, 1))   # an unknown adjust_lr fails here, not at the first step
    if ns_steps < 1:
        raise ValueError(f"ns_steps={ns_steps} must be >= 1")

    def init(params):
        return ScaleByMuonState(zeros_like(params), hparams(params, momentum=momentum))

    def update(updates, state, params=None):
        beta = state.hparams["momentum"]
        grads, old = zip_leaves(updates, state.mu)
        mu = [torch.lerp(m, g, (1 - beta).to(m.dtype)) for m, g in zip(old, grads)]
        directions = [torch.lerp(g, m, beta.to(g.dtype)) for g, m in zip(grads, mu)] if nesterov else mu
        out = [orthogonalize(d, ns_steps).to(g.dtype) * lr_ratio(adjust_lr, g.shape)
               for d, g in zip(directions, grads)]
        return like(updates, out), ScaleByMuonState(like(state.mu, mu, updates), state.hparams)

    return GradientTransformation(init, update)


def muon_mask(params: Tree) -> Tree:
    """True for the hidden matrices Muon updates: leaves stacked under ``layers.`` (``[L, out, in]``) that
    ``optim.common.decay_mask`` counts as weight matrices; False for the rest (AdamW's)."""
    return tree_map_with_name(lambda name, p, decays: bool(decays) and name.startswith("layers.") and p.ndim >= 3,
                              params, decay_mask(params))


def muon(lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
         weight_decay: float = 0.0, adjust_lr: str = "original", schedule: Schedule | None = None,
         aux: GradientTransformation | None = None, mask=muon_mask) -> GradientTransformation:
    """Muon on the leaves ``mask`` marks (default :func:`muon_mask`), ``aux`` on the rest (default
    ``optim.adamw()``, its own lr and weight decay; give it the same ``schedule`` to move both rates together).
    Defaults are Keller Jordan's (lr 0.02, no weight decay); ``torch.optim.Muon``'s differ in lr (1e-3) and
    weight decay (0.1). Metrics: ``lr`` is ``aux``'s, ``muon_lr`` Muon's."""
    body = chain(scale_by_muon(momentum, nesterov, ns_steps, adjust_lr), add_decayed_weights(weight_decay),
                 scale_by_learning_rate(lr, schedule))
    return partition({"aux": aux if aux is not None else adamw(), "muon": body},
                     lambda params: tree_map_with_name(lambda name, m: "muon" if m else "aux",
                                                       mask(params) if callable(mask) else mask))
