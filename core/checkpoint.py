"""Checkpoints on disk: atomic save and checked load of one file, and a folder of them.

The bytes are ``core.checkpoint_format`` (Flax-compatible msgpack, streamed both ways). A file appears
atomically (Orbax ``AtomicRenameTemporaryPath``, reduced to one file, via ``core.cache.write_file``):
``mkstemp(dir=folder, prefix=".tmp-")``, write, flush, fsync, ``os.replace``, fsync the folder; the temp
file is unlinked on any error, and a SIGKILL leaves at most a stale ``.tmp-*`` that discovery ignores and
:class:`CheckpointManager` cleans up. A truncated or corrupt file raises :class:`CheckpointError`, which
is how discovery skips a bad newest file.
"""
from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any

from core.cache import fsync_path, publish_file, write_file
from core.checkpoint_format import (CHUNKED, DTYPES, FORMAT, MAX_CHUNK_SIZE, CheckpointError, Writer,
                                    from_state_dict, read, to_state_dict)

__all__ = ["CHUNKED", "DTYPES", "FORMAT", "MAX_CHUNK_SIZE", "CheckpointError", "from_state_dict", "to_state_dict",
           "fsync_path", "save", "load", "read_meta", "latest", "CheckpointManager", "resolve_resume", "BEST",
           "FINAL"]

_BUFFER = 1 << 20                 # file buffer for headers and small tensors


def save(path, tree: Any, *, step: int, extra: dict | None = None) -> int:
    """Write ``tree`` (any pytree of tensors, NamedTuples, tuples, dicts, scalars) atomically to ``path``.

    ``extra`` adds top-level entries (config, tokenizer, meta: dicts, lists, scalars, tensors).
    Returns the number of bytes written.
    """
    top = {"format": FORMAT, "step": int(step), "state": to_state_dict(tree)}
    for key, value in (extra or {}).items():
        if key in top:
            raise ValueError(f"extra key {key!r} is reserved")
        top[key] = value

    def write(f) -> int:
        Writer(f).value(top, "")
        return f.tell()
    return write_file(path, write, buffering=_BUFFER)


def load(path, template: Any = None, device=None) -> dict:
    """Read a checkpoint: the top-level map (format, step, state, extras).

    Without ``template`` the state is nested dicts of tensors and Python values (on ``device`` or the CPU).
    With one (a fresh TrainState, any pytree) the state takes its exact structure, each leaf checked.
    """
    top = read(path, device)
    if template is not None:
        try:
            top["state"] = from_state_dict(template, top["state"], device=device)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
    return top


def read_meta(path) -> dict:
    """Step and extras of a checkpoint without reading its state (the framing is still fully checked)."""
    top = read(path, skip_state=True)
    del top["state"]
    return top


# ----------------------------------------------------------------------------- a folder of checkpoints

_STEP_FILE = re.compile(r"step_(\d+)\.msgpack$")
BEST, FINAL = "best.msgpack", "final.msgpack"


def _step_files(folder: Path) -> list[tuple[int, Path]]:
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_FILE.fullmatch(p.name))]
    return sorted(found)


def latest(folder) -> Path | None:
    """The readable checkpoint with the highest step stored in the file; bad files are skipped with a warning."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    candidates = [p for _, p in _step_files(folder)] + [folder / n for n in (BEST, FINAL) if (folder / n).exists()]
    best_key, best_path = None, None
    for p in candidates:
        try:
            step = read_meta(p)["step"]
        except CheckpointError as e:
            warnings.warn(f"skipping checkpoint {e}", stacklevel=2)
            continue
        key = (step, p.name.startswith("step_"))
        if best_key is None or key > best_key:
            best_key, best_path = key, p
    return best_path


class CheckpointManager:
    """``step_{n:09d}.msgpack`` files in one folder: save every N steps, keep the last K, plus
    ``best.msgpack`` (lowest validation loss, stored in the file so it survives restarts) and
    ``final.msgpack``. ``keep_last=0`` keeps every step file; ``save_every=0`` saves only when asked.
    Stale ``.tmp-*`` files of a killed writer are removed when a manager opens the folder.
    """

    def __init__(self, folder, *, keep_last: int = 3, save_every: int = 0):
        self.folder = Path(folder)
        self.keep_last, self.save_every = keep_last, save_every
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(".tmp-*"):
            stale.unlink(missing_ok=True)
        self.best_loss = None
        if (self.folder / BEST).exists():
            try:
                self.best_loss = read_meta(self.folder / BEST).get("val_loss")
            except CheckpointError as e:
                warnings.warn(f"ignoring best checkpoint {e}", stacklevel=2)

    def should_save(self, step: int) -> bool:
        return self.save_every > 0 and step > 0 and step % self.save_every == 0

    def save(self, step: int, tree: Any, extra: dict | None = None, val_loss: float | None = None,
             final: bool = False) -> Path:
        path = self.folder / f"step_{step:09d}.msgpack"
        extra = dict(extra or {})
        if val_loss is not None:
            extra["val_loss"] = float(val_loss)
        save(path, tree, step=step, extra=extra)
        if val_loss is not None and math.isfinite(val_loss) and (self.best_loss is None or val_loss < self.best_loss):
            publish_file(path, self.folder / BEST)
            self.best_loss = float(val_loss)
        if final:
            publish_file(path, self.folder / FINAL)
        if self.keep_last > 0:
            for _, old in _step_files(self.folder)[:-self.keep_last]:
                if old != path:  # after resuming from an older step, never drop what was just written
                    old.unlink(missing_ok=True)
        return path

    def latest(self) -> Path | None:
        return latest(self.folder)

    def best(self) -> Path | None:
        p = self.folder / BEST
        return p if p.exists() else None


def resolve_resume(resume: str, folder) -> Path | None:
    """``resume=auto`` -> the latest good checkpoint in ``folder`` (or None); ``never`` -> None;
    anything else is a checkpoint file (or a folder of them) that must exist and be readable."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest(folder)
    p = Path(resume)
    if p.is_dir():
        found = latest(p)
        if found is None:
            raise CheckpointError(f"{p}: no readable checkpoint in this folder")
        return found
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint (use resume=auto, resume=never or a file path)")
    read_meta(p)
    return p
