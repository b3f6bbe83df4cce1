"""TensorBoard opens on what matters: a run's event files carry a custom-scalars layout covering every
per-layer statistic, and tags under which loss, learning rate and throughput sort before the per-layer groups."""
from __future__ import annotations

import json
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.util import tensor_util

from purestep.core.io.board import board_tag
from purestep.optim.health import COLUMNS
from purestep.recipes import main

pytestmark = pytest.mark.usefixtures("token_cache", "one_thread")   # tests/conftest.py

FOUR_LAYERS = ["model.d_model=32", "model.n_layers=4", "model.n_heads=2", "block_size=32", "batch_size=4",
               "compile=false", "sample_tokens=0", "eval_batches=2", "steps=4", "eval_every=2", "log_every=2",
               "save_every=0"]


def group(tag: str) -> str:
    return tag.split("/")[0]


def read_layout(events: EventAccumulator) -> layout_pb2.Layout:
    (event,) = events.Tensors("custom_scalars__config__")[-1:]
    return layout_pb2.Layout.FromString(tensor_util.make_ndarray(event.tensor_proto).item())


def test_layout_covers_every_per_layer_statistic_and_loss_sorts_first(corpus, tmp_path):
    out = tmp_path / "run"
    assert main(["recipe=standard", f"data={corpus}", f"out={out}", *FOUR_LAYERS]) == 0
    events = EventAccumulator(str(out), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    first = {"1_train/loss", "2_val/loss", "1_train/lr", "1_train/tokens_per_sec"}
    assert first <= tags
    health = {t for t in tags if group(t) == "4_health"}
    per_layer = {t for t in health if re.search(r"/\d+$", t)}
    assert len(per_layer) >= 4 * 9 * len(COLUMNS) and {t.split("/")[1] for t in health} >= set(COLUMNS)
    assert not [t for t in tags if t.startswith("health/")]                 # every statistic kept, renamed
    # TensorBoard sorts groups by the part before the first '/': what matters comes first
    order = sorted({group(t) for t in tags})
    assert max(order.index(group(t)) for t in first) < order.index("4_health")
    assert order[:2] == ["1_train", "2_val"]

    layout = read_layout(events)
    charts = [(chart.title, chart) for c in layout.category for chart in c.chart]
    assert layout.category[0].title == "training"
    regexes = [(title, re.compile(r)) for title, chart in charts for r in chart.multiline.tag]
    uncovered = [t for t in health if not any(r.match(t) for _, r in regexes)]
    assert uncovered == []
    for column in COLUMNS:                     # one chart of every tensor and layer per statistic ...
        everything = [r for title, r in regexes if title == f"{column}: every tensor and layer"]
        assert len(everything) == 1 and {t for t in health if everything[0].match(t)} == \
            {t for t in health if t.split("/")[1] == column}
        by_layer = [r for title, r in regexes if title == f"{column}: layers.attn.wq by layer"]
        assert [t for t in sorted(tags) if by_layer[0].match(t)] == [f"4_health/{column}/layers.attn.wq/{i}"
                                                                   for i in range(4)]
    loss = next(chart for title, chart in charts if title == "loss (train, val)")
    assert [t for t in sorted(tags) if any(re.match(r, t) for r in loss.multiline.tag)] == ["1_train/loss",
                                                                                           "2_val/loss"]

    # metrics.jsonl keeps the keys as logged; TensorBoard holds the same values under board_tag's names
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for key in ("train/loss", "lr", "tokens_per_sec", "memory_mb", "val/loss", "health/grad_norm/layers.attn.wq/3"):
        last = [r for r in records if key in r][-1]
        assert events.Scalars(board_tag(key))[-1].value == pytest.approx(last[key], rel=1e-6), key


def test_board_tag_scheme():
    assert [board_tag(k) for k in ("train/loss", "lr", "tokens_per_sec", "val/perplexity", "memory_mb",
                                   "health/zero/embed", "orchestrator/strategy", "lr_find/loss")] == \
        ["1_train/loss", "1_train/lr", "1_train/tokens_per_sec", "2_val/perplexity", "3_system/memory_mb",
         "4_health/zero/embed", "orchestrator/strategy", "lr_find/loss"]
