"""Valid ranges declared next to the defaults (``option(..., min=, max=, above=, below=)``) and enforced when a
config is resolved; OS errors on a path the user chose as one line; a damaged token cache rebuilt."""
import dataclasses
import errno
import importlib
import json
import types
import typing
from pathlib import Path
from typing import Optional

import pytest

from purestep.core.cli import command as cli
from purestep.core.config import ConfigError, UserError, _fields, _is_section, option, resolve, same_as
from purestep.core.cli.config_help import describe
from purestep.core.data.text import prepare
from purestep.core.data.tokenizers import DataError
from purestep.recipes import RECIPES, main


@dataclasses.dataclass
class Ranged:
    count: int = option(16, "at least one", min=1)
    rate: float = option(0.9, "a decay", min=0, below=1)
    step: float = option(1e-3, "positive", above=0)
    share: float = option(0.5, "a fraction", min=0, max=1)
    sizes: tuple[int, ...] = option((1, 2), "each positive", min=1)
    cap: Optional[float] = option(None, "unset or positive", above=0)


@dataclasses.dataclass
class Borrowing:
    count: int = same_as(Ranged, "count")


@pytest.mark.parametrize("key, value, shown, bound", [
    ("count", "0", "count=0", ">= 1"), ("rate", "1", "rate=1.0", "in [0, 1)"), ("rate", "-0.1", "rate=-0.1", "[0, 1)"),
    ("step", "0", "step=0.0", "> 0"), ("share", "1.5", "share=1.5", "in [0, 1]"), ("step", "nan", "step=nan", "> 0"),
    ("sizes", "3,0", "0 in sizes=3,0", "each item must be >= 1"), ("cap", "-1", "cap=-1.0", "> 0"),
])
def test_a_value_out_of_range_names_key_value_and_range(key, value, shown, bound):
    with pytest.raises(ConfigError, match=r"^bad value for '" + key + "'") as e:
        resolve(Ranged, overrides={key: value})
    assert shown in str(e.value) and bound in str(e.value) and "\n" not in str(e.value)


def test_bounds_are_inclusive_or_exclusive_as_declared():
    cfg = resolve(Ranged, overrides={"count": "1", "rate": "0", "share": "1", "sizes": "1", "cap": "none"})
    assert (cfg.count, cfg.rate, cfg.share, cfg.sizes, cfg.cap) == (1, 0.0, 1.0, (1,), None)
    with pytest.raises(ConfigError, match="count=0"):
        resolve(Ranged, toml={"count": 0})                  # a config file's typed value too
    with pytest.raises(ConfigError, match="count=0"):
        resolve(Borrowing, overrides={"count": 0})          # same_as takes the range along


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="not >= 1"):
        option(0, "bad default", min=1)
    with pytest.raises(ValueError, match="not both"):
        option(1, "two lower bounds", min=0, above=0)
    with pytest.raises(ValueError, match="empty range"):
        option(1, "", min=2, max=1)


def test_help_shows_the_range_with_the_type(capsys):
    rows = {key: tstr for key, tstr, _, _ in describe(Ranged)}
    assert rows["rate"] == "float in [0, 1)" and rows["step"] == "float > 0" and rows["cap"] == "float | None > 0"
    assert main(["recipe=standard", "--help"]) == 0
    out = capsys.readouterr().out
    assert "int >= 1" in out and "float in [0, 1)" in out and "float > 0" in out


def _numeric(tp) -> bool:
    if tp in (int, float):
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType, tuple, list):
        return any(_numeric(a) for a in typing.get_args(tp) if a not in (type(None), Ellipsis))
    return False


def _unranged(cls, prefix=""):
    for f, tp in _fields(cls):
        if _is_section(tp):
            yield from _unranged(tp, f"{prefix}{f.name}.")
        elif _numeric(tp) and f.metadata.get("range") is None:
            yield prefix + f.name


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_numeric_key_of_every_recipe_has_a_range_and_the_presets_fit(recipe):
    module = importlib.import_module(RECIPES[recipe])
    assert list(_unranged(module.Config)) == []
    for preset in getattr(module, "PRESETS", None) or {}:
        resolve(module.Config, presets=module.PRESETS, preset=preset)


