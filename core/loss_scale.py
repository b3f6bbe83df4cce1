"""Functional dynamic loss scaling for fp16 (Micikevicius et al. 2018; ``torch.amp.GradScaler`` defaults).

The state is two 0-d tensors: ``scale`` (float32, starts at 2**16) and ``growth_tracker`` (int64,
consecutive finite steps). After every step: on overflow the scale is multiplied by ``backoff`` (0.5)
and the tracker reset; otherwise the tracker grows and, every ``interval`` (2000) finite steps, the scale
is multiplied by ``growth`` (2). Pure tensor math with ``torch.where``: no host branch.
"""
from __future__ import annotations

import torch

INIT_SCALE = 2.0 ** 16
GROWTH, BACKOFF, INTERVAL = 2.0, 0.5, 2000


def init_loss_scale(device=None, scale: float = INIT_SCALE) -> dict:
    return {"scale": torch.tensor(scale, dtype=torch.float32, device=device),
            "growth_tracker": torch.zeros((), dtype=torch.int64, device=device)}


def update_loss_scale(state: dict, finite: torch.Tensor, growth: float = GROWTH, backoff: float = BACKOFF,
                      interval: int = INTERVAL) -> dict:
    tracker = torch.where(finite, state["growth_tracker"] + 1, torch.zeros_like(state["growth_tracker"]))
    grow = tracker >= interval
    scale = torch.where(finite, torch.where(grow, state["scale"] * growth, state["scale"]), state["scale"] * backoff)
    tracker = torch.where(grow, torch.zeros_like(tracker), tracker)
    return {"scale": scale, "growth_tracker": tracker}
