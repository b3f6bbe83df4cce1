"""The checkpoint wire format: Flax-compatible msgpack, streamed in both directions.

A checkpoint is one msgpack map
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

:class:`Writer` streams: headers go through the file's buffer and each tensor's own memory goes straight
to the file (no bytes object of the whole file, no second copy of a CPU tensor; a device tensor is copied
to the host one at a time). :func:`read` parses the msgpack framing itself (a few hundred small objects)
and ``readinto``s every tensor's bytes straight into its own freshly allocated tensor: one copy from the
page cache, nothing else. A file whose framing does not end exactly at its last byte is truncated or
corrupt and raises :class:`CheckpointError`. Where the file goes and how it appears atomically is
``core.checkpoint``'s business.
"""
from __future__ import annotations

import math
import os
import struct
from pathlib import Path
from typing import Any

import msgpack
import torch

from core.config import UserError

FORMAT = "purestep-checkpoint-1"
MAX_CHUNK_SIZE = 2 ** 30          # bytes; flax.serialization.MAX_CHUNK_SIZE
CHUNKED = "__msgpack_chunked_array__"

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


class Writer:
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


def read(path, device=None, skip_state: bool = False) -> dict:
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
