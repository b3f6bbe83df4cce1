"""Checkpoints on disk: atomic save and checked load of one file, and a folder of them.

The bytes are ``core.io.checkpoint_format`` (Flax-compatible msgpack, streamed both ways). A file appears
atomically (Orbax ``AtomicRenameTemporaryPath``, reduced to one file, via ``core.io.cache.write_file``):
``mkstemp(dir=folder, prefix=".tmp-")``, write, flush, fsync, ``os.replace``, fsync the folder; the temp
file is unlinked on any error, and a SIGKILL leaves at most a stale ``.tmp-*`` that discovery ignores and
:class:`CheckpointManager` cleans up; a save that fails on the way (disk full, I/O error) raises
:class:`CheckpointSaveError` naming the file and the OS reason. A truncated or corrupt file, or one whose
tensor bytes do not match their stored CRC-32s, raises :class:`CheckpointError`, which is how discovery
(:func:`latest`, ``resume=auto``) skips a bad newest file, saying so on stderr; ``resume=auto`` refuses a
folder of checkpoints none of which is good rather than start over on top of them. ``best.msgpack`` and
``final.msgpack`` are hard links to a step file, so a damaged step file damages them too and discovery
falls back past all three. So is ``stopped.msgpack``, the last state of a run that stopped without finishing
(``core.exits.RunStopped``): ``resume=auto`` refuses its folder, naming the state and the ways on. The state
dicts are Flax's (``flax.serialization.to_state_dict`` / ``from_state_dict``), the template check naming the
dotted path of any mismatch.
"""
from __future__ import annotations

import errno
import math
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch

from purestep.core.io import checkpoint_shards as shards
from purestep.core.io.cache import fsync_path, publish_file, write_file
from purestep.core.io.checkpoint_checksums import Checksums
from purestep.core.io.checkpoint_format import (_NAMES, CHECKSUMS, CHUNKED, DTYPES, FORMAT, MAX_CHUNK_SIZE, CheckpointError,
                                    Writer, read)
from purestep.core.exits import RunStopped
from purestep.core.io.logging import progress

__all__ = ["CHUNKED", "DTYPES", "FORMAT", "MAX_CHUNK_SIZE", "CheckpointError", "CheckpointSaveError",
           "from_state_dict", "to_state_dict", "Deferred", "make_deferred", "fsync_path", "save", "load",
           "read_meta", "latest", "CheckpointManager", "resolve_resume", "stopped_run", "BEST", "FINAL", "STOPPED"]

_BUFFER = 1 << 20                 # file buffer for headers and small tensors


class CheckpointSaveError(CheckpointError):
    """A save that failed on the way to the disk (disk full, I/O error): the file it would have replaced
    is untouched and its temporary file gone."""


# ----------------------------------------------------------------------------- state dicts (flax)

def _is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


