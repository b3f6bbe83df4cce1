"""Learning-rate schedules as pure functions of a tensor step (optax ``schedules/_schedule.py``).

A schedule maps the optimizer step ``t`` (a 0-d integer tensor, 1 on the first update) to a
*multiplier* of the base learning rate kept in the optimizer state, so the same graph serves every
step and every base LR: no ``.item()``, no Python branch on the step, no recompile. Floors are given as
ratios ``min_lr / lr``.

- ``constant``                      1
- ``linear_warmup(w)``              t / w for t < w, then 1 (nanoGPT warms up linearly from ~0)
- ``cosine(w, total, floor)``       warmup, then ``floor + (1 - floor) * (1 + cos(pi p)) / 2``,
                                    p = (t - w) / (total - w) clamped to [0, 1] (Loshchilov & Hutter, SGDR)
- ``linear(w, total, floor)``       warmup, then a straight line from 1 to ``floor`` at ``total``
- ``step_decay(w, every, gamma)``   warmup, then ``gamma ** floor((t - w) / every)``
"""
from __future__ import annotations

import math
from typing import Callable

import torch

Schedule = Callable[[torch.Tensor], torch.Tensor]

KINDS = ("constant", "cosine", "linear", "step")


def _warmup(t: torch.Tensor, warmup: int) -> torch.Tensor:
    if warmup <= 0:
        return torch.ones_like(t)
    return torch.clamp(t / warmup, max=1.0)


def _progress(t: torch.Tensor, warmup: int, total: int) -> torch.Tensor:
    span = max(total - warmup, 1)
    return torch.clamp((t - warmup) / span, 0.0, 1.0)


def constant() -> Schedule:
    return lambda step: torch.ones((), dtype=torch.float32, device=step.device)


def linear_warmup(warmup: int) -> Schedule:
    return lambda step: _warmup(step.to(torch.float32), warmup)


def cosine(warmup: int, total: int, floor: float = 0.0) -> Schedule:
    def schedule(step):
        t = step.to(torch.float32)
        decay = floor + (1.0 - floor) * 0.5 * (1.0 + torch.cos(math.pi * _progress(t, warmup, total)))
        return _warmup(t, warmup) * decay

    return schedule


def linear(warmup: int, total: int, floor: float = 0.0) -> Schedule:
    def schedule(step):
        t = step.to(torch.float32)
        return _warmup(t, warmup) * (1.0 - (1.0 - floor) * _progress(t, warmup, total))

    return schedule


def step_decay(warmup: int, every: int, gamma: float = 0.1) -> Schedule:
    if every <= 0:
        raise ValueError(f"step_decay needs every > 0, got {every}")

    def schedule(step):
        t = step.to(torch.float32)
        drops = torch.floor(torch.clamp(t - warmup, min=0.0) / every)
        return _warmup(t, warmup) * torch.pow(torch.tensor(gamma, device=step.device), drops)

    return schedule


def make(kind: str, *, warmup: int = 0, total: int = 1, floor: float = 0.0, every: int = 1000,
         gamma: float = 0.1) -> Schedule:
    """A schedule by name (``constant|cosine|linear|step``); ``warmup`` applies to all of them."""
    if kind == "constant":
        return linear_warmup(warmup) if warmup > 0 else constant()
    if kind == "cosine":
        return cosine(warmup, total, floor)
    if kind == "linear":
        return linear(warmup, total, floor)
    if kind == "step":
        return step_decay(warmup, every, gamma)
    raise ValueError(f"unknown lr_schedule {kind!r}; choose one of {', '.join(KINDS)}")
