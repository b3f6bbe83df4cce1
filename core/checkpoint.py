"""Atomic, streamed msgpack checkpoints in Flax's wire format.

One file per checkpoint. The top level is a map
``{"format": "purestep-checkpoint-1", "step": int, "state": <state dict>, **extra}`` where the state
dict is Flax's ``to_state_dict`` of the train state (str-keyed maps only: NamedTuples by field name,
tuples and lists as ``{"0": .., "1": ..}``) and every tensor is a msgpack ext of type 1 holding
``packb((shape, dtype_name, C-order bytes))``, exactly as ``flax.serialization`` writes arrays
(flax ``serialization.py`` @18f8f31: ``_MsgpackExtType.ndarray``, ``_ndarray_to_bytes``, ``_chunk``):
bf16 stays bf16 (name ``"bfloat16"``), 0-d tensors stay arrays of shape ``[]`` so their dtype survives,
and an array above ``MAX_CHUNK_SIZE`` bytes becomes ``{"__msgpack_chunked_array__": True, "shape":
{"0": d0, ..}, "chunks": {"0": flat_chunk, ..}}``. So a checkpoint also opens with
``flax.serialization.msgpack_restore`` (``msgpack_serialize(.., in_place=True)`` of the same state dict
gives the same bytes), and one written back by Flax, even key-sorted, opens here.

Writing streams: headers go through a small buffer and each tensor's own memory goes straight to the
file (no bytes object of the whole file, no second copy of a CPU tensor; a device tensor is copied to the
host one at a time). The file appears atomically (Orbax ``AtomicRenameTemporaryPath``, reduced to one
file): ``mkstemp(dir=folder, prefix=".tmp-")``, write, flush, fsync, ``os.replace``, fsync the folder; the
temp file is unlinked on any error, and a SIGKILL leaves at most a stale ``.tmp-*`` that discovery ignores
and :class:`CheckpointManager` cleans up. Reading parses the msgpack framing itself (a few hundred small
objects) and ``readinto``s every tensor's bytes straight into its own freshly allocated tensor: one copy
from the page cache, nothing else. A file whose framing does not end exactly at its last byte is
truncated or corrupt and raises :class:`CheckpointError`, which is how discovery skips a bad newest file.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import struct
import tempfile
import warnings
from pathlib import Path
from typing import Any

import msgpack
import torch

from core.config import UserError

FORMAT = "purestep-checkpoint-1"
MAX_CHUNK_SIZE = 2 ** 30          # bytes; flax.serialization.MAX_CHUNK_SIZE
CHUNKED = "__msgpack_chunked_array__"
_BUFFER = 1 << 20                 # file buffer for headers and small tensors

DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class CheckpointError(UserError):
    """A checkpoint that cannot be read or does not fit its template; the message says where and why
    (a ``core.config.UserError``: the CLI prints it as one line and exits 2)."""


# ----------------------------------------------------------------------------- state dicts (flax)

def _is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def to_state_dict(tree: Any, path: str = "state") -> Any:
    """Flax ``to_state_dict``: containers become str-keyed dicts; tensors and Python scalars stay."""
    if isinstance(tree, torch.Tensor) or tree is None or isinstance(tree, (bool, int, float, str, bytes)):
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
    if template is None or isinstance(template, (bool, int, float, str, bytes)):
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


# ----------------------------------------------------------------------------- writing

def _ext_header(n: int, code: int = 1) -> bytes:
    """msgpack ext header for an ``n``-byte payload (fixext / ext8 / ext16 / ext32)."""
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    if n in fixed:
        return struct.pack(">Bb", fixed[n], code)
    if n < 1 << 8:
        return struct.pack(">BBb", 0xC7, n, code)
    if n < 1 << 16:
        return struct.pack(">BHb", 0xC8, n, code)
    return struct.pack(">BIb", 0xC9, n, code)


def _bin_header(n: int) -> bytes:
    if n < 1 << 8:
        return struct.pack(">BB", 0xC4, n)
    if n < 1 << 16:
        return struct.pack(">BH", 0xC5, n)
    return struct.pack(">BI", 0xC6, n)


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (bf16 and bool included)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _write_bytes(f, data: memoryview) -> None:
    f.write(data)


class _Writer:
    def __init__(self, f):
        self.f = f
        self.pack = msgpack.Packer(use_bin_type=True, autoreset=True)

    def value(self, x, path: str) -> None:
        if isinstance(x, torch.Tensor):
            self.tensor(x, path)
        elif isinstance(x, dict):
            self.f.write(self.pack.pack_map_header(len(x)))
            for k, v in x.items():
                if not isinstance(k, str):
                    raise TypeError(f"{path}: dict key {k!r} is not a str")
                self.f.write(self.pack.pack(k))
                self.value(v, f"{path}.{k}" if path else k)
        elif isinstance(x, (list, tuple)):  # only in caller extras; the state went through to_state_dict
            self.f.write(self.pack.pack_array_header(len(x)))
            for i, v in enumerate(x):
                self.value(v, f"{path}.{i}")
        elif x is None or isinstance(x, (bool, int, float, str, bytes)):
            self.f.write(self.pack.pack(x))
        else:
            raise TypeError(f"{path}: cannot checkpoint a value of type {type(x).__name__}")

    def tensor(self, t: torch.Tensor, path: str) -> None:
        if t.dtype not in _NAMES:
            raise TypeError(f"{path}: dtype {t.dtype} is not supported (one of {', '.join(DTYPES)})")
        t = t.detach().to("cpu").contiguous()  # no-ops for a contiguous CPU tensor
        if t.numel() * t.element_size() <= MAX_CHUNK_SIZE:
            return self.array(t)
        chunk = max(1, MAX_CHUNK_SIZE // t.element_size())
        flat = t.reshape(-1)
        pieces = range(0, flat.numel(), chunk)
        self.f.write(self.pack.pack_map_header(3) + self.pack.pack(CHUNKED) + self.pack.pack(True)
                     + self.pack.pack("shape") + self.pack.pack({str(i): d for i, d in enumerate(t.shape)})
                     + self.pack.pack("chunks") + self.pack.pack_map_header(len(pieces)))
        for i, start in enumerate(pieces):
            self.f.write(self.pack.pack(str(i)))
            self.array(flat[start:start + chunk])

    def array(self, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        head = (self.pack.pack_array_header(3) + self.pack.pack(list(t.shape)) + self.pack.pack(_NAMES[t.dtype])
                + _bin_header(nbytes))
        self.f.write(_ext_header(len(head) + nbytes) + head)
        _write_bytes(self.f, _raw(t))


def fsync_path(folder) -> None:
    """fsync a file or a folder by path (a folder's fsync makes a rename in it durable)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    umask = os.umask(0)  # the only way to read it; done once, at import
    os.umask(umask)
    return umask


_FILE_MODE = 0o666 & ~_umask()  # what open() would give; mkstemp's 0600 would hide checkpoints from a group


def save(path, tree: Any, *, step: int, extra: dict | None = None) -> int:
    """Write ``tree`` (any pytree of tensors, NamedTuples, tuples, dicts, scalars) atomically to ``path``.

    ``extra`` adds top-level entries (config, tokenizer, meta: dicts, lists, scalars, tensors).
    Returns the number of bytes written.
    """
    path = Path(path)
    top = {"format": FORMAT, "step": int(step), "state": to_state_dict(tree)}
    for key, value in (extra or {}).items():
        if key in top:
            raise ValueError(f"extra key {key!r} is reserved")
        top[key] = value
    folder = path.parent
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=f"-{path.name}")
    try:
        os.fchmod(fd, _FILE_MODE)
        with open(fd, "wb", buffering=_BUFFER) as f:
            _Writer(f).value(top, "")
            f.flush()
            os.fsync(f.fileno())
            nbytes = f.tell()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_path(folder)
    return nbytes


