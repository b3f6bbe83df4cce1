"""Explicit, counter-based random numbers that live in the train state (JAX ``PRNGKey`` style).

A key is a 0-d int64 tensor holding 32 random bits. ``fold_in(key, n)`` derives a new key from a key
and a counter (the step number, a layer index), and ``uniform(key, shape)`` turns a key into uniform
floats by hashing ``(key, element index)``. Every function is pure tensor math, so it traces into a
compiled step without a graph break, gives the same numbers eagerly and compiled, and makes a run a
function of its seed: the same seed, the same dropout masks, on any device.

The mixing function is the "lowbias32" integer hash (Chris Wellons, *Prospecting for Hash Functions*,
2018) with both multipliers kept below 2**31 so every intermediate product fits in int64 without
overflow (inductor's C++ may not wrap signed overflow). It is a hash, not a cryptographic generator:
plenty for dropout masks and data shuffles.
"""
from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x68E31DA5
_GOLDEN = 0x1E3779B9  # golden-ratio increment, below 2**31


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """(x * m) mod 2**32 for 0 <= x < 2**32 and m < 2**31, without int64 overflow (split x in halves)."""
    lo = x & 0xFFFF
    hi = x >> 16
    return ((lo * m) + (((hi * m) & 0xFFFF) << 16)) & _MASK32


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def key(seed: int, device: torch.device | str | None = None) -> torch.Tensor:
    """A key from an integer seed."""
    return _mix(torch.tensor(seed & _MASK32, dtype=torch.int64, device=device) + _GOLDEN)


def fold_in(k: torch.Tensor, data: int | torch.Tensor) -> torch.Tensor:
    """A new key from ``k`` and a counter (a Python int or an int tensor, e.g. the step)."""
    return _mix(k ^ _mix(torch.as_tensor(data, dtype=torch.int64, device=k.device) + _GOLDEN))


def split(k: torch.Tensor, n: int = 2) -> list[torch.Tensor]:
    """``n`` independent keys derived from ``k``."""
    return [fold_in(k, i + 1) for i in range(n)]


def bits(k: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Uniform 32-bit integers (int64 tensor) of ``shape``, a pure function of ``k``."""
    numel = 1
    for s in shape:
        numel *= s
    counter = torch.arange(numel, dtype=torch.int64, device=k.device)
    return _mix(_mix(counter + _GOLDEN) ^ k).reshape(shape)


def uniform(k: torch.Tensor, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniform floats in [0, 1) of ``shape`` from the top 24 bits of :func:`bits`."""
    return ((bits(k, shape) >> 8).to(dtype)) * (1.0 / (1 << 24))


def dropout(k: torch.Tensor, x: torch.Tensor, rate: float) -> torch.Tensor:
    """Inverted dropout with a mask drawn from ``k``. ``rate`` is a Python float (static per run)."""
    if rate <= 0.0:
        return x
    keep = uniform(k, x.shape) >= rate
    return torch.where(keep, x / (1.0 - rate), torch.zeros((), dtype=x.dtype, device=x.device))
