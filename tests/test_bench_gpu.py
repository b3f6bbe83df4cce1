"""``bin/run recipe=bench.gpu`` (the one prepared GPU command) in its CPU mode, so it never rots: every section
runs at the tiny scale as a user runs it (a subprocess, exit 0), and writes a report that says what ran."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from purestep.core.cli.command import merge_args  # noqa: E402 (bin/run refuses a repeated key)

pytestmark = pytest.mark.slow


def test_the_gpu_bench_runs_every_section_on_the_cpu(tmp_path):
    out = tmp_path / "bench"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(REPO / "bin" / "run"), *merge_args("recipe=bench.gpu", "device=cpu",
                           f"out={out}")], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["machine"]["scale"] == "tiny" and report["summary"]["failed"] == 0
    names = {section: {i["name"]: i for i in items} for section, items in report["sections"].items()}
    assert set(names) == {"checks", "recipes", "upcycle", "speed", "ranks"}
    ran = {n for n, i in names["checks"].items() if i["ok"] is True}
    assert {"cpu_vs_device_fp32", "bf16_vs_fp32", "fp16_vs_fp32", "donation", "checkpoint_roundtrip",
            "kv_cache_generation"} <= ran
    assert names["checks"]["sdpa_kernel"]["ok"] is None   # CUDA kernels only
    gguf = importlib.util.find_spec("gguf") is not None   # the hf extra
    assert all(i["ok"] is True or (n == "export_gguf" and not gguf and "needs gguf" in i["reason"])
               for n, i in names["recipes"].items()), names["recipes"]
    assert {"standard", "distill", "export_gguf", "ddp"} <= set(names["recipes"])
    quality = names["upcycle"]["quality"]
    assert quality["ok"] is True and quality["kv_bytes_ratio"] == 0.5 and quality["tokens"]["global"] > 0
    ratio = names["speed"]["tiny/ratio"]
    assert ratio["ok"] is True and ratio["tokens_per_s_ratio"] > 0
    for parallel in ("ddp", "fsdp"):     # 2 gloo ranks against one process, each rank's peak memory read back
        scaling = names["ranks"][f"{parallel}_2_scaling"]
        assert scaling["ok"] is True and scaling["efficiency"] > 0 and len(scaling["peak_mib_per_rank"]) == 2
    md = (out / "report.md").read_text()
    assert "# bench.gpu report" in md and "## speed" in md and "| functional |" in md


def test_a_failing_item_is_reported_and_the_next_runs(tmp_path):
    """An exception inside an item marks it failed with its message and traceback; the report goes on."""
    from purestep.recipes.bench.gpu.report import Report, Skip
    report = Report(tmp_path, {"device": "cpu", "torch": "x", "cuda": None, "python": "3", "cpus": 1, "date": "d",
                               "command": "c"})
    with report.item("checks", "broken") as item:
        raise ValueError("wrong by 3.5")
    with report.item("checks", "skipped") as item:
        raise Skip("needs CUDA")
    with report.item("checks", "fine") as item:
        item["summary"] = "all good"
    data = json.loads((tmp_path / "report.json").read_text())
    broken, skipped, fine = data["sections"]["checks"]
    assert broken["ok"] is False and broken["error"] == "ValueError: wrong by 3.5" and "raise ValueError" in \
        broken["traceback"]
    assert skipped["ok"] is None and skipped["reason"] == "needs CUDA"
    assert fine["ok"] is True and data["summary"] == {**data["summary"], "passed": 1, "failed": 1, "skipped": 1}