# ----------------------------------------------------------------------------- reading

class _Truncated(Exception):
    pass


class _Corrupt(Exception):
    pass


_SCALARS = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
            0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
_SIZED = {0xC4: ("bin", ">B"), 0xC5: ("bin", ">H"), 0xC6: ("bin", ">I"),
          0xD9: ("str", ">B"), 0xDA: ("str", ">H"), 0xDB: ("str", ">I"),
          0xDC: ("array", ">H"), 0xDD: ("array", ">I"), 0xDE: ("map", ">H"), 0xDF: ("map", ">I"),
          0xC7: ("ext", ">B"), 0xC8: ("ext", ">H"), 0xC9: ("ext", ">I")}
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}


def _is_dim(d) -> bool:
    return type(d) is int and 0 <= d < 1 << 62


class _Reader:
    """A msgpack decoder over a file that reads array bytes straight into tensors (or seeks past them)."""

    def __init__(self, f, size: int, device=None):
        self.f, self.size, self.pos, self.device = f, size, 0, device

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise _Truncated
        self.pos += n
        return data

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def header(self):
        """(kind, n) of the next object; n is the value for scalars, the length for the rest."""
        at = self.pos
        tag = self.take(1)[0]
        if tag <= 0x7F:
            return "scalar", tag
        if tag >= 0xE0:
            return "scalar", tag - 0x100
        if tag <= 0x8F:
            return "map", tag & 0x0F
        if tag <= 0x9F:
            return "array", tag & 0x0F
        if tag <= 0xBF:
            return "str", tag & 0x1F
        if tag in (0xC0, 0xC2, 0xC3):
            return "scalar", {0xC0: None, 0xC2: False, 0xC3: True}[tag]
        if tag in _SCALARS:
            return "scalar", self.unpack(_SCALARS[tag])
        if tag in _SIZED:
            kind, fmt = _SIZED[tag]
            return kind, self.unpack(fmt)
        if tag in _FIXEXT:
            return "ext", _FIXEXT[tag]
        raise _Corrupt(f"invalid msgpack byte 0x{tag:02x} at offset {at}")

    def value(self, skip: bool = False):
        kind, n = self.header()
        if kind == "scalar":
            return n
        if kind == "str":
            try:
                return self.take(n).decode()
            except UnicodeDecodeError:
                raise _Corrupt(f"invalid utf-8 string before offset {self.pos}") from None
        if kind == "bin":
            return self.take(n)
        if kind == "array":
            return [self.value(skip) for _ in range(n)]
        if kind == "map":
            return self.map(n, skip)
        return self.ext(n, skip)

    def key(self):
        key = self.value()
        if isinstance(key, (list, dict, torch.Tensor)):
            raise _Corrupt(f"a map key before offset {self.pos} is not a scalar")
        return key

    def map(self, n: int, skip: bool):
        out = {}
        for i in range(n):
            key = self.key()
            if i == 0 and key == CHUNKED and not skip:
                return self.chunked(n - 1)
            out[key] = self.value(skip)
        return out

    def array_header(self, length: int) -> tuple[list, torch.dtype, int]:
        """Parse an ext-1 payload's ``[shape, dtype name, bin header]``; returns (shape, dtype, nbytes)."""
        start = self.pos
        kind, n = self.header()
        if kind != "array" or n != 3:
            raise _Corrupt(f"array payload at offset {start} is not [shape, dtype, bytes]")
        shape, name = self.value(), self.value()
        name = name.decode() if isinstance(name, bytes) else name
        if not isinstance(shape, list) or not all(_is_dim(d) for d in shape):
            raise _Corrupt(f"bad array shape {shape!r} at offset {start}")
        if name not in DTYPES:
            raise _Corrupt(f"unsupported array dtype {name!r} at offset {start}")
        kind, nbytes = self.header()
        dtype = DTYPES[name]
        if kind != "bin" or nbytes != math.prod(shape) * dtype.itemsize or self.pos - start + nbytes != length:
            raise _Corrupt(f"array at offset {start}: byte count does not match shape {shape} {name}")
        if self.pos + nbytes > self.size:
            raise _Truncated
        return shape, dtype, nbytes

    def ext(self, length: int, skip: bool):
        code = self.unpack(">b")
        if code != 1:
            raise _Corrupt(f"unsupported msgpack ext type {code} before offset {self.pos}")
        shape, dtype, nbytes = self.array_header(length)
        if skip:
            self.f.seek(nbytes, os.SEEK_CUR)
            self.pos += nbytes
            return None
        t = torch.empty(shape, dtype=dtype)
        self.read_into(t)
        return t if self.device is None else t.to(self.device)

    def read_into(self, t: torch.Tensor) -> None:
        view = _raw(t)
        done = 0
        while done < len(view):
            got = self.f.readinto(view[done:])
            if not got:
                raise _Truncated
            done += got
        self.pos += done

    def chunked(self, rest: int) -> torch.Tensor:
        """Flax's chunked array ``{flag, shape, chunks}``. With the shape first (as we and Flax write it)
        the chunks are read straight into one tensor; a key-sorted map (chunks first) is concatenated."""
        at = self.pos
        flag, parts = self.value(), {}
        for _ in range(rest):
            key = self.key()
            shape = parts.get("shape")
            if key == "chunks" and isinstance(shape, dict) and all(_is_dim(d) for d in shape.values()):
                parts[key] = self.chunks_into(math.prod(shape.values()), at)
            else:
                parts[key] = self.value()
        shape, chunks = parts.get("shape"), parts.get("chunks")
        if flag is not True or set(parts) != {"shape", "chunks"} or not isinstance(shape, dict) or \
                not all(_is_dim(d) for d in shape.values()):
            raise _Corrupt(f"chunked array at offset {at} is not {{flag, shape, chunks}}")
        if isinstance(chunks, dict):
            pieces = [chunks.get(str(i)) for i in range(len(chunks))]
            if not pieces or not all(isinstance(p, torch.Tensor) and p.dim() == 1 for p in pieces):
                raise _Corrupt(f"chunks of the array at offset {at} are not flat arrays")
            chunks = torch.cat(pieces)
        if not isinstance(chunks, torch.Tensor) or chunks.numel() != math.prod(shape.values()):
            raise _Corrupt(f"chunks of the array at offset {at} do not fill shape {list(shape.values())}")
        t = chunks.reshape(list(shape.values()))
        return t if self.device is None else t.to(self.device)

    def chunks_into(self, total: int, at: int) -> torch.Tensor:
        """Read a chunk map ``{"0": flat, "1": flat, ..}`` into one flat tensor of ``total`` elements."""
        kind, n = self.header()
        if kind != "map":
            raise _Corrupt(f"chunked array at offset {at} has no chunk map")
        flat, offset = None, 0
        for i in range(n):
            key = self.key()
            kind, length = self.header()
            if key != str(i) or kind != "ext" or self.unpack(">b") != 1:
                raise _Corrupt(f"chunk {key!r} of the array at offset {at} is not array number {i}")
            piece, dtype, _ = self.array_header(length)
            flat = torch.empty(total, dtype=dtype) if flat is None else flat
            if dtype != flat.dtype or len(piece) != 1 or offset + piece[0] > total:
                raise _Corrupt(f"chunks of the array at offset {at} do not fit its shape")
            self.read_into(flat[offset:offset + piece[0]])
            offset += piece[0]
        if flat is None or offset != total:
            raise _Corrupt(f"chunks of the array at offset {at} do not fill its shape")
        return flat


