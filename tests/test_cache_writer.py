"""One home for atomic writes: ``core/io/cache.py`` renames into place and fsyncs folders (checkpoints, caches
and small JSON files all go through it); nothing else does. Plus the unit tests of ``core.io.cache``."""
from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import numpy as np
import pytest

from purestep.core.io import cache

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "models", "optim", "recipes")
ALLOWED = {"core/io/cache.py",                 # checkpoints too write through it (write_file, publish_file)
           "recipes/bench/checkpoint.py"}   # times torch.save + fsync_path of its *file* against checkpoint.save


def _sources():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _renames_or_folder_syncs(tree: ast.AST) -> list[tuple[int, str]]:
    """Calls that rename a path into place or fsync a folder: ``os.replace``/``os.rename``/``shutil.move``,
    ``<path>.rename(x)``, ``<path>.replace(x)`` (one argument: ``str.replace`` takes two), ``fsync_path``,
    and ``os.fsync`` of anything but ``<file>.fileno()`` (a folder is fsynced through a raw descriptor)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "fsync_path":
            found.append((node.lineno, "fsync_path"))
        if not isinstance(f, ast.Attribute):
            continue
        owner = f.value.id if isinstance(f.value, ast.Name) else None
        if (owner, f.attr) in {("os", "replace"), ("os", "rename"), ("os", "renames"), ("shutil", "move")} \
                or f.attr == "fsync_path":
            found.append((node.lineno, f"{owner}.{f.attr}"))
        elif (owner, f.attr) == ("os", "fsync") and not (
                node.args and isinstance(node.args[0], ast.Call) and isinstance(node.args[0].func, ast.Attribute)
                and node.args[0].func.attr == "fileno"):
            found.append((node.lineno, "os.fsync of a descriptor"))
        elif f.attr == "rename" and owner != "os":
            found.append((node.lineno, ".rename"))
        elif f.attr == "replace" and owner != "os" and len(node.args) == 1 and not node.keywords \
                and not isinstance(f.value, ast.Constant):
            found.append((node.lineno, ".replace"))
    return found


def test_one_cache_writer():
    offenders = [f"{name}:{line} {what}" for name, tree in _sources() if name not in ALLOWED
                 for line, what in _renames_or_folder_syncs(tree)]
    assert not offenders, ("rename into place / fsync a folder only through core.io.cache (build_folder, "
                           f"write_file, write_json, publish_file): {offenders}")
    teacher_caches = [name for name, tree in _sources() for node in ast.walk(tree)
                      if isinstance(node, ast.ClassDef) and node.name == "TeacherCache"]
    assert len(teacher_caches) <= 1, f"one TeacherCache per concept, found in {teacher_caches}"


def test_the_walk_sees_every_kind_of_rename():
    tree = ast.parse("os.replace(a, b)\nos.rename(a, b)\np.rename(q)\np.replace(q)\nfsync_path(d)\n"
                     "ckpt.fsync_path(d)\nos.fsync(fd)\nos.fsync(f.fileno())\n's'.replace('a', 'b')\nx.replace('a', 'b')\nreplace(cfg, a=1)\n")
    assert [line for line, _ in _renames_or_folder_syncs(tree)] == [1, 2, 3, 4, 5, 6, 7]


# ----------------------------------------------------------------------------------------------------------
# core.io.cache

def _layout(meta):
    return {"a": ("int16", meta["shape"]), "b": ("float32", [meta["shape"][0]])}


def _build(builder):
    a = builder.array("a", np.int16, (3, 4))
    a[:] = np.arange(12, dtype=np.int16).reshape(3, 4)
    with builder.open("b.bin") as f:
        f.write(np.array([1.5, 2.5, 3.5], dtype=np.float32).tobytes())
    return {"shape": [3, 4], "what": "test"}


def test_a_complete_folder_reads_back_read_only(tmp_path):
    target = tmp_path / "c"
    assert cache.build_folder(target, _build) == target
    meta, arrays = cache.read_folder(target, _layout)
    assert meta == {"shape": [3, 4], "what": "test"}
    assert json.loads((target / cache.META).read_text()) == meta
    assert arrays["a"].tolist() == np.arange(12).reshape(3, 4).tolist() and arrays["b"].tolist() == [1.5, 2.5, 3.5]
    with pytest.raises(ValueError):
        arrays["a"][0, 0] = 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_crash_before_the_rename_leaves_no_folder_and_the_next_build_succeeds(tmp_path):
    target = tmp_path / "c"

    def crash(builder):
        _build(builder)
        raise KeyboardInterrupt   # everything written, the rename not done
    with pytest.raises(KeyboardInterrupt):
        cache.open_or_build(target, _layout, crash)
    assert list(tmp_path.iterdir()) == []
    meta, arrays = cache.open_or_build(target, _layout, _build)
    assert meta["what"] == "test" and arrays["a"].shape == (3, 4)


def test_incomplete_folders_are_never_read_and_are_rebuilt(tmp_path):
    target = tmp_path / "c"
    cache.build_folder(target, _build)
    with open(target / "a.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(cache.CacheError, match="a.bin is missing or truncated"):
        cache.read_folder(target, _layout)
    assert cache.open_folder(tmp_path / "nothing", _layout) is None
    built = []
    cache.open_or_build(target, _layout, lambda b: built.append(1) or _build(b))
    assert built == [1] and cache.read_folder(target, _layout)[1]["a"].shape == (3, 4)


def test_stale_temp_folders_of_dead_processes_are_cleaned(tmp_path):
    import socket
    target = tmp_path / "c"
    dead = tmp_path / f".c.tmp-999999999@{socket.gethostname()}-x1"   # no such pid
    live = tmp_path / f".c.tmp-{os.getpid()}@{socket.gethostname()}-x2"
    dead.mkdir()
    live.mkdir()
    cache.build_folder(target, _build)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c", live.name])


def test_write_file_is_atomic(tmp_path):
    path = tmp_path / "f.json"
    cache.write_json(path, {"x": 1})
    with pytest.raises(RuntimeError):
        cache.write_file(path, lambda f: (f.write(b"partial"), (_ for _ in ()).throw(RuntimeError()))[0])
    assert json.loads(path.read_text()) == {"x": 1} and [p.name for p in tmp_path.iterdir()] == ["f.json"]
