"""Atomic cache folders and files: the one place that renames something into place and fsyncs a folder.

A cache folder (token memmaps, teacher targets, teacher states, block I/O) is a few raw array files plus a
``meta.json``. :func:`build_folder` writes it the way Orbax's ``AtomicRenameTemporaryPath`` does
(``orbax/checkpoint/_src/path/atomicity.py``): build everything in a temporary folder next to the target
(``.<name>.tmp-<pid>@<host>-XXXX``), flush and fsync every file, write and fsync ``meta.json``, fsync the
temporary folder, ``os.replace`` it onto the target and fsync the parent. A crash at any point leaves either
no target or a complete one; a temporary folder left by a dead process on this host is removed by the next
build of the same target, and is never read (its name is not the target's). :func:`read_folder` opens a
folder, checks its ``meta.json`` against the caller's layout (every array file present with exactly the
bytes its dtype and shape need) and returns the arrays as read-only memmaps.

:func:`write_file` is the same protocol for one file (``mkstemp`` in the target's folder, write, fsync,
``os.replace``, fsync the folder), used for checkpoints, reports and small JSON files; the rename replaces whatever
is at the name, so it never writes through a symbolic link planted there. The files a run appends to (its
``metrics.jsonl``) open with :func:`open_append` (``O_NOFOLLOW``), and a name handed to a writer that is not ours
(TensorBoard's) is vetted by :func:`refuse_link`: a planted link is one error line naming it, its target untouched.
"""
from __future__ import annotations

import contextlib
import csv
import errno
import io
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from purestep.core.config import UserError

META = "meta.json"


class CacheError(Exception):
    """A cache folder that is missing, incomplete or not of the expected layout (the message says why)."""


