"""Weight nowcasting by per-parameter linear extrapolation (after Jang et al., ICML 2023, "Learning to
Boost Training by Periodic Nowcasting Near Future Weights").

Jang et al. predict each scalar weight's near-future value from its own recent trajectory with a small
learned network; here the predictor is the simplest one with no training data: an ordinary least-squares
line through the last ``window`` snapshots ``(t_i, w_i)`` of every weight, evaluated ``horizon`` steps past
the newest. With ``c_i = (t_i - t_mean) / sum_j (t_j - t_mean)**2`` the slope is ``b = sum_i c_i w_i`` and the
prediction ``w_mean + b * (t_last + horizon - t_mean)``: one weighted sum of the stacked snapshots per
leaf, no per-parameter Python loop and no host sync. Unlike an extrapolation ``H * a * dw`` by a factor ``a``
trained for a single step, a line fitted to the trajectory is at least what it claims to be. Whether to keep
a jump is decided by the caller on held-out data.
"""
from __future__ import annotations

from typing import Sequence

import torch

from purestep.core.tree import Tree, tree_map


def extrapolate(steps: Sequence[int], snapshots: Sequence[Tree], horizon: int) -> Tree:
    """The least-squares linear prediction of every leaf at ``steps[-1] + horizon``."""
    if len(steps) != len(snapshots) or len(steps) < 2:
        raise ValueError(f"nowcast needs >= 2 snapshots with their steps, got {len(steps)} steps and "
                         f"{len(snapshots)} snapshots")
    n = len(steps)
    t_mean = sum(steps) / n
    var = sum((t - t_mean) ** 2 for t in steps)
    if var <= 0:
        raise ValueError(f"nowcast snapshots need distinct steps, got {list(steps)}")
    target = steps[-1] + horizon - t_mean
    # prediction = sum_i (1/n + c_i * target) * w_i: one weight per snapshot
    weights = [1.0 / n + (t - t_mean) / var * target for t in steps]

    def line(*ws):
        acc = ws[0].to(torch.float64 if ws[0].dtype == torch.float64 else torch.float32) * weights[0]
        for w, c in zip(ws[1:], weights[1:]):
            acc = acc + w.to(acc.dtype) * c
        return acc.to(ws[0].dtype)

    return tree_map(line, *snapshots)
