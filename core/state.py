"""The train state: one pytree holding everything a step reads and writes.

``TrainState`` is a NamedTuple (a pytree node for optree without registration, like Flax's
``TrainState`` struct): the step counter, params, optimizer state, the RNG key, the data cursor (index
of the next batch; the step advances it, the loop reads its host mirror), the fp16 loss-scale state
(empty unless fp16) and the per-run monitor state: the spike detector's statistics (empty unless enabled;
``core.spike``), or what a recipe's own loop watches, under a key of its own (a per-block convergence state).
Training is ``state -> state``: a checkpoint of this tuple is a complete resume point.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from purestep.core import rng
from purestep.core.loss_scale import init_loss_scale
from purestep.core.spike import init_monitor


class TrainState(NamedTuple):
    step: torch.Tensor        # int64, optimizer steps taken
    params: Any
    opt_state: Any
    key: torch.Tensor         # RNG key (core.rng); dropout uses fold_in(key, step)
    cursor: torch.Tensor      # int64, index of the next batch in the data iterator
    loss_scale: dict          # {} or {"scale", "growth_tracker"} for fp16
    monitor: dict = {}        # {}, the spike detector's state (core.spike.init_monitor) or a loop's own


def init_state(params, optimizer, seed: int = 0, precision: str = "fp32", spike: bool = False) -> TrainState:
    device = next(iter(t.device for t in _tensors(params)), torch.device("cpu"))
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return TrainState(
        step=zero.clone(),
        params=params,
        opt_state=optimizer.init(params),
        key=rng.key(seed, device),
        cursor=zero.clone(),
        loss_scale=init_loss_scale(device) if precision == "fp16" else {},
        monitor=init_monitor(device) if spike else {},
    )


def _tensors(tree):
    from purestep.core.tree import tree_leaves
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