# ---------------------------------------------------------------------------------------- OS errors on paths

@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EROFS, errno.ENOTDIR, errno.EISDIR,
                                  errno.EDQUOT, errno.ENAMETOOLONG])
def test_os_errors_on_the_run_folder_are_one_line_with_the_path(code, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "run"

    def fails(cfg):
        raise OSError(code, __import__("os").strerror(code), str(folder / "final.msgpack"))
    monkeypatch.setattr(importlib.import_module("purestep.recipes.standard"), "run", fails)
    assert main(["recipe=standard", f"out={folder}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {folder / 'final.msgpack'}: ") and "out=" in lines[0]


def test_a_real_enotdir_from_the_run_folder_lock_is_a_user_error(tmp_path):
    from purestep.core.cli.runs import claim
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(UserError) as e:
        with claim(tmp_path / "a_file" / "run"):
            pass
    assert cli.is_user_error(e.value) and "a_file" in cli.user_message(e.value)
    assert cli.user_message(e.value).startswith(f"cannot create the run folder {tmp_path / 'a_file' / 'run'}: ")


@pytest.mark.parametrize("out", ["/proc/purestep-run", "/sys/purestep-run"])
def test_a_run_folder_under_a_system_folder_is_one_line_naming_path_and_reason(out, corpus, token_cache, capsys):
    """/proc answers mkdir with ENOENT although /proc exists: the line says that folder takes no new ones."""
    assert main(["recipe=standard", "preset=tiny", "compile=false", "steps=1", f"data={corpus}", f"out={out}"]) == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("purestep: ")]
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot create the run folder {out}: "), lines
    assert "Errno" not in lines[0] and "choose another out=" in lines[0]


def test_a_real_name_too_long_is_one_line_before_any_work(tmp_path, capsys):
    assert main(["recipe=standard", f"out={tmp_path / ('x' * 300) / 'run'}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {tmp_path}") and "shorter out=" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_other_os_errors_stay_bugs(monkeypatch, capsys):
    def fails(cfg):
        raise OSError(errno.ECONNRESET, "Connection reset by peer")
    monkeypatch.setattr(importlib.import_module("purestep.recipes.standard"), "run", fails)
    assert main(["recipe=standard"]) == 1
    assert "Traceback" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- damaged token cache

@pytest.fixture
def small_text(tmp_path, monkeypatch):
    monkeypatch.setenv("PURESTEP_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "text.txt"
    path.write_text(Path(json.__file__).read_text())
    return path


@pytest.mark.parametrize("damage", [
    lambda f: (f / "meta.json").write_bytes(b"\x00\xff not json"),
    lambda f: (f / "meta.json").write_text(json.dumps({**json.loads((f / "meta.json").read_text()), "tokenizer": "x"})),
    lambda f: (f / "meta.json").write_text(json.dumps({**json.loads((f / "meta.json").read_text()),
                                                       "tokenizer": {"type": "weird"}})),
    lambda f: (f / "train.bin").write_bytes(b"\xff" * (f / "train.bin").stat().st_size),
    lambda f: (f / "val.bin").write_bytes(b"\x01\x02\x03"),
], ids=["garbage meta", "tokenizer not a table", "unknown tokenizer", "ids outside the vocabulary", "truncated bin"])
def test_a_damaged_token_cache_is_rebuilt(small_text, damage):
    first = prepare(str(small_text))
    train = first.train.copy()
    damage(Path(first.path))
    again = prepare(str(small_text))
    assert again.path == first.path and (again.train == train).all() and again.tokenizer.vocab_size == 256


def test_a_token_cache_that_stays_unreadable_is_one_error_naming_it(small_text, monkeypatch):
    import purestep.core.data.text
    from purestep import core
    folder = prepare(str(small_text)).path

    def unreadable(d):
        raise ValueError("garbage")
    monkeypatch.setattr(core.data.text, "tokenizer_from_dict", unreadable)
    with pytest.raises(DataError, match="token cache .* is unreadable") as e:
        prepare(str(small_text))
    assert folder in str(e.value)
