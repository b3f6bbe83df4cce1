"""core.io.logging: what the Logger writes is read back with TensorBoard's own reader and json."""
from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from tensorboard.util import tensor_util

from purestep.core.io import logging as log
from purestep.core.io.logging import Logger, format_duration, to_floats


def read_events(folder) -> EventAccumulator:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    events.Reload()
    return events


def texts(events: EventAccumulator, tag: str) -> list[tuple[int, str]]:
    return [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode())
            for e in events.Tensors(f"{tag}/text_summary")]


def read_jsonl(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_scalars_reach_tensorboard_and_jsonl(tmp_path):
    with Logger(tmp_path, console=False) as logger:
        got = logger.scalars(10, {"train/loss": torch.tensor(2.5), "lr": 1e-3, "tokens": torch.tensor(4096)})
        logger.scalars(torch.tensor(20), {"train/loss": torch.tensor(2.25), "val/perplexity": 9.5})
    assert got == {"train/loss": 2.5, "lr": 1e-3, "tokens": 4096.0}
    events = read_events(tmp_path)
    # TensorBoard tags are core.io.board.board_tag's: loss, lr and throughput sort first; JSONL keeps the keys
    assert [(e.step, e.value) for e in events.Scalars("1_train/loss")] == [(10, 2.5), (20, 2.25)]
    assert [(e.step, e.value) for e in events.Scalars("2_val/perplexity")] == [(20, 9.5)]
    assert events.Scalars("1_train/lr")[0].value == pytest.approx(1e-3)
    records = read_jsonl(tmp_path)
    assert [r["step"] for r in records] == [10, 20]
    assert records[0]["train/loss"] == 2.5 and records[0]["tokens"] == 4096.0
    assert records[1]["val/perplexity"] == 9.5 and "lr" not in records[1]
    assert all(abs(r["time"] - records[0]["time"]) < 60 for r in records)


def test_non_finite_values_are_strict_json_nulls(tmp_path):
    with Logger(tmp_path, console=False) as logger:
        logger.scalars(1, {"loss": torch.tensor(float("nan")), "grad_norm": float("inf"), "lr": 0.1})
    (record,) = read_jsonl(tmp_path)
    assert record["loss"] is None and record["grad_norm"] is None and record["lr"] == 0.1
    assert math.isnan(read_events(tmp_path).Scalars("1_train/loss")[0].value)   # TensorBoard keeps the NaN


def test_text_events_histogram(tmp_path):
    with Logger(tmp_path, console=False) as logger:
        logger.text(5, "samples", "To be, or not to be")
        logger.event(7, "rollback", to_step=3, reason="loss spike", loss=torch.tensor(9.0))
        logger.histogram(5, "grad/layers", torch.arange(10.0))
    events = read_events(tmp_path)
    assert texts(events, "samples") == [(5, "To be, or not to be")]
    assert texts(events, "events/rollback") == [(7, "step 7: rollback (to_step=3, reason=loss spike, loss=9.0)")]
    (histogram,) = events.Histograms("grad/layers")
    assert histogram.step == 5 and histogram.histogram_value.num == 10 and histogram.histogram_value.max == 9
    (record,) = read_jsonl(tmp_path)
    assert record == {"step": 7, "time": record["time"], "event": "rollback", "to_step": 3,
                      "reason": "loss spike", "loss": 9.0}


def test_histograms_are_tensorboards_default_buckets(tmp_path):
    """The same buckets as ``add_histogram``'s default ("tensorflow"), which the Logger hands over as an array."""
    from torch.utils.tensorboard import SummaryWriter
    values = torch.tensor([1e-6, 3e-4, 2e-3, 0.5, -0.02, 7.0, 7.0])
    with Logger(tmp_path / "ours", console=False) as logger:
        logger.histogram(1, "h", values)
        logger.histogram(2, "h", values * 3)
    writer = SummaryWriter(str(tmp_path / "torch"))
    writer.add_histogram(log.board_tag("h"), values, 1)
    writer.add_histogram(log.board_tag("h"), values * 3, 2)
    writer.close()
    ours, theirs = (read_events(tmp_path / name).Histograms(log.board_tag("h")) for name in ("ours", "torch"))
    assert [(e.step, e.histogram_value) for e in ours] == [(e.step, e.histogram_value) for e in theirs]


def test_layout_is_a_custom_scalars_config_and_histograms_follow_the_tag_scheme(tmp_path):
    from tensorboard.plugins.custom_scalar import layout_pb2
    with Logger(tmp_path, console=False) as logger:
        logger.layout({"training": {"loss": ["^1_train/loss$", "^2_val/loss$"]}})
        logger.histogram(1, "health/grad_norm", torch.arange(4.0))
    events = read_events(tmp_path)
    (event,) = events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(tensor_util.make_ndarray(event.tensor_proto).item())
    (category,) = layout.category
    assert category.title == "training" and [c.title for c in category.chart] == ["loss"]
    assert list(category.chart[0].multiline.tag) == ["^1_train/loss$", "^2_val/loss$"]
    assert events.Tags()["histograms"] == ["4_health/grad_norm"]


def test_hparams_go_into_the_same_run(tmp_path):
    config = {"lr": 1e-3, "compile": False, "out": None, "model": {"n_layers": 2, "dims": (4, 8)}}
    with Logger(tmp_path, console=False) as logger:
        logger.hparams(config, {"val/loss": None, "hparam/final_loss": torch.tensor(1.5)}, step=100)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == []      # no sub-run folder
    events = read_events(tmp_path)
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    values = start.session_start_info.hparams
    assert values["lr"].number_value == pytest.approx(1e-3) and values["model.n_layers"].number_value == 2
    assert values["model.dims"].string_value == "[4, 8]" and values["out"].string_value == "null"
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert [m.name.tag for m in experiment.metric_infos] == ["2_val/loss", "hparam/final_loss"]
    assert [(e.step, e.value) for e in events.Scalars("hparam/final_loss")] == [(100, 1.5)]
    assert "2_val/loss" not in events.Tags()["scalars"]
    ((step, table),) = texts(events, "config")
    assert "| `model.n_layers` | `2` |" in table and "| `lr` | `0.001` |" in table


def test_jsonl_appends_across_loggers(tmp_path):
    for step in (1, 2):
        with Logger(tmp_path, tensorboard=False, console=False) as logger:
            logger.scalars(step, {"loss": 1.0 / step})
    assert [r["loss"] for r in read_jsonl(tmp_path)] == [1.0, 0.5]


def test_disabled_logger_writes_nothing(tmp_path, capsys):
    folder = tmp_path / "rank1"
    with Logger(folder, enabled=False) as logger:
        logger.scalars(1, {"loss": 1.0})
        logger.text(1, "samples", "x")
        logger.event(1, "rollback")
        logger.hparams({"lr": 1.0})
        logger.histogram(1, "h", torch.ones(3))
        logger.progress(1, 10, loss=1.0)
        logger.print("hello")
    assert not folder.exists()
    assert capsys.readouterr() == ("", "")


def test_progress_plain_lines_with_eta(tmp_path, capsys, monkeypatch):
    clock = iter([100.0, 110.0, 112.0])
    monkeypatch.setattr(log.time, "monotonic", lambda: next(clock))
    with Logger(tmp_path, tensorboard=False, jsonl=False) as logger:
        logger.progress(10, 100, loss=torch.tensor(2.5), tokens_per_sec=12345.0, extra={"lr": 3e-4})
        logger.progress(20, 100, loss=2.25, tokens_per_sec=1.5e6)      # 1.0 s/step, 80 steps to go
        logger.print("saved checkpoint")
        logger.progress(30, 100, loss=2.0)                             # EMA: 0.7 * 1.0 + 0.3 * 0.2 = 0.76
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["step 10/100 (10.0%) | loss 2.5 | tok/s 12.3k | lr 0.0003",
                     "step 20/100 (20.0%) | loss 2.25 | tok/s 1.5M | eta 1m20s",
                     "saved checkpoint",
                     "step 30/100 (30.0%) | loss 2 | eta 53s"]


def test_status_lines_go_through_one_function(tmp_path, capsys, monkeypatch):
    """``core.io.logging.progress`` prints a status line on stderr (nothing on stdout); Logger.print uses it."""
    log.progress("purestep: tokenizing x")
    assert capsys.readouterr() == ("", "purestep: tokenizing x\n")
    seen = []
    monkeypatch.setattr(log, "progress", seen.append)
    with Logger(tmp_path, tensorboard=False, jsonl=False) as logger:
        logger.print("saved checkpoint")
    assert seen == ["saved checkpoint"]


def test_progress_redraws_one_line_on_a_terminal(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    clock = iter([0.0, 1.0, 2.0])
    monkeypatch.setattr(log.time, "monotonic", lambda: next(clock))
    with Logger(tmp_path, tensorboard=False, jsonl=False) as logger:
        logger.progress(1, 4, loss=1.0)
        logger.progress(2, 4, loss=0.5)
        logger.print("eval loss 0.7")
        logger.progress(3, 4, loss=0.4)
    clear = "\r\x1b[K"
    assert capsys.readouterr().err == (
        f"{clear}step 1/4 (25.0%) | loss 1{clear}step 2/4 (50.0%) | loss 0.5 | eta 2s"
        f"{clear}eval loss 0.7\n{clear}step 3/4 (75.0%) | loss 0.4 | eta 1s\n")   # close() ends the line


def test_to_floats_packs_tensors():
    got = to_floats({"a": torch.tensor(1.5), "b": 2, "c": torch.tensor(3, dtype=torch.int64),
                     "d": torch.tensor([4.0]), "e": torch.tensor(0.1, dtype=torch.bfloat16)})
    assert got == {"a": 1.5, "b": 2.0, "c": 3.0, "d": 4.0, "e": float(torch.tensor(0.1, dtype=torch.bfloat16))}
    assert list(got) == ["a", "b", "c", "d", "e"] and all(type(v) is float for v in got.values())


def test_memory_and_durations():
    """Peak memory grows with a fresh 256 MiB allocation (in a new process: this one's peak is unknown)."""
    import subprocess
    import sys
    code = ("import torch; from core.io.logging import memory_mb; a = memory_mb('cpu'); "
            "b = torch.ones(64 * 2**20); print(memory_mb(torch.device('cpu')) - a)")
    grew = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert grew > 200
    assert [format_duration(s) for s in (0.4, 59, 61, 3599, 3600 * 2 + 300)] == ["0s", "59s", "1m01s", "59m59s", "2h05m"]


def test_scalars_of_one_step_are_one_event_that_tensorboard_reads_as_separate_tags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from purestep.core.io.logging import Logger
    logger = Logger(tmp_path, console=False)
    logger.scalars(10, {"train/loss": 1.5, "health/a/norm": 2.0})
    logger.scalars(20, {"train/loss": 1.25, "health/a/norm": float("nan")})
    logger.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    by_tag = {t.split("_", 1)[1]: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()["scalars"]}
    assert by_tag["train/loss"] == [(10, 1.5), (20, 1.25)]
    assert by_tag["health/a/norm"][0] == (10, 2.0) and by_tag["health/a/norm"][1][1] != by_tag["health/a/norm"][1][1]
