"""bin/run and core.cli.command: argument parsing, help, and exit codes, against the fake recipe in this folder."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fake_recipe
from purestep import recipes
from purestep.core.cli import command as cli
from purestep.core.cli.command import merge_args  # noqa: E402 (bin/run refuses a repeated key)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipe=tests.fake_recipe"           # bin/run also takes a module path as the recipe


def run(*args: str) -> subprocess.CompletedProcess:
    """bin/run as a real subprocess from the repo root (PYTHONPATH makes tests.fake_recipe importable)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "bin/run", *merge_args(*args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def assert_user_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


@pytest.fixture
def fake(monkeypatch):
    """Register the fake recipe as 'fake' for in-process calls to core.cli.command.main."""
    monkeypatch.setitem(recipes.RECIPES, "fake", "fake_recipe")
    fake_recipe.RUNS.clear()
    return fake_recipe.RUNS


# ----------------------------------------------------------------------------------------------------------
# the real program

def test_happy_path_passes_the_parsed_config(tmp_path):
    out = tmp_path / "cfg.json"
    proc = run(RECIPE, "preset=tiny", "lr=1e-3", "compile=yes", "model.d_model=64", f"out={out}")
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(out.read_text())
    assert (cfg["steps"], cfg["lr"], cfg["compile"]) == (10, 1e-3, True)
    assert cfg["model"] == {"n_layers": 2, "d_model": 64}


@pytest.mark.parametrize("args, fragments", [
    (["lrr=3"], ["unknown key 'lrr' for recipe tests.fake_recipe; did you mean 'lr'?", "valid keys: steps, lr,"]),
    (["model.n_layer=3"], ["did you mean 'model.n_layers'?"]),
    (["steps=abc"], ["bad value for 'steps': 'abc' is not an int"]),
    (["device=tpu"], ["bad value for 'device': 'tpu'; choose one of auto, cpu, cuda, mps"]),
    (["steps"], ["argument 'steps' is not key=value"]),
    (["--steps=3"], ["unexpected option '--steps=3'"]),
    (["preset=huge"], ["unknown preset 'huge'", "valid presets: tiny, small"]),
    (["config=missing.toml"], ["config file missing.toml not found"]),
    (["fail=user"], ["error: the dataset is empty"]),           # a multi-line message comes out on one line
    (["fail=data"], ["shard 3 is truncated"]),
    (["fail=checkpoint"], ["ckpt.msgpack is corrupt"]),           # core.io.checkpoint.CheckpointError
    (["fail=missing"], ["error: nowhere.bin: no such file or directory"]),    # not Python's "[Errno 2] ..."
])
def test_user_errors_are_one_line_and_exit_2(args, fragments):
    assert_user_error(run(RECIPE, *args), *fragments)


def test_a_bad_checkpoint_is_a_user_error(tmp_path):
    """core.io.checkpoint.CheckpointError is a UserError subclass: a real recipe reading a bad file exits 2."""
    bad = tmp_path / "ckpt.msgpack"
    bad.write_bytes(b"garbage")
    assert_user_error(run("recipe=generate", f"init={bad}"), f"{bad}: not a purestep checkpoint")


def test_recipe_errors():
    assert_user_error(run("recipe=standrd"), "unknown recipe 'standrd'; did you mean 'standard'?")
    assert_user_error(run("steps=3"), "no recipe given")
    assert_user_error(run("recipe=tests.no_such_recipe"), "recipe 'tests.no_such_recipe' is not available")


def test_a_bug_keeps_its_traceback_and_exits_1():
    proc = run(RECIPE, "fail=bug")
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "RuntimeError: an actual bug" in proc.stderr


@pytest.mark.parametrize("fail, code, line", [("gate", 3, "gate failed: perplexity ratio 1.4 > 1.2"),
                                               ("stopped", 4, "stopped: 3 rollbacks within 1000 steps")])
def test_a_failed_gate_and_an_unfinished_run_have_codes_of_their_own(fail, code, line):
    proc = run(RECIPE, f"fail={fail}")
    assert proc.returncode == code and proc.stderr.strip() == line and "Traceback" not in proc.stderr


def test_interrupt_exits_130():
    proc = run(RECIPE, "fail=interrupt")
    assert proc.returncode == 130 and proc.stderr.strip() == "interrupted"


def test_recipe_help_lists_keys_with_types_defaults_and_presets():
    proc = run(RECIPE, "--help")
    assert proc.returncode == 0 and proc.stderr == ""
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert rows["steps"][:3] == ["steps", "int", "100"] and proc.stdout.count("optimizer steps") == 1
    assert rows["lr"][:3] == ["lr", "float", "0.0003"]
    assert rows["device"][:3] == ["device", "auto|cpu|cuda|mps", "auto"]
    assert rows["model.n_layers"][:3] == ["model.n_layers", "int", "4"]
    assert rows["tiny"] == ["tiny", "steps=10", "model.n_layers=2"]
    assert fake_recipe.DESCRIPTION in proc.stdout


def test_help_with_settings_shows_the_resolved_values():
    proc = run("-h", RECIPE, "preset=tiny", "lr=0.5")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert rows["key"][2] == "value"
    assert rows["steps"][2] == "10" and rows["lr"][2] == "0.5" and rows["model.n_layers"][2] == "2"


def test_top_level_help_lists_recipes():
    proc = run("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: purestep recipe=NAME")
    for name in recipes.RECIPES:
        assert f"\n  {name}" in proc.stdout


# ----------------------------------------------------------------------------------------------------------
# in process

def test_main_in_process_with_config_file(fake, tmp_path, capsys):
    path = tmp_path / "exp.toml"
    path.write_text('recipe = "fake"\npreset = "tiny"\nlr = 0.01\n[model]\nd_model = 32\n')
    assert recipes.main([f"config={path}", "steps=7"]) == 0
    (cfg,) = fake
    assert (cfg.steps, cfg.lr, cfg.model.n_layers, cfg.model.d_model) == (7, 0.01, 2, 32)
    assert recipes.main([f"config={path}", "preset=small"]) == 0      # command-line preset beats the file's
    assert (fake[-1].steps, fake[-1].model.n_layers, fake[-1].lr) == (100, 8, 0.01)


def test_later_arguments_win(fake):
    assert recipes.main(["recipe=fake", "steps=1", "steps=2"]) == 0
    assert fake[-1].steps == 2


def test_bad_config_file_in_process(fake, tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("steps = \n")
    assert recipes.main(["recipe=fake", f"config={path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: bad config file {path}:") and "line 1" in err and err.count("\n") == 1
    assert fake == []


def test_top_level_help_in_process_shows_descriptions(fake, monkeypatch, capsys):
    monkeypatch.setitem(recipes.RECIPES, "ghost", "no_such_recipe_module")
    assert recipes.main(["--help"]) == 0
    out = capsys.readouterr().out
    width = max(map(len, recipes.RECIPES))
    assert f"\n  {'fake'.ljust(width)}  {fake_recipe.DESCRIPTION}\n" in out
    assert f"\n  {'ghost'.ljust(width)}  (not available yet: no module no_such_recipe_module)\n" in out
    assert recipes.main(["recipe=ghost"]) == 2
    assert capsys.readouterr().err == "error: recipe 'ghost' is not available: no module no_such_recipe_module\n"


def test_user_error_classes():
    from purestep.core.io.checkpoint import CheckpointError
    from purestep.core.data.tokenizers import DataError

    class CheckpointErrorLookalike(Exception):   # a user error by class, never by name
        pass
    CheckpointErrorLookalike.__name__ = "CheckpointError"

    assert cli.is_user_error(DataError("x")) and cli.is_user_error(FileNotFoundError("x"))
    assert cli.is_user_error(CheckpointError("x")) and cli.is_user_error(fake_recipe.DataError("x"))
    assert not cli.is_user_error(CheckpointErrorLookalike("x"))
    assert not cli.is_user_error(RuntimeError("x")) and not cli.is_user_error(KeyError("x"))
    assert not hasattr(cli, "USER_ERROR_NAMES")
