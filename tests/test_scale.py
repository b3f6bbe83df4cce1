"""Scale out and run long: torchrun data parallel, preemption, multi-stage runs, telemetry, budget, FIM."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from purestep.core.io import checkpoint as ckpt
from purestep.recipes import main
from purestep.core.data.fim import FIM, fim_ids
from purestep.core.data.tokenizers import ByteTokenizer
from purestep.core.tree import max_abs_diff, tree_leaves
from purestep.core.step import Parallel
from purestep.core.cli.command import merge_args  # noqa: E402 (bin/run refuses a repeated key)

REPO = Path(__file__).resolve().parent.parent
TINY = ["recipe=standard", "preset=tiny", "compile=false", "sample_tokens=0", "log_every=2"]


pytestmark = pytest.mark.usefixtures("token_cache")   # corpus and token_cache: tests/conftest.py


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_torchrun_two_ranks_equal_one_process(corpus, tmp_path):
    common = [*TINY, f"data={corpus}", "steps=12", "eval_every=6"]
    assert main([*common, "batch_size=8", f"out={tmp_path / 'one'}"]) == 0
    proc = subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", str(REPO / "bin" / "run"),
                           *merge_args(*common,
                           "batch_size=4", f"out={tmp_path / 'two'}")], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (ckpt.load(tmp_path / name / "final.msgpack") for name in ("one", "two"))
    assert max_abs_diff(one["state"]["params"], two["state"]["params"]) < 1e-6
    assert abs(one["val_loss"] - two["val_loss"]) < 1e-6       # the same validation set, split over ranks
    assert not list((tmp_path / "two").glob("events*"))[1:]      # rank 0 alone logs: one event file


def test_sigterm_checkpoints_exits_zero_and_resumes_exactly(corpus, tmp_path, one_thread):
    common = [*TINY, f"data={corpus}", "steps=40", "eval_every=0", "save_every=0", "log_every=1",
              "decay_steps=40", f"out={tmp_path / 'run'}"]
    child = subprocess.Popen([sys.executable, str(REPO / "bin" / "run"), *merge_args(*common)], cwd=tmp_path, env=env(),
                             stderr=subprocess.PIPE, text=True)
    for line in child.stderr:                   # wait until it is really training
        if line.startswith("step 3/"):
            break
    child.send_signal(signal.SIGTERM)
    rest = child.stderr.read()
    assert child.wait(timeout=120) == 0, rest
    assert "SIGTERM at step" in rest and "to resume, run again: purestep" in rest
    stopped = ckpt.latest(tmp_path / "run")
    step = ckpt.read_meta(stopped)["step"]
    assert 3 <= step < 40 and not (tmp_path / "run" / "final.msgpack").exists()

    assert main(common) == 0                    # the same command resumes and finishes
    assert main([*TINY, f"data={corpus}", "steps=40", "eval_every=0", "save_every=0", "decay_steps=40",
                 f"out={tmp_path / 'straight'}"]) == 0
    a, b = (ckpt.load(tmp_path / name / "final.msgpack")["state"] for name in ("run", "straight"))
    assert all(torch.equal(x, y) for x, y in zip(tree_leaves(a), tree_leaves(b)))


def test_two_stage_config_continues_from_the_first_stage(corpus, tmp_path):
    config = tmp_path / "stages.toml"
    config.write_text(f"""
recipe = "standard"
preset = "tiny"
data = "{corpus}"
compile = false
sample_tokens = 0
eval_every = 0

[[stages]]
name = "short"
block_size = 64
steps = 6

