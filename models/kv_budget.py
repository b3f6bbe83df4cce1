"""A per-layer KV budget for the MLA-form student: how many latent dims each layer keeps when the layers share one
total, allocated as CARE does it (Zhou et al., "CARE", ICLR 2026: covariance-whitened SVD, then a greedy allocation
of rank to the layers whose reconstruction loses the most).

The whitened factorization is ``models.mla_surgery``'s step 3 (SVD-LLM, Wang et al. 2024, arXiv 2403.07378: the
error of a rank-k truncation measured on the calibration inputs, ||L (Y - B A) W||_F^2, is the tail sum of the
squared singular values of L Y W). Dropping layer l from rank k to k - 1 therefore costs exactly s_l,k-1^2, so the
greedy that starts every layer at ``minimum`` and repeatedly gives the next rank unit to the layer whose error drops
most (:func:`allocate`) spends the budget on the largest remaining squared singular values over all layers; as each
layer's values are sorted, this greedy is optimal for the summed activation-weighted error.
"""
from __future__ import annotations

import torch

MIN_RANK = 1   # every layer keeps at least one latent dim


def allocate(sq: torch.Tensor, total: int, minimum: int = MIN_RANK) -> list:
    """Per-layer ranks summing to ``total`` from ``sq`` [L, K], each layer's squared singular values in decreasing
    order (the error each further rank unit removes): every layer starts at ``minimum``, then one unit at a time
    goes to the layer with the largest next value (ties: the lower layer). ``ValueError`` when ``total`` is below
    L * minimum or above L * K."""
    L, K = sq.shape
    if not L * minimum <= total <= L * K:
        raise ValueError(f"a total of {total} latent dims over {L} layers: need {L} * {minimum} <= total <= "
                         f"{L} * {K} (at least {minimum} and at most {K} per layer)")
    ranks = [minimum] * L
    gains = sq.detach().double().cpu().tolist()
    for _ in range(total - L * minimum):
        best = max((gains[l][ranks[l]], -l) for l in range(L) if ranks[l] < K)
        ranks[-best[1]] += 1
    return ranks


def budget_latent_total(kv_budget: int, n_layers: int, rope_dim: int, dtype_bytes: int = 2) -> int:
    """The latent dims over all layers that ``kv_budget`` bytes per token leave once every layer caches its
    ``rope_dim`` RoPE key (``dtype_bytes`` a value)."""
    return kv_budget // dtype_bytes - n_layers * rope_dim