class Deferred:
    """A leaf whose tensor is made when the writer reaches it (``fn()``): a sharded leaf gathered from its ranks
    (``core.parallel.shard``), so a save holds one whole leaf at a time. Every rank must make the same leaves in the
    same order: the writer on one, :func:`make_deferred` on the others."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self) -> torch.Tensor:
        return self.fn()


def make_deferred(tree: Any) -> None:
    """Make (and drop) every :class:`Deferred` leaf of ``tree`` in the order :func:`save` writes them: what a
    rank that does not write does while another saves, so their collectives pair up."""
    def walk(x):
        if isinstance(x, Deferred):
            x()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
    walk(to_state_dict(tree))


def to_state_dict(tree: Any, path: str = "state") -> Any:
    """Flax ``to_state_dict``: containers become str-keyed dicts; tensors and Python scalars stay."""
    if isinstance(tree, (torch.Tensor, Deferred)) or tree is None or isinstance(tree, (bool, int, float, complex, str, bytes)):
        return tree
    if _is_namedtuple(tree):
        return {f: to_state_dict(v, f"{path}.{f}") for f, v in zip(tree._fields, tree)}
    if isinstance(tree, (tuple, list)):
        return {str(i): to_state_dict(v, f"{path}.{i}") for i, v in enumerate(tree)}
    if isinstance(tree, dict):
        out = {str(k): to_state_dict(v, f"{path}.{k}") for k, v in tree.items()}
        if len(out) != len(tree):
            raise ValueError(f"{path}: keys {list(tree)} collide once turned into strings")
        return out
    raise TypeError(f"{path}: cannot checkpoint a value of type {type(tree).__name__}")


def from_state_dict(template: Any, state_dict: Any, *, device=None, path: str = "state") -> Any:
    """Rebuild ``template``'s structure (NamedTuples, tuples, dict keys) from a state dict.

    Every tensor must match the template leaf's shape and dtype; it lands on ``device``, or else on the
    template leaf's device. Any mismatch raises :class:`CheckpointError` naming the dotted path.
    """
    if isinstance(template, torch.Tensor):
        if not isinstance(state_dict, torch.Tensor):
            raise CheckpointError(f"{path}: {_describe(state_dict)} in file, a tensor expected")
        if state_dict.shape != template.shape:
            raise CheckpointError(f"{path}: shape {tuple(state_dict.shape)} in file, "
                                  f"{tuple(template.shape)} expected")
        if state_dict.dtype != template.dtype:
            raise CheckpointError(f"{path}: dtype {_NAMES[state_dict.dtype]} in file, "
                                  f"{_NAMES.get(template.dtype, template.dtype)} expected")
        target = device if device is not None else template.device
        return state_dict.to("cpu" if torch.device(target).type == "meta" else target)
    if template is None or isinstance(template, (bool, int, float, complex, str, bytes)):
        if type(state_dict) is not type(template):
            raise CheckpointError(f"{path}: {_describe(state_dict)} in file, {type(template).__name__} expected")
        return state_dict
    if not isinstance(template, (tuple, list, dict)):
        raise TypeError(f"{path}: cannot restore into a value of type {type(template).__name__}")
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"{path}: {_describe(state_dict)} in file, a container expected")
    if _is_namedtuple(template):
        children = [(f, f, v) for f, v in zip(template._fields, template)]
    elif isinstance(template, dict):
        children = [(str(k), k, v) for k, v in template.items()]
    else:
        children = [(str(i), i, v) for i, v in enumerate(template)]
    wanted = {s for s, _, _ in children}
    missing = [s for s, _, _ in children if s not in state_dict]
    unexpected = [s for s in state_dict if s not in wanted]
    if missing or unexpected:
        problems = ([f"keys missing from file {missing}"] if missing else []) + \
                   ([f"unexpected keys in file {unexpected}"] if unexpected else [])
        raise CheckpointError(f"{path}: {'; '.join(problems)}")
    values = [from_state_dict(t, state_dict[s], device=device, path=f"{path}.{s}") for s, _, t in children]
    if _is_namedtuple(template):
        return type(template)(*values)
    if isinstance(template, dict):
        return type(template)(zip((k for _, k, _ in children), values))
    return type(template)(values)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {_NAMES[x.dtype]} tensor of shape {tuple(x.shape)}"
    return "a container" if isinstance(x, dict) else f"a {type(x).__name__}"


# ----------------------------------------------------------------------------- one file

def save(path, tree: Any, *, step: int, extra: dict | None = None) -> int:
    """Write ``tree`` (any pytree of tensors, NamedTuples, tuples, dicts, scalars) atomically to ``path``.

    ``extra`` adds top-level entries (config, tokenizer, meta: dicts, lists, scalars, tensors).
    Returns the number of bytes written.
    """
    top = {"format": FORMAT, "step": int(step), "state": to_state_dict(tree)}
    for key, value in (extra or {}).items():
        if key in top or key == CHECKSUMS:
            raise ValueError(f"extra key {key!r} is reserved")
        top[key] = value

    def write(f) -> int:
        checksums = Checksums()
        try:
            Writer(f, checksums).checkpoint(top)
        finally:
            checksums.close()
        return f.tell()
    with _saving(path):
        return write_file(path, write, buffering=_BUFFER)


@contextmanager
def _saving(path):
    """Turn an OS error while writing ``path`` (disk full, I/O error) into one :class:`CheckpointSaveError`."""
    try:
        yield
    except OSError as e:
        reason = f"{e.strerror} (errno {errno.errorcode.get(e.errno, e.errno)})" if e.strerror else str(e)
        raise CheckpointSaveError(f"{path}: cannot save the checkpoint: {reason}; the files already in "
                                  f"{Path(path).parent} are untouched") from None


def load(path, template: Any = None, device=None, boxes: Optional[dict] = None) -> dict:
    """Read a checkpoint: the top-level map (format, step, state, extras).

    Without ``template`` the state is nested dicts of tensors and Python values (on ``device`` or the CPU).
    With one (a fresh TrainState, any pytree) the state takes its exact structure, each leaf checked.
    ``boxes`` (``{dotted path: {whole, offset, length}}``): those leaves come back cut to their box, read from a
    sharded save's files without making them whole (``core.io.checkpoint_shards.join``); ``template`` then holds
    the boxes' shapes there.
    """
    top = read(path, device)
    if shards.SHARDS in top:     # a sharded save's index: its leaves made whole (or boxed) from the ranks' files
        top = shards.join(top, Path(path).parent, device, boxes)
    elif boxes:
        top["state"] = shards.cut(top["state"], boxes)
    if template is not None:
        try:
            top["state"] = from_state_dict(template, top["state"], device=device)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
    return top


def read_meta(path) -> dict:
    """Step and extras of a checkpoint without reading its state (the framing is still fully checked)."""
    top = read(path, state="skip")
    del top["state"]
    top.pop(CHECKSUMS, None)
    return top


# ----------------------------------------------------------------------------- a folder of checkpoints

_STEP_FILE = re.compile(r"step_(\d+)\.msgpack$")
BEST, FINAL = "best.msgpack", "final.msgpack"
STOPPED = "stopped.msgpack"       # the last state of a run that stopped without finishing (core.exits.RunStopped)


def _step_files(folder: Path) -> list[tuple[int, Path]]:
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_FILE.fullmatch(p.name))]
    return sorted(found)


def _candidates(folder: Path) -> list[Path]:
    return [p for _, p in _step_files(folder)] + [folder / n for n in (BEST, FINAL) if (folder / n).exists()]


def _file_id(p: Path):
    st = p.stat()
    return st.st_dev, st.st_ino


def latest(folder) -> Path | None:
    """The good checkpoint with the highest step stored in the file. A bad file (truncated, corrupt, a
    tensor whose CRC does not match) is skipped with one line on stderr naming it (and its hard links:
    best/final are links to a step file) and the one used.

    Every candidate's framing is read (seeking past the tensors); the newest is then read in full through
    a small buffer to check its tensors' CRCs, and so on down until one passes."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    ranked, bad = [], {}  # bad: file id -> [the error, the names of its other links]

    def skip(p: Path, e: CheckpointError | None = None) -> None:
        if _file_id(p) in bad:
            bad[_file_id(p)][1].append(p.name)
        else:
            bad[_file_id(p)] = [e, []]

    for p in _candidates(folder):
        try:
            top = read(p, state="skip")
        except CheckpointError as e:
            skip(p, e)
            continue
        ranked.append(((top["step"], p.name.startswith("step_")), CHECKSUMS in top, p, top))
    chosen = None
    for _, checked, p, top in sorted(ranked, key=lambda r: r[0], reverse=True):
        if _file_id(p) in bad:  # a link to a file found bad already
            skip(p)
            continue
        try:
            if checked:
                read(p, state="check")
            shards.check(top, folder)
        except CheckpointError as e:
            skip(p, e)
            continue
        chosen = p
        break
    for e, links in bad.values():
        also = f" (also {', '.join(links)}: the same file)" if links else ""
        progress(f"skipping checkpoint {e}{also}; " + (f"using {chosen}" if chosen else "no good checkpoint left"))
    return chosen


