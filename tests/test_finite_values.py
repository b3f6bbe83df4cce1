"""No key takes infinity or NaN: every float field of every recipe's config refuses ``inf``, ``-inf``, ``nan`` and
values that overflow to inf (``1e309``) with one ``error:`` line naming the key, exit code 2 (``core.config``).

The fields are found by walking the config dataclasses (``core.config._fields``), not listed by hand, so a key
added later is covered the day it lands. No key documents a meaning for infinity (a key that means "no limit"
says which finite value does, e.g. ``budget=0``), so none is exempt.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from purestep.core.config import ConfigError, _fields, _is_section, resolve
from purestep.recipes import RECIPES, main
from purestep.core.cli.command import merge_args  # noqa: E402 (bin/run refuses a repeated key)

ROOT = Path(__file__).resolve().parents[1]
NAMED = ("standard", "distill", "upcycle", "compress")          # the four; every other recipe is checked too
VALUES = ("inf", "-inf", "nan", "1e309")


def _floats(tp) -> bool:
    """``tp`` holds a float: ``float``, ``float | None``, a tuple or list of floats."""
    if tp is float:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType, tuple, list):
        return any(_floats(a) for a in typing.get_args(tp) if a not in (type(None), Ellipsis))
    return False


def float_keys(cls, prefix: str = "") -> list[str]:
    """The dotted key of every float field of config class ``cls``, nested sections included."""
    keys = []
    for f, tp in _fields(cls):
        if _is_section(tp):
            keys += float_keys(tp, f"{prefix}{f.name}.")
        elif _floats(tp):
            keys.append(prefix + f.name)
    return keys


CASES = [(recipe, key) for recipe in RECIPES for key in float_keys(importlib.import_module(RECIPES[recipe]).Config)]


def test_the_walk_finds_the_float_keys_of_the_four_training_recipes():
    found = {recipe: {key for r, key in CASES if r == recipe} for recipe in NAMED}
    assert all(found.values()), found
    assert {"lr", "min_lr", "epochs", "spike.z_threshold", "model.rope_theta"} <= found["standard"]
    assert {"temperature", "lr"} <= found["distill"] and "end_lr" in {k for r, k in CASES if r == "lr_find"}


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("recipe, key", CASES, ids=[f"{r}:{k}" for r, k in CASES])
def test_every_float_key_refuses_non_finite_values(recipe, key, value):
    cls = importlib.import_module(RECIPES[recipe]).Config
    with pytest.raises(ConfigError) as e:
        resolve(cls, overrides={key: value}, context=f"recipe {recipe}")
    message = str(e.value)
    assert message.startswith(f"bad value for '{key}': {key}={value} ") and "\n" not in message, message
    assert ("overflows to inf" if value == "1e309" else "is not finite") in message, message


@pytest.mark.parametrize("typed", [float("inf"), float("nan")])
def test_a_config_files_typed_inf_and_nan_are_refused_too(typed):
    cls = importlib.import_module(RECIPES["standard"]).Config
    with pytest.raises(ConfigError, match=r"^bad value for 'lr': lr=(inf|nan) is not finite; give a finite number >= 0$"):
        resolve(cls, toml={"lr": typed})


@pytest.mark.parametrize("key, value, shown", [
    ("model.rope_scaling.factor", "inf", "model.rope_scaling.factor=inf is not finite"),   # a dict entry
    ("model.rope_scaling", '{"factor": 1e999}', "inf in model.rope_scaling="),             # a whole dict (JSON)
])
def test_floats_inside_dict_keys_are_refused(key, value, shown):
    cls = importlib.import_module(RECIPES["standard"]).Config
    with pytest.raises(ConfigError, match=f"^bad value for '{key}': ") as e:
        resolve(cls, overrides={key: value})
    assert shown in str(e.value)


def test_finite_extremes_are_still_numbers():
    cls = importlib.import_module(RECIPES["standard"]).Config
    cfg = resolve(cls, overrides={"lr": "1e308", "min_lr": "5e-324", "model.rope_scaling.factor": "8"})
    assert (cfg.lr, cfg.min_lr, cfg.model.rope_scaling) == (1e308, 5e-324, {"factor": 8})


def test_epochs_beyond_the_step_counter_are_one_line(corpus, token_cache, tmp_path, capsys):
    """epochs=1e300 is finite, but its step count overflowed the schedule's int64 (a traceback before)."""
    assert main(["recipe=standard", "preset=tiny", "compile=false", f"data={corpus}", "epochs=1e300",
                 f"out={tmp_path / 'run'}"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("purestep: ")]
    assert len(err) == 1 and err[0].startswith("error: bad value for 'epochs': epochs=1e+300 is ") and "fewer" in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, line", [
    (["recipe=standard", "lr=inf"], "error: bad value for 'lr': lr=inf is not finite; give a finite number >= 0"),
    (["recipe=standard", "lr=1e309"], "error: bad value for 'lr': lr=1e309 overflows to inf; give a finite number >= 0"),
    (["recipe=standard", "epochs=inf"], "error: bad value for 'epochs': epochs=inf is not finite; give a finite "
                                        "number >= 0"),
    (["recipe=lr_find", "end_lr=inf"], "error: bad value for 'end_lr': end_lr=inf is not finite; give a finite "
                                       "number > 0"),
    (["recipe=distill", "temperature=nan"], "error: bad value for 'temperature': temperature=nan is not finite; "
                                            "give a finite number > 0"),
])
def test_bin_run_refuses_them_with_one_line_and_exit_2(args, line, tmp_path):
    proc = subprocess.run([sys.executable, "bin/run",
                           *merge_args(*args, f"out={tmp_path / 'run'}")], cwd=ROOT, text=True,
                          capture_output=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (proc.returncode, proc.stderr.strip(), proc.stdout) == (2, line, "")
    assert not (tmp_path / "run").exists()
