"""The compact teacher cache's encoding (``recipe=distill_cache mode=topk_packed``).

Per position a top-k cache holds the teacher's k most likely ids, their log-probs and the missing mass. The packed
form keeps the ids exact and rounds the log-probs:

- ids: ``ceil(log2 V)`` bits each, bit-packed (16 for SmolLM2's 49,152 ids, 17 for a 128k vocabulary, where the
  plain cache spends 32);
- log-probs: ``value_bits``-bit codes on a per-position linear scale below the top-1 (DistillKit, arcee-ai, packs
  its quantised values likewise and fits them with a polynomial; this is the simpler per-token scale):
  ``code_i = round((lp_1 - lp_i) / step)``, ``step = (lp_1 - lp_k) / (2^bits - 1)``, so code 0 is the top-1 and
  the largest code the k-th; the error is at most ``step / 2`` nats per id before renormalising;
- two float16 numbers: ``step`` and ``log_kept``, the log of the top-k's total probability (the missing mass is
  ``1 - exp(log_kept)``; a log keeps it exact when the k ids hold nearly all of the mass, where a float16 of the
  missing mass itself would not).

Decoding renormalises the codes to ``log_kept``, so the k probabilities and the missing mass sum to one. For k=32
and 8-bit codes over SmolLM2's vocabulary that is 64 + 32 + 4 = 100 bytes per position, against the plain cache's
132 (float16 log-probs, 16-bit ids, a float32 missing mass).
"""
from __future__ import annotations

import math

import numpy as np
import torch

LOWEST = -60.0     # log-probs below this (p < 1e-26, a masked vocabulary's -inf) are stored as this


def id_bits(vocab_size: int) -> int:
    """Bits that hold every id of a ``vocab_size`` vocabulary."""
    return max(1, math.ceil(math.log2(vocab_size)))


def packed_width(n: int, bits: int) -> int:
    """Bytes that ``n`` values of ``bits`` bits take, bit-packed."""
    return (n * bits + 7) // 8


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """``[.., n]`` unsigned integers below ``2**bits`` as ``[.., packed_width(n, bits)]`` bytes (little-endian bit
    order: value 0's lowest bit first)."""
    v = np.ascontiguousarray(values, dtype="<u4")
    each = np.unpackbits(v.view(np.uint8).reshape(*v.shape, 4), axis=-1, bitorder="little")[..., :bits]
    return np.packbits(each.reshape(*v.shape[:-1], -1), axis=-1, bitorder="little")


def unpack_bits(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """The ``[.., n]`` values (int64) that :func:`pack_bits` packed."""
    each = np.unpackbits(packed, axis=-1, count=n * bits, bitorder="little").reshape(*packed.shape[:-1], n, bits)
    wide = np.zeros((*each.shape[:-1], 32), np.uint8)
    wide[..., :bits] = each
    return np.packbits(wide, axis=-1, bitorder="little").view("<u4")[..., 0].astype(np.int64)


def quantize(logprobs: torch.Tensor, value_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [.., k] int32, scale [.., 2] float16)`` of top-k log-probs ``[.., k]`` sorted from the most likely
    (as ``Tensor.topk`` gives them); ``scale`` is ``(step, log_kept)``."""
    levels = 2 ** value_bits - 1
    lp = logprobs.float().clamp(min=LOWEST)
    top = lp[..., :1]
    step = ((top[..., 0] - lp[..., -1]) / levels).half()          # rounded first: the codes are made with it
    has_step = step > 0
    safe = torch.where(has_step, step.float(), torch.ones_like(step, dtype=torch.float32))
    codes = ((top - lp) / safe[..., None]).round().clamp(0, levels)
    codes = torch.where(has_step[..., None], codes, torch.zeros_like(codes))
    log_kept = torch.logsumexp(lp, -1).clamp(max=0.0)
    return codes.to(torch.int32), torch.stack([step.float(), log_kept], -1).half()


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs [.., k], missing [..])``, float32, of :func:`quantize`'s codes: the k probabilities and the
    missing mass sum to one."""
    step, log_kept = scale.float().unbind(-1)
    shape = -codes.float() * step[..., None]
    logprobs = shape - torch.logsumexp(shape, -1, keepdim=True) + log_kept[..., None]
    return logprobs, -torch.expm1(log_kept)