class CheckpointManager:
    """``step_{n:09d}.msgpack`` files in one folder: save every N steps, keep the last K, plus
    ``best.msgpack`` (lowest validation loss, stored in the file so it survives restarts) and
    ``final.msgpack`` (or ``stopped.msgpack``). ``keep_last=0`` keeps every step file; ``save_every=0`` saves
    only when asked.
    With ``keep_back`` set (how far back a loss-spike rollback must reach) the pruning also
    spares the newest step file at or before ``step - keep_back``; ``pruned`` lists the steps it deleted.
    Stale ``.tmp-*`` files of a killed writer are removed when a manager opens the folder.
    """

    def __init__(self, folder, *, keep_last: int = 3, save_every: int = 0, keep_back: int | None = None):
        self.folder = Path(folder)
        self.keep_last, self.save_every, self.keep_back = keep_last, save_every, keep_back
        self.pruned: list[int] = []
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(".tmp-*"):
            stale.unlink(missing_ok=True)
        self._drop_unreferenced_shards()
        self.best_loss = None
        if (self.folder / BEST).exists():
            try:
                self.best_loss = read_meta(self.folder / BEST).get("val_loss")
            except CheckpointError as e:
                progress(f"ignoring best checkpoint {e}")

    def should_save(self, step: int) -> bool:
        return self.save_every > 0 and step > 0 and step % self.save_every == 0

    def save(self, step: int, tree: Any, extra: dict | None = None, val_loss: float | None = None,
             final: bool = False, stopped: str | None = None) -> Path:
        """Write ``step_{step}.msgpack``; link it as ``best`` (a lower ``val_loss``), ``final`` (``final``) or,
        with ``stopped`` (why the run stopped without finishing, stored in the file), as ``stopped.msgpack``.
        Any other save unlinks an earlier ``stopped.msgpack``: the run goes on from somewhere else."""
        path = self.folder / f"step_{step:09d}.msgpack"
        extra = dict(extra or {})
        if val_loss is not None:
            extra["val_loss"] = float(val_loss)
        if stopped is not None:
            extra["stopped"] = stopped
        save(path, tree, step=step, extra=extra)
        with _saving(path):
            if val_loss is not None and math.isfinite(val_loss) and (self.best_loss is None or val_loss < self.best_loss):
                publish_file(path, self.folder / BEST)
                self.best_loss = float(val_loss)
            if final:
                publish_file(path, self.folder / FINAL)
            if stopped is not None:
                publish_file(path, self.folder / STOPPED)
            else:
                (self.folder / STOPPED).unlink(missing_ok=True)
        if self.keep_last > 0:
            self._prune(step, path)
        self._drop_unreferenced_shards()
        return path

    def _drop_unreferenced_shards(self) -> None:
        """Delete the shard files (``core.io.checkpoint_shards``) no checkpoint here names: a pruned step's, a
        best one's replaced, or those of a save killed before its index."""
        shards.drop_unreferenced(self.folder, [*(p for _, p in _step_files(self.folder)),
                                               *(self.folder / n for n in (BEST, FINAL, STOPPED))])

    def _prune(self, step: int, path: Path) -> None:
        """Delete all but the last ``keep_last`` step files, never ``path`` (after resuming from an older
        step, what was just written) nor, with ``keep_back``, the newest at or before ``step - keep_back``."""
        files = _step_files(self.folder)
        spared = {path}
        if self.keep_back is not None:
            spared.update([p for s, p in files if s <= step - self.keep_back][-1:])
        for s, old in files[:-self.keep_last]:
            if old not in spared:
                old.unlink(missing_ok=True)
                self.pruned.append(s)

    def step_files(self) -> list[tuple[int, Path]]:
        """The step files in the folder as ``(step, path)``, oldest first (by the step in the name)."""
        return _step_files(self.folder)

    def latest(self) -> Path | None:
        return latest(self.folder)

    def best(self) -> Path | None:
        p = self.folder / BEST
        return p if p.exists() else None