def _read(path, device=None, skip_state: bool = False) -> dict:
    """Decode a whole checkpoint (or everything but the state, seeking past it) with clear errors."""
    path = Path(path)
    try:
        f = open(path, "rb", buffering=1 << 16)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        reader = _Reader(f, size, device)
        try:
            if size == 0:
                raise _Truncated
            kind, n = reader.header()
            if kind != "map":
                raise CheckpointError(f"{path}: not a purestep checkpoint (it does not hold a msgpack map)")
            top = {}
            for _ in range(n):  # ours writes "format" first; Flax's msgpack_serialize may sort the keys
                key = reader.key()
                top[key] = reader.value(skip=skip_state and key == "state")
            if reader.pos != size:
                raise _Corrupt(f"{size - reader.pos} unexpected bytes after the end of the checkpoint")
        except _Truncated:
            why = "empty file" if size == 0 else f"truncated: the file ends at byte {size}, inside the checkpoint"
            raise CheckpointError(f"{path}: {why} (an interrupted write or copy?)") from None
        except _Corrupt as e:
            raise CheckpointError(f"{path}: corrupt ({e})") from None
        except RecursionError:
            raise CheckpointError(f"{path}: corrupt (containers nested too deeply)") from None
    if top.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a purestep checkpoint (format {top.get('format')!r}, expected {FORMAT!r})")
    if not isinstance(top.get("step"), int) or "state" not in top:
        raise CheckpointError(f"{path}: corrupt (no integer 'step' or no 'state' entry)")
    return top


def load(path, template: Any = None, device=None) -> dict:
    """Read a checkpoint: the top-level map (format, step, state, extras).

    Without ``template`` the state is nested dicts of tensors and Python values (on ``device`` or the CPU).
    With one (a fresh TrainState, any pytree) the state takes its exact structure, each leaf checked.
    """
    top = _read(path, device)
    if template is not None:
        try:
            top["state"] = from_state_dict(template, top["state"], device=device)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
    return top


def read_meta(path) -> dict:
    """Step and extras of a checkpoint without reading its state (the framing is still fully checked)."""
    top = _read(path, skip_state=True)
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


def _publish(src: Path, dst: Path) -> None:
    """Make ``dst`` an atomic hard link to ``src`` (a durable copy where links are not supported)."""
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
            _publish(path, self.folder / BEST)
            self.best_loss = float(val_loss)
        if final:
            _publish(path, self.folder / FINAL)
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
