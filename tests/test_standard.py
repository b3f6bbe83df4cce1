"""The standard recipe end to end: training, TensorBoard, checkpoints, exact resume, bad input, generate, lr_find."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from purestep.core.io import checkpoint as ckpt
from purestep.recipes import main
from purestep.core.tree import tree_leaves
from purestep.core.cli.command import merge_args  # noqa: E402 (bin/run refuses a repeated key)

REPO = Path(__file__).resolve().parent.parent
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "block_size=32", "batch_size=4",
        "compile=false", "sample_tokens=16", "eval_batches=2", "log_every=2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """About 60 KB of real text: a few of this Python's own standard-library modules."""
    import json
    import textwrap
    folder = tmp_path_factory.mktemp("corpus")
    text = "".join(Path(m.__file__).read_text() for m in (json, textwrap))
    path = folder / "text.txt"
    path.write_text(text)
    return path


pytestmark = pytest.mark.usefixtures("token_cache")   # tests/conftest.py


def train(corpus, out, *extra):
    assert main(["recipe=standard", f"data={corpus}", f"out={out}", *TINY, *extra]) == 0


def test_trains_and_logs_to_tensorboard(corpus, tmp_path):
    out = tmp_path / "run"
    train(corpus, out, "steps=8", "eval_every=4", "save_every=4")
    assert (out / "final.msgpack").exists() and (out / "best.msgpack").exists()
    top = ckpt.load(out / "final.msgpack")
    assert top["step"] == 8 and top["recipe"] == "standard" and top["tokenizer"]["type"] == "byte"
    assert int(top["state"]["cursor"]) == 8 and "loop" in top

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("1_train/loss", "1_train/grad_norm", "1_train/lr", "1_train/tokens_per_sec", "3_system/memory_mb",
                "2_val/loss", "2_val/perplexity"):          # core.io.board.board_tag
        assert tag in tags, tag
    assert [e.step for e in events.Scalars("2_val/loss")] == [4, 8]
    assert len(events.Scalars("1_train/loss")) == 4
    text_tags = set(events.Tags()["tensors"])
    assert "samples/text_summary" in text_tags or "samples" in str(text_tags)


def test_resume_is_bitwise_exact(corpus, tmp_path):
    """Train 6, stop, resume to 12 == train 12 straight (same LR horizon via decay_steps)."""
    common = ("decay_steps=12", "eval_every=0", "save_every=0", "warmup_steps=2", "sample_tokens=0")
    train(corpus, tmp_path / "a", "steps=6", *common)
    train(corpus, tmp_path / "a", "steps=12", *common)
    train(corpus, tmp_path / "b", "steps=12", *common)
    a = ckpt.load(tmp_path / "a" / "final.msgpack")
    b = ckpt.load(tmp_path / "b" / "final.msgpack")
    assert a["step"] == b["step"] == 12
    la, lb = tree_leaves(a["state"]), tree_leaves(b["state"])
    assert len(la) == len(lb)
    assert all(torch.equal(x, y) for x, y in zip(la, lb))


def test_resume_never_starts_over_and_init_fine_tunes(corpus, tmp_path):
    train(corpus, tmp_path / "base", "steps=10", "eval_every=0", "lr=3e-3", "sample_tokens=0")
    base = ckpt.load(tmp_path / "base" / "final.msgpack")
    tuned = tmp_path / "tuned"
    train(corpus, tuned, f"init={tmp_path / 'base'}", "steps=2", "eval_every=0", "lr=0", "min_lr=0",
          "sample_tokens=0")
    after = ckpt.load(tuned / "final.msgpack")
    # lr=0: the fine-tune starts from, and keeps, the base weights
    assert torch.equal(after["state"]["params"]["embed"], base["state"]["params"]["embed"])
    assert after["step"] == 2


def test_early_stopping(corpus, tmp_path):
    out = tmp_path / "run"
    train(corpus, out, "steps=50", "eval_every=2", "patience=2", "lr=0", "min_lr=0", "sample_tokens=0")
    top = ckpt.load(out / "final.msgpack")
    assert top["step"] == 6  # eval at 2 sets the best; 4 and 6 do not improve on it


def run_cli(*args, cwd=REPO):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(REPO / "bin" / "run"), *merge_args(*args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def snapshot(folder: Path):
    return sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*"))


@pytest.fixture(scope="module")
def existing_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("existing") / "run"
    train(corpus, out, "steps=2", "eval_every=0", "sample_tokens=0")
    return out


BAD = {
    "missing data path": (["data=/nonexistent/text.txt"], "/nonexistent/text.txt"),
    "unknown key": (["lrr=0.1"], "lrr"),
    "wrong type": (["steps=many"], "steps"),
    "unknown preset": (["preset=huge"], "huge"),
}


@pytest.mark.parametrize("case", list(BAD) + ["empty file", "non-utf8 under char"])
def test_bad_input_is_one_line_and_touches_nothing(case, corpus, existing_run, tmp_path):
    if case == "empty file":
        empty = tmp_path / "empty.txt"
        empty.write_text("")
        args, needle = [f"data={empty}"], str(empty)
    elif case == "non-utf8 under char":
        latin = tmp_path / "latin1.txt"
        latin.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 50)
        args, needle = [f"data={latin}", "tokenizer=char"], str(latin)
    else:
        args, needle = BAD[case]
        args = args if args[0].startswith("data=") else [f"data={corpus}", *args]
    before = snapshot(existing_run)
    proc = run_cli("recipe=standard", f"out={existing_run}", *TINY, "steps=4", *args)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert snapshot(existing_run) == before


def test_generate_recipe(existing_run, capsys):
    assert main(["recipe=generate", f"init={existing_run}", "prompt=import ", "max_new_tokens=12",
                 "temperature=0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("import ") and len(out) > len("import ")


def test_lr_find_leaves_the_state_untouched(corpus, tmp_path):
    from purestep import optim
    from purestep.core.data.text import prepare
    from purestep.core.state import init_state
    from purestep.core.step import make_train_step
    from purestep.core.tree import clone
    from purestep.models import llama
    from purestep.recipes.lr_find import lr_range_test, suggest

    cfg = llama.LlamaConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2)
    batches = prepare(str(corpus)).batches(4, 32, seed=0)
    opt = optim.adamw(lr=1.0)
    state = init_state(llama.init(cfg), opt)
    before = clone(state)
    step = make_train_step(lambda p, b: llama.loss(p, b, cfg), opt)
    rows = lr_range_test(state, step, batches, [1e-5 * 10 ** (i / 6) for i in range(30)])
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(state), tree_leaves(before)))
    assert len(rows) >= 10 and rows[0][0] == pytest.approx(1e-5)
    at_min, steepest = suggest(rows)
    assert 1e-6 < at_min < 1.0 and 1e-5 <= steepest <= rows[-1][0]
    assert main(["recipe=lr_find", f"data={corpus}", f"out={tmp_path / 'lrf'}", "model.d_model=32",
                 "model.n_layers=1", "model.n_heads=2", "block_size=32", "batch_size=4", "num_steps=12"]) == 0
    assert (tmp_path / "lrf" / "lr_find.csv").read_text().startswith("lr,loss,smoothed_loss")


def test_device_choices_come_from_core_device():
    import dataclasses

    from purestep.core.device import DEVICES
    from purestep.recipes import generate
    from purestep.recipes.train.config import TrainConfig
    for cls in (TrainConfig, generate.Config):
        (field,) = [f for f in dataclasses.fields(cls) if f.name == "device"]
        assert field.metadata["choices"] == DEVICES == ("auto", "cpu", "cuda", "mps")