def fsync_path(path) -> None:
    """fsync a file or a folder by path (a folder's fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    umask = os.umask(0)  # the only way to read it; done once, at import
    os.umask(umask)
    return umask


UMASK = _umask()
FILE_MODE = 0o666 & ~UMASK    # what open() gives; mkstemp's 0600 would hide files from a group
FOLDER_MODE = 0o777 & ~UMASK  # what mkdir() gives; mkdtemp's 0700 likewise


# ------------------------------------------------------------------------------------------------ one file

def write_file(path, write: Callable, *, binary: bool = True, buffering: int = -1):
    """Atomically create or replace ``path`` with what ``write(f)`` writes; returns ``write``'s result.

    The temporary file (``.tmp-XXXX-<name>`` next to ``path``) is removed on any error."""
    path = Path(path)
    folder = path.parent
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=f"-{path.name}")
    try:
        os.fchmod(fd, FILE_MODE)
        with open(fd, "wb" if binary else "w", buffering=buffering, **({} if binary else {"encoding": "utf-8"})) as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_path(folder)
    return result


def refuse_link(path) -> Path:
    """``path`` unless it is a symbolic link, which a run never writes through: a UserError naming it."""
    path = Path(path)
    if path.is_symlink():
        raise UserError(f"{path} is a symbolic link (to {os.readlink(path)}): a run writes its own files, never "
                        f"through a link; remove it")
    return path


def open_append(path, binary: bool = False):
    """``path`` opened for appending, created if missing, without following a symbolic link at it (``O_NOFOLLOW``;
    a link is :func:`refuse_link`'s error)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse_link(path)
        raise
    return open(fd, "ab" if binary else "a", **({} if binary else {"encoding": "utf-8"}))


def write_text(path, text: str) -> None:
    """Atomically write ``text`` (UTF-8) to ``path`` (:func:`write_file`)."""
    write_file(path, lambda f: f.write(text), binary=False)


def write_csv(path, rows) -> None:
    """Atomically write ``rows`` (the header first) as CSV to ``path`` (:func:`write_file`)."""
    out = io.StringIO(newline="")
    csv.writer(out).writerows(rows)
    write_text(path, out.getvalue())


def write_json(path, data) -> None:
    """Atomically write ``data`` as indented JSON to ``path`` (its folder is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, lambda f: json.dump(data, f, indent=1), binary=False)


def publish_file(src, dst) -> None:
    """Make ``dst`` an atomic hard link to ``src`` (a durable copy where links are not supported)."""
    src, dst = Path(src), Path(dst)
    tmp = dst.with_name(f".tmp-{os.urandom(6).hex()}-{dst.name}")
    try:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
            fsync_path(tmp)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_path(dst.parent)


# ------------------------------------------------------------------------------------------------ a folder

class FolderBuilder:
    """Handed to a build callback: ``path`` is the temporary folder; ``array`` makes a writable memmap
    ``<name>.bin`` and ``open`` a binary file, both flushed and fsynced by :func:`build_folder`."""

    def __init__(self, path: Path):
        self.path, self._arrays = path, []

    def array(self, name: str, dtype, shape) -> np.ndarray:
        shape = tuple(int(d) for d in shape)
        if int(np.prod(shape)) == 0:
            (self.path / f"{name}.bin").touch()
            return np.empty(shape, dtype=dtype)
        a = np.memmap(self.path / f"{name}.bin", dtype=dtype, mode="w+", shape=shape)
        self._arrays.append(a)
        return a

    def open(self, filename: str):
        return open(self.path / filename, "wb")

    def finish(self, meta: dict | None) -> None:
        for a in self._arrays:
            a.flush()
        self._arrays.clear()
        for p in self.path.iterdir():
            if p.is_file():
                fsync_path(p)
        if meta is not None:
            with open(self.path / META, "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
        os.chmod(self.path, FOLDER_MODE)
        fsync_path(self.path)


def _temp_prefix(target: Path) -> str:
    return f".{target.name}.tmp-{os.getpid()}@{socket.gethostname()}-"


def clean_stale(target: Path) -> None:
    """Remove temporary folders of ``target`` left by processes of this host that are gone."""
    pattern = re.compile(re.escape(f".{target.name}.tmp-") + r"(\d+)@(.+)-[^-]+")
    if not target.parent.is_dir():
        return
    for p in target.parent.iterdir():
        m = pattern.fullmatch(p.name)
        if m and m.group(2) == socket.gethostname() and not _alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def build_folder(target, build: Callable[[FolderBuilder], dict | None], *,
                 keep: Callable[[Path], bool] | None = None) -> Path:
    """Atomically create ``target`` from ``build(builder)`` (see the module docstring).

    ``build`` writes its files into ``builder.path`` and returns the meta dict (written as ``meta.json``;
    None writes none). If ``target`` exists when the build is done (a stale cache, or a concurrent build that
    finished first), it is kept when ``keep(target)`` says so, else replaced."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(target)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), dir=target.parent))
    try:
        builder = FolderBuilder(tmp)
        builder.finish(build(builder))
        if target.exists():
            if keep is not None and keep(target):
                return target
            aside = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), dir=target.parent))
            os.replace(target, aside / "old")   # a folder rename cannot replace a non-empty folder
            shutil.rmtree(aside, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:   # a concurrent build published in between: a folder rename cannot replace it
            if keep is None or not keep(target):
                raise
            return target
        fsync_path(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def read_meta(folder) -> dict:
    """The ``meta.json`` of a cache folder; :class:`CacheError` if there is none or it is not a JSON object."""
    path = Path(folder) / META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise CacheError(f"no readable {META}") from None
    if not isinstance(meta, dict):
        raise CacheError(f"{META} is not a JSON object")
    return meta


def read_folder(folder, layout: Callable[[dict], dict]) -> tuple[dict, dict]:
    """``(meta, {name: read-only memmap})`` of a complete cache folder, else :class:`CacheError`.

    ``layout(meta)`` gives ``{name: (dtype, shape)}`` of the ``<name>.bin`` files (it may raise CacheError,
    KeyError, TypeError or ValueError for a meta of another format or version)."""
    folder = Path(folder)
    meta = read_meta(folder)
    try:
        files = layout(meta)
        sizes = {name: (np.dtype(dt), tuple(int(d) for d in shape)) for name, (dt, shape) in files.items()}
    except (KeyError, TypeError, ValueError) as e:
        raise CacheError(f"{META} lacks or has a bad {e}") from None
    arrays = {}
    for name, (dtype, shape) in sizes.items():
        f = folder / f"{name}.bin"
        want = dtype.itemsize * int(np.prod(shape))
        if not f.is_file() or f.stat().st_size != want:
            raise CacheError(f"{f.name} is missing or truncated (expected {want:,} bytes)")
        arrays[name] = np.memmap(f, dtype=dtype, mode="r", shape=shape) if want else np.empty(shape, dtype)
    return meta, arrays


def open_folder(folder, layout: Callable[[dict], dict]) -> tuple[dict, dict] | None:
    """:func:`read_folder`, or None for a folder that is missing, incomplete or of another layout."""
    try:
        return read_folder(folder, layout)
    except CacheError:
        return None


def open_or_build(target, layout: Callable[[dict], dict], build: Callable[[FolderBuilder], dict]) -> tuple[dict, dict]:
    """The cache at ``target``, built first (atomically) unless a complete one is there."""
    found = open_folder(target, layout)
    if found is not None:
        return found
    build_folder(target, build, keep=lambda t: open_folder(t, layout) is not None)
    return read_folder(target, layout)