[[stages]]
name = "long"
block_size = 128
steps = 3
lr = 0.0
min_lr = 0.0
""")
    assert main([f"config={config}", f"out={tmp_path / 'run'}"]) == 0
    first = ckpt.load(tmp_path / "run" / "1-short" / "final.msgpack")
    second = ckpt.load(tmp_path / "run" / "2-long" / "final.msgpack")
    assert first["config"]["block_size"] == 64 and second["config"]["block_size"] == 128
    # lr = 0 in stage 2: its weights are exactly where stage 1 left them
    assert max_abs_diff(first["state"]["params"], second["state"]["params"]) == 0.0
    assert main([f"config={config}", f"out={tmp_path / 'run'}"]) == 0   # rerun: both stages already done


def test_telemetry_in_tensorboard_and_budget_stop(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, f"data={corpus}", "steps=6", "eval_every=0", "peak_flops=1e12", "cost_per_hour=3.6",
                 f"out={out}"]) == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(out), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"3_system/mfu", "1_train/tokens_per_sec", "1_train/param_norm", "3_system/memory_mb", "3_system/cost",
            "3_system/wall_hours"} <= tags                                  # core.io.board.board_tag
    mfu = acc.Scalars("3_system/mfu")[-1].value
    assert 0 < mfu < 1
    cost = acc.Scalars("3_system/cost")[-1].value
    assert cost == pytest.approx(acc.Scalars("3_system/wall_hours")[-1].value * 3.6, rel=1e-6)

    capped = tmp_path / "capped"
    assert main([*TINY, f"data={corpus}", "steps=500", "eval_every=0", "cost_per_hour=3600", "budget=2",
                 f"out={capped}"]) == 0       # 1 per second: stops after ~2 s of wall time
    step = ckpt.read_meta(ckpt.latest(capped))["step"]
    assert 1 <= step < 500
    events = [json.loads(l) for l in (capped / "metrics.jsonl").read_text().splitlines() if '"event"' in l]
    assert events[-1]["event"] == "budget"
    assert "budget 2 reached" in capsys.readouterr().err


def test_fim_rearranges_windows_deterministically():
    (pre, suf, mid), extra = fim_ids(ByteTokenizer())
    assert (pre, suf, mid, extra) == (256, 257, 258, 3)
    fim = FIM(0.5, pre, suf, mid)
    windows = np.arange(2 * 8 * 33).reshape(2, 8, 33) % 200
    out = fim.apply(windows, seed=3, cursor=7)
    assert np.array_equal(out, fim.apply(windows, seed=3, cursor=7)) and out.shape == windows.shape
    changed = [r for r in out.reshape(-1, 33) if r[0] == pre]
    assert 0 < len(changed) < 16
    for row, orig in zip(out.reshape(-1, 33), windows.reshape(-1, 33)):
        if row[0] != pre:
            assert np.array_equal(row, orig)
            continue
        s, m = list(row).index(suf), list(row).index(mid)
        prefix, suffix, middle = row[1:s], row[s + 1:m], row[m + 1:]
        assert np.array_equal(np.concatenate([prefix, middle, suffix]), orig[:30])   # PSM of the first 30
    assert ByteTokenizer().decode([104, 105, pre, 33, mid]) == "hi<fim_prefix>!<fim_middle>"


def test_fim_training_run(corpus, tmp_path):
    out = tmp_path / "fim"
    assert main([*TINY, f"data={corpus}", "steps=4", "eval_every=0", "fim_rate=0.5", f"out={out}"]) == 0
    top = ckpt.load(out / "final.msgpack")
    assert top["model"]["config"]["vocab_size"] == 259


def test_the_compiled_step_traces_with_a_cross_rank_reduce(monkeypatch):
    """Data parallel with compile=true died in tracing (optree's TreeSpec inside the graph). Dynamo's tracing
    is what failed, so this compiles with the eager backend (no inductor codegen: seconds, not minutes) in one
    process, with a reduce shaped like ``Dist.all_reduce_mean``; the metrics and state equal the uncompiled step."""
    import functools

    from purestep import optim
    from purestep.core.state import init_state
    from purestep.core.step import make_train_step
    from purestep.models import llama
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    cfg = llama.LlamaConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=1e-2))
    seen = []

    def reduce(leaves):
        seen.append(len(leaves))
        return [t * 1.0 for t in leaves]
    tok = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    batch = {"x": tok[:, :-1], "y": tok[:, 1:]}
    results = []
    for compile in (True, False):
        step = make_train_step(lambda p, b: llama.loss(p, b, cfg), opt, compile=compile,
                               parallel=Parallel(reduce=reduce))
        results.append(step(init_state(llama.init(cfg, seed=0), opt), batch))
    (compiled, m1), (eager, m2) = results
    assert seen and seen[0] == len(tree_leaves(compiled.params)) + 1       # every gradient and the loss
    assert max_abs_diff(compiled.params, eager.params) < 1e-6 and torch.allclose(m1["loss"], m2["loss"])
