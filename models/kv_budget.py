"""A per-layer KV budget for both student forms: how many cached dims each layer keeps when the layers share one
total, allocated as CARE does it (Zhou et al., "CARE", ICLR 2026: covariance-whitened SVD, then a greedy allocation
of rank to the layers whose reconstruction loses the most).

The whitened factorization is ``models.mla_surgery``'s step 3 (SVD-LLM, Wang et al. 2024, arXiv 2403.07378: the
error of a rank-k truncation measured on the calibration inputs, ||L (Y - B A) W||_F^2, is the tail sum of the
squared singular values of L Y W). Dropping layer l from rank k to k - 1 therefore costs exactly s_l,k-1^2, so the
greedy that starts every layer at ``minimum`` and repeatedly gives the next rank unit to the layer whose error drops
most (:func:`allocate`) spends the budget on the largest remaining squared singular values over all layers; as each
layer's values are sorted, this greedy is optimal for the summed activation-weighted error.

The per-head form (``models.surgery``, :func:`allocate_pair`) keeps its RoPE dims (``geo_dim``) uniform and spends the
rest of the budget on two spectra per layer: the no-RoPE score's (step 2 there: the whitened SVD of the dropped pairs'
scores, ||W^T (M - A^T B) W||^2 = its tail sum) and the values' (step 3: the SVD of W_v W, SVD-LLM's). A layer's
width applies to all its KV heads, so unit k of a layer removes the sum over its heads of their k-th squared singular
values, and a key dim and a value dim cost the same bytes (n_kv_heads values a token). The two spectra are in other
units (score energy over token pairs, value energy over tokens), so each is taken as a share of its own layer's total
energy, as CARE's public code scores a rank unit (FutureMLS-Lab/CARE, ``src/lora_qkv.py``,
``_propagated_residual_gain``: sq_svals[k] / total_energy of the layer; its further factors, the share of the
residual, a depth horizon and a rank cost, are left out, and one greedy runs over both kinds instead of CARE's half
of the budget each). The greedy over all 2 L sequences then minimises the sum over layers of the key and the value
relative errors (each sequence sorted, so the greedy is optimal for that sum). docs/upcycle.md compares this with
shares of the model-wide totals, raw values and CARE's full score on SmolLM2.
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
    return greedy(sq.detach().double().cpu().tolist(), [minimum] * L, total)


def greedy(gains: list, start: list, total: int) -> list:
    """Ranks summing to ``total``: row i (its gains in decreasing order, any length) starts at ``start[i]``, then one
    unit at a time goes to the row with the largest next gain (ties: the lower row). The caller checks the range."""
    ranks = list(start)
    for _ in range(total - sum(start)):
        best = max((gains[i][ranks[i]], -i) for i in range(len(ranks)) if ranks[i] < len(gains[i]))
        ranks[-best[1]] += 1
    return ranks


def allocate_pair(key_sq: torch.Tensor, value_sq: torch.Tensor, total: int, key_minimum: int = 0,
                  value_minimum: int = MIN_RANK) -> tuple[list, list]:
    """(key widths, value widths) per layer summing to ``total`` together, from each layer's full squared singular
    values ``key_sq`` [L, K] and ``value_sq`` [L, V] (decreasing; summed over the layer's KV heads), each row divided
    by its own sum (module docstring), then :func:`greedy` over the rows key 0, value 0, key 1, ...
    ``ValueError`` when ``total`` is outside [L (key_minimum + value_minimum), L (K + V)]."""
    L, K = key_sq.shape
    V = value_sq.shape[1]
    low, high = L * (key_minimum + value_minimum), L * (K + V)
    if not low <= total <= high:
        raise ValueError(f"a total of {total} key + value dims over {L} layers: need {low} <= total <= {high} (at "
                         f"least {key_minimum} + {value_minimum} and at most {K} + {V} per layer)")
    shares = [(sq.double() / sq.double().sum(-1, keepdim=True).clamp_min(1e-300)).cpu().tolist()
              for sq in (key_sq, value_sq)]
    rows = [shares[kind][l] for l in range(L) for kind in (0, 1)]
    ranks = greedy(rows, [key_minimum, value_minimum] * L, total)
    return ranks[0::2], ranks[1::2]


def budget_latent_total(kv_budget: int, n_layers: int, rope_dim: int, dtype_bytes: int = 2) -> int:
    """The latent dims over all layers that ``kv_budget`` bytes per token leave once every layer caches its
    ``rope_dim`` RoPE key (``dtype_bytes`` a value)."""
    return kv_budget // dtype_bytes - n_layers * rope_dim


def budget_dba_total(kv_budget: int, n_layers: int, n_kv_heads: int, geo_dim: int, dtype_bytes: int = 2) -> int:
    """The no-RoPE key + value dims per KV head, over all layers, that ``kv_budget`` bytes per token leave once every
    layer caches its ``geo_dim`` RoPE key dims in each of its ``n_kv_heads`` KV heads."""
    return kv_budget // dtype_bytes // n_kv_heads - n_layers * geo_dim
