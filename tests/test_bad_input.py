"""The bad-input matrix: hostile command lines and config files each end with exit 2 and exactly one
``error:`` line naming the bad key or path: no traceback, and no run folder created."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from purestep.recipes import main
from purestep.core.cli.command import merge_args  # noqa: E402 (bin/run refuses a repeated key)

REPO = Path(__file__).resolve().parent.parent
BASE = ["recipe=standard", "preset=tiny", "compile=false", "sample_tokens=0", "eval_batches=1", "steps=4"]

# (arguments after BASE, fragment the error line must contain); {tmp} is the test's temporary folder
MATRIX = [
    (["batch_size=0"], "batch_size"), (["block_size=0"], "block_size"), (["eval_batches=0"], "eval_batches"),
    (["log_every=0"], "log_every"), (["lr=-1"], "lr"), (["steps=-5"], "steps"), (["steps=0"], "steps"),
    (["save_every=-3"], "save_every"), (["keep_last=-1"], "keep_last"), (["grad_accum=0"], "grad_accum"),
    (["warmup_steps=-1"], "warmup_steps"), (["min_lr=-1"], "min_lr"), (["weight_decay=-0.1"], "weight_decay"),
    (["beta1=1.5"], "beta1"), (["beta2=-0.1"], "beta2"), (["grad_clip=0"], "grad_clip"), (["fim_rate=2"], "fim_rate"),
    (["eval_every=-1"], "eval_every"), (["patience=-1"], "patience"), (["spike.ema=1.5"], "spike.ema"),
    (["model.d_model=0"], "model.d_model"), (["model.n_layers=0"], "model.n_layers"),
    (["model.n_heads=0"], "model.n_heads"), (["sample_temperature=-1"], "sample_temperature"),
    (["budget=5"], "budget"), (["lr=abc"], "lr"), (["steps=1.5"], "steps"), (["dtype=fp8"], "dtype"),
    (["device=tpu"], "device"), (["lr_schedule=weird"], "lr_schedule"), (["clipping=some"], "clipping"),
    (["no_such_key=1"], "no_such_key"), (["model.no_such=1"], "model.no_such"), (["preset=nope"], "nope"),
    (["--fast"], "--fast"), (["notkeyvalue"], "notkeyvalue"), (["=3"], "=3"),
    (["data={tmp}/missing.txt"], "missing.txt"), (["data={tmp}/binary.bin"], "binary.bin"),
    (["data={tmp}/empty.txt"], "empty.txt"), (["tokenizer={tmp}/missing.json"], "missing.json"),
    (["resume={tmp}/missing.msgpack"], "missing.msgpack"), (["init={tmp}/missing"], "missing"),
    (["init={tmp}/garbage_hf"], "garbage_hf"), (["config={tmp}/missing.toml"], "missing.toml"),
    (["config={tmp}/bad.toml"], "bad.toml"), (["config={tmp}/strange_recipe.toml"], "this.nothing"),
    (["name=../../../x"], "name="), (["config={tmp}/bad_stage.toml"], "stages.name"),
    (["out={tmp}/a_file/run"], "a_file"),
]


@pytest.fixture
def hostile(tmp_path, corpus, token_cache, monkeypatch):
    """The files the matrix points at, in a folder that is also the working directory (runs/ would land here)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "a_file").write_text("not a folder")
    hf = tmp_path / "garbage_hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, '
                                    '"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, '
                                    '"intermediate_size": 128}')
    (hf / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage garbage garbage")
    (tmp_path / "bad.toml").write_text("steps = \n")
    (tmp_path / "strange_recipe.toml").write_text('recipe = "this.nothing"\n')
    (tmp_path / "bad_stage.toml").write_text('[[stages]]\nname = "../../../x"\nsteps = 1\n')
    return tmp_path, corpus


def _args(case, tmp, corpus):
    args = [a.replace("{tmp}", str(tmp)) for a in case]
    files = [Path(a.split("=", 1)[1]) for a in args if a.startswith("config=")]
    if any(f.exists() and "recipe" in f.read_text() for f in files):   # the file names the recipe itself
        return [*BASE[1:], f"data={corpus}", f"out={tmp / 'run'}", *args]
    data = [] if any(a.startswith(("data=", "config=")) for a in args) else [f"data={corpus}"]
    out = [] if any(a.startswith(("out=", "name=")) for a in args) else [f"out={tmp / 'run'}"]
    return [*BASE, *data, *out, *args]


def _before(tmp):
    return sorted(p.name for p in tmp.iterdir())


@pytest.mark.parametrize("case,fragment", MATRIX, ids=[" ".join(c) for c, _ in MATRIX])
def test_bad_input_is_one_line_and_exit_2(case, fragment, hostile, capsys):
    tmp, corpus = hostile
    before = _before(tmp)
    assert main(_args(case, tmp, corpus)) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], err
    assert "Traceback" not in out + err
    assert _before(tmp) == before                    # no run folder (nor runs/) created


@pytest.mark.parametrize("case,fragment", [(["batch_size=0"], "batch_size"), (["lr=-1"], "lr"),
                                           (["data={tmp}/binary.bin"], "binary.bin"),
                                           (["name=../../../x"], "name="), (["config={tmp}/bad.toml"], "bad.toml")])
def test_bad_input_through_the_real_program(case, fragment, hostile):
    tmp, corpus = hostile
    before = _before(tmp)
    proc = subprocess.run([sys.executable, str(REPO / "bin" / "run"), *merge_args(*_args(case, tmp, corpus))], cwd=tmp,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], proc.stderr
    assert _before(tmp) == before