def stopped_run(folder) -> RunStopped | None:
    """What to tell the user when ``folder`` holds a run that stopped without finishing (a ``stopped.msgpack``):
    the step, the reason and the ways on; None for any other folder."""
    path = Path(folder) / STOPPED if folder is not None else None
    if path is None or not path.exists():
        return None
    try:
        meta = read_meta(path)
        why, state = (f": {meta['stopped']}" if meta.get("stopped") else ""), f"its last state (step {meta['step']})"
    except CheckpointError:
        why, state = "", "its last state"
    return RunStopped(f"{folder} holds a run that stopped without finishing{why}. Rerunning would repeat it: start "
                      f"a new run with another out= (e.g. a lower lr), or continue from {state} on purpose with "
                      f"resume={path}")


def resolve_resume(resume: str, folder) -> Path | None:
    """``resume=auto`` -> the latest good checkpoint in ``folder`` (or None); ``never`` -> None;
    anything else is a checkpoint file (or a folder of them) that must exist and be readable.
    ``resume=auto`` on the folder of a run that stopped without finishing raises ``core.exits.RunStopped``
    (``stopped_run``): such a run is not resumed as if it were fine."""
    if resume == "never":
        return None
    if resume == "auto":
        if (stopped := stopped_run(folder)) is not None:
            raise stopped
        found = latest(folder)
        if found is None and folder is not None and Path(folder).is_dir() and _candidates(Path(folder)):
            raise CheckpointError(f"{folder}: resume=auto found checkpoints here but none is good (listed above), "
                                  f"and will not start over on top of them; resume from a good copy with "
                                  f"resume=PATH, start a new run with resume=never and another out=, or delete "
                                  f"the damaged files")
        return found
    p = Path(resume)
    if p.is_dir():
        found = latest(p)
        if found is None:
            raise CheckpointError(f"{p}: no good checkpoint in this folder")
        return found
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint (use resume=auto, resume=never or a file path)")
    if CHECKSUMS in read(p, state="skip"):
        read(p, state="check")
    return p
