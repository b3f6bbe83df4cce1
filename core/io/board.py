"""TensorBoard's view of a run: tag names that sort what matters first, and a custom-scalars layout.

TensorBoard's time-series page groups scalar cards by the part of the tag before the first ``/`` and sorts
the groups by name, so a 4-layer run's ~200 per-layer ``health/...`` cards came before its loss curves.
``board_tag`` renames the keys the loop logs (which ``metrics.jsonl`` keeps as they are) into numbered
groups; digits sort before letters, so any other group (``orchestrator/``, ``lr_find/``, ``benchmark/``...)
follows them:

======================  ========================================================================
``1_train/...``         ``train/loss``, ``train/grad_norm`` and every key without a group: ``lr``,
                        ``tokens_per_sec``, ``loss_scale``, ``skipped``, ``spike``, ...
``2_val/...``           ``val/loss``, ``val/perplexity``, ``val/teacher_loss``
``3_system/...``        ``memory_mb``, ``wall_hours``, ``mfu``, ``cost``, ``data_ms``
``4_health/...``        the per-tensor and per-layer statistics ``health/<stat>/<tensor>[/<layer>]``
======================  ========================================================================

Other tags pass unchanged. ``layout_of`` builds the ``custom_scalars`` plugin's layout (its CUSTOM SCALARS
tab) from chart definitions: ``{category: {chart title: [tag regex, ...]}}``, one line per matching tag.
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping

GROUPS = {"train": "1_train", "val": "2_val", "system": "3_system", "health": "4_health"}
SYSTEM = ("memory_mb", "wall_hours", "mfu", "cost", "data_ms")

__all__ = ["GROUPS", "SYSTEM", "board_tag", "exact", "training_charts", "layout_of"]


def board_tag(key: str) -> str:
    """The TensorBoard tag of a logged key (``train/loss`` -> ``1_train/loss``, ``lr`` -> ``1_train/lr``)."""
    group, slash, rest = key.partition("/")
    if not slash:
        return f"{GROUPS['system' if key in SYSTEM else 'train']}/{key}"
    return f"{GROUPS[group]}/{rest}" if group in GROUPS else key


def exact(key: str) -> str:
    """A regex matching the TensorBoard tag of ``key`` and nothing else."""
    return f"^{re.escape(board_tag(key))}$"


def training_charts() -> dict[str, list[str]]:
    """The charts every training run gets first: loss (train and validation together), the learning rate,
    throughput."""
    return {"loss (train, val)": [exact("train/loss"), exact("val/loss")],
            "learning rate": [exact("lr")],
            "tokens/s": [exact("tokens_per_sec")]}


def layout_of(categories: Mapping[str, Mapping[str, Iterable[str]]]) -> dict:
    """``SummaryWriter.add_custom_scalars``' layout: every chart a multi-line chart of its regexes."""
    return {category: {title: ["Multiline", list(tags)] for title, tags in charts.items()}
            for category, charts in categories.items()}
