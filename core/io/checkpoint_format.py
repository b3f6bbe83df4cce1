"""The checkpoint wire format: Flax-compatible msgpack, streamed in both directions, with per-tensor CRC-32s.

A checkpoint is one msgpack map ``{"format": "purestep-checkpoint-1", "step": int, "state": <state dict>,
**extra, "checksums": {..}}``; the state dict is Flax's ``to_state_dict`` of the train state (str-keyed
maps: NamedTuples by field name, tuples and lists as ``{"0": .., "1": ..}``) and every tensor a msgpack
ext of type 1 holding ``packb((shape, dtype_name, C-order bytes))``, exactly as ``flax.serialization``
writes arrays (``serialization.py`` @18f8f31: ``_MsgpackExtType``, ``_ndarray_to_bytes``, ``_chunk``):
bf16 stays bf16, 0-d tensors stay arrays of shape ``[]``, and an array above ``MAX_CHUNK_SIZE`` bytes
becomes ``{"__msgpack_chunked_array__": True, "shape": {"0": d0, ..}, "chunks": {"0": flat_chunk, ..}}``.
A Python complex is Flax's ext type 2 (``packb((real, imag))``); Flax's numpy scalars (ext type 3, an
array of shape ``[]``) read back as 0-d tensors. So ``flax.serialization.msgpack_restore`` opens a
checkpoint (``msgpack_serialize(.., in_place=True)`` of the same map gives the same bytes), and one
written back by Flax, even key-sorted, opens here.

``"checksums"``, written last, is a reserved top-level key: the nesting of the tensors it covers
(``{"state": {"params": {"embed": crc, ..}}, ..}``, a chunked array holding one) with ``zlib.crc32`` of
each tensor's C-order bytes (all its chunks) as the leaf (``core.io.checkpoint_checksums``). :func:`read`
checks every tensor it reads against it and strips it; a mismatch is corrupt, like a truncation; a file
without it (older, or Flax's) loads unchecked.

:class:`Writer` streams: headers go through the file's buffer, each tensor's own memory straight to the file (no
bytes object of the whole file, no second copy of a CPU tensor; device tensors reach the host one at a time).
:func:`read` parses the msgpack framing itself and ``readinto``s every tensor's bytes straight into its own fresh
tensor (one copy from the page cache), after checking every size the file claims (a string's, an array's, a chunked
array's shape) against the bytes left in it. A file whose framing does not end exactly at its last byte is
truncated or corrupt (:class:`CheckpointError`). Where the file goes and how it appears atomically: core.io.checkpoint.
"""
from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import msgpack
import torch

from purestep.core.io.checkpoint_checksums import Checksums, check_checksums
from purestep.core.config import UserError

FORMAT = "purestep-checkpoint-1"
MAX_CHUNK_SIZE = 2 ** 30          # bytes; flax.serialization.MAX_CHUNK_SIZE
CHUNKED = "__msgpack_chunked_array__"

DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint64": torch.uint64, "uint32": torch.uint32, "uint16": torch.uint16, "uint8": torch.uint8,
    "bool": torch.bool, "complex64": torch.complex64, "complex128": torch.complex128,
}
CHECKSUMS = "checksums"
_ARRAY, _COMPLEX, _NPSCALAR = 1, 2, 3   # flax.serialization._MsgpackExtType
_PIECE = 8 << 20                         # bytes read (and CRC'd) at a time
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class CheckpointError(UserError):
    """A checkpoint that cannot be read or does not fit its template; the message says where and why
    (a ``core.config.UserError``: the CLI prints it as one line and exits 2)."""


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
    """Streams msgpack values to ``f``, feeding every tensor's bytes to :attr:`checksums` as it goes."""

    def __init__(self, f, checksums: Checksums):
        self.f, self.checksums = f, checksums
        self.pack = msgpack.Packer(use_bin_type=True, autoreset=True)

    def checkpoint(self, top: dict) -> None:
        """``top`` (without the reserved :data:`CHECKSUMS`) as one map, then the CRCs of its tensors."""
        self.f.write(self.pack.pack_map_header(len(top) + 1))
        for k, v in top.items():
            self.f.write(self.pack.pack(k))
            self.value(v, (k,))
        if self.checksums.busy():  # let the disk take the tensors while the last CRCs finish
            self.f.flush()
            os.fsync(self.f.fileno())
        self.f.write(self.pack.pack(CHECKSUMS))
        self.value(self.checksums.tree(), (CHECKSUMS,))

    def value(self, x, path: tuple) -> None:
        if isinstance(x, torch.Tensor) or callable(x):   # callable: core.io.checkpoint.Deferred, made when written
            self.tensor(x() if callable(x) else x, path)
        elif isinstance(x, dict):
            self.f.write(self.pack.pack_map_header(len(x)))
            for k, v in x.items():
                if not isinstance(k, str):
                    raise TypeError(f"{'.'.join(path)}: dict key {k!r} is not a str")
                self.f.write(self.pack.pack(k))
                self.value(v, path + (k,))
        elif isinstance(x, (list, tuple)):  # only in caller extras; the state went through to_state_dict
            self.f.write(self.pack.pack_array_header(len(x)))
            for i, v in enumerate(x):
                self.value(v, path + (str(i),))
        elif isinstance(x, complex):
            payload = self.pack.pack((x.real, x.imag))
            self.f.write(_ext_header(len(payload), _COMPLEX) + payload)
        elif x is None or isinstance(x, (bool, int, float, str, bytes)):
            self.f.write(self.pack.pack(x))
        else:
            raise TypeError(f"{'.'.join(path)}: cannot checkpoint a value of type {type(x).__name__}")

    def tensor(self, t: torch.Tensor, path: tuple) -> None:
        if t.dtype not in _NAMES:
            raise TypeError(f"{'.'.join(path)}: dtype {t.dtype} is not supported (one of {', '.join(DTYPES)})")
        on_host = t.device.type == "cpu"
        t = t.detach().to("cpu").contiguous()  # no-ops for a contiguous CPU tensor
        if t.numel() * t.element_size() <= MAX_CHUNK_SIZE:
            self.array(t, path)
        else:
            chunk = max(1, MAX_CHUNK_SIZE // t.element_size())
            flat = t.reshape(-1)
            pieces = range(0, flat.numel(), chunk)
            self.f.write(self.pack.pack_map_header(3) + self.pack.pack(CHUNKED) + self.pack.pack(True)
                         + self.pack.pack("shape") + self.pack.pack({str(i): d for i, d in enumerate(t.shape)})
                         + self.pack.pack("chunks") + self.pack.pack_map_header(len(pieces)))
            for i, start in enumerate(pieces):
                self.f.write(self.pack.pack(str(i)))
                self.array(flat[start:start + chunk], path)
        if not on_host:
            self.checksums.wait()  # the host copy may go: one device tensor on the host at a time

    def array(self, t: torch.Tensor, path: tuple) -> None:
        nbytes = t.numel() * t.element_size()
        head = (self.pack.pack_array_header(3) + self.pack.pack(list(t.shape)) + self.pack.pack(_NAMES[t.dtype])
                + _bin_header(nbytes))
        self.f.write(_ext_header(len(head) + nbytes) + head)
        data = _raw(t)
        self.checksums.add(path, data)
        _write_bytes(self.f, data)


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
    """A msgpack decoder over a file that reads array bytes straight into tensors (or seeks past them),
    feeding them to ``checksums``. With a ``scratch`` buffer it keeps no tensor: each is read through
    the buffer for its CRC and becomes None. A ``path`` of None reads a tensor without a CRC."""

    def __init__(self, f, size: int, checksums: Checksums, device=None, scratch: memoryview | None = None):
        self.f, self.size, self.pos, self.device = f, size, 0, device
        self.checksums, self.scratch = checksums, scratch

    def take(self, n: int) -> bytes:
        data = self.f.read(n) if n <= self.size - self.pos else b""   # a read of n bytes allocates n bytes first
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

    def value(self, skip: bool = False, path: tuple | None = None):
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
            return [self.value(skip, _child(path, str(i))) for i in range(n)]
        if kind == "map":
            return self.map(n, skip, path)
        return self.ext(n, skip, path)

    def key(self):
        key = self.value()
        if isinstance(key, (list, dict, torch.Tensor)):
            raise _Corrupt(f"a map key before offset {self.pos} is not a scalar")
        return key

    def map(self, n: int, skip: bool, path: tuple | None):
        out = {}
        for i in range(n):
            key = self.key()
            if i == 0 and key == CHUNKED and not skip:
                return self.chunked(n - 1, path)
            out[key] = self.value(skip, _child(path, key))
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

    def ext(self, length: int, skip: bool, path: tuple | None):
        at = self.pos
        code = self.unpack(">b")
        if code == _COMPLEX:
            return self.complex(length, at)
        if code not in (_ARRAY, _NPSCALAR):
            raise _Corrupt(f"unsupported msgpack ext type {code} before offset {self.pos}")
        shape, dtype, nbytes = self.array_header(length)
        if code == _NPSCALAR and shape:
            raise _Corrupt(f"numpy scalar at offset {at} has shape {shape}")
        if skip:
            self.f.seek(nbytes, os.SEEK_CUR)
            self.pos += nbytes
            return None
        if self.scratch is not None and path is not None:
            self.read_through_scratch(nbytes, path)
            return None
        t = torch.empty(shape, dtype=dtype)
        self.read_into(_raw(t), path)
        return t if self.device is None else t.to(self.device)

    def complex(self, length: int, at: int) -> complex:
        """Flax's ext type 2: a Python complex as ``packb((real, imag))``."""
        data = self.take(length)
        try:
            pair = msgpack.unpackb(data)
        except Exception:  # whatever a damaged payload makes msgpack raise
            pair = None
        if not (isinstance(pair, list) and len(pair) == 2 and all(type(x) in (int, float) for x in pair)):
            raise _Corrupt(f"complex number at offset {at} is not [real, imag]")
        return complex(*pair)

    def read_into(self, view: memoryview, path: tuple | None) -> None:
        """Fill ``view`` from the file a piece at a time, each piece's CRC overlapping the next read."""
        if path is not None and not len(view):
            self.checksums.add(path, view)  # an empty tensor has a CRC too (0)
        done = 0
        while done < len(view):
            piece = view[done:done + _PIECE]
            got = 0
            while got < len(piece):
                n = self.f.readinto(piece[got:])
                if not n:
                    raise _Truncated
                got += n
            if path is not None:
                self.checksums.add(path, piece)
            done += got
        self.pos += done

    def read_through_scratch(self, nbytes: int, path: tuple) -> None:
        self.read_into(self.scratch[:0], path)
        while nbytes:
            n = min(nbytes, len(self.scratch))
            self.read_into(self.scratch[:n], path)
            nbytes -= n

    def chunked(self, rest: int, path: tuple | None) -> torch.Tensor | None:
        """Flax's chunked array ``{flag, shape, chunks}``. With the shape first (as we and Flax write it)
        the chunks are read straight into one tensor; a key-sorted map (chunks first) is concatenated."""
        at = self.pos
        flag, parts, streamed = self.value(), {}, False
        for _ in range(rest):
            key = self.key()
            shape = parts.get("shape")
            if key == "chunks" and isinstance(shape, dict) and all(_is_dim(d) for d in shape.values()):
                parts[key], streamed = self.chunks_into(math.prod(shape.values()), at, path), True
            else:
                parts[key] = self.value(path=None)
        shape, chunks = parts.get("shape"), parts.get("chunks")
        if flag is not True or set(parts) != {"shape", "chunks"} or not isinstance(shape, dict) or \
                not all(_is_dim(d) for d in shape.values()):
            raise _Corrupt(f"chunked array at offset {at} is not {{flag, shape, chunks}}")
        if streamed and chunks is None:  # read through the scratch buffer
            return None
        if isinstance(chunks, dict):
            pieces = [chunks.get(str(i)) for i in range(len(chunks))]
            if not pieces or not all(isinstance(p, torch.Tensor) and p.dim() == 1 for p in pieces):
                raise _Corrupt(f"chunks of the array at offset {at} are not flat arrays")
            chunks = torch.cat(pieces)
            if path is not None:
                self.checksums.add(path, _raw(chunks))
        if not isinstance(chunks, torch.Tensor) or chunks.numel() != math.prod(shape.values()):
            raise _Corrupt(f"chunks of the array at offset {at} do not fill shape {list(shape.values())}")
        t = chunks.reshape(list(shape.values()))
        return t if self.device is None else t.to(self.device)

    def chunks_into(self, total: int, at: int, path: tuple | None) -> torch.Tensor | None:
        """A chunk map ``{"0": flat, ..}`` read into one flat tensor of ``total`` elements (None: through scratch)."""
        kind, n = self.header()
        if kind != "map":
            raise _Corrupt(f"chunked array at offset {at} has no chunk map")
        flat, dtype, offset = None, None, 0
        for i in range(n):
            key = self.key()
            kind, length = self.header()
            if key != str(i) or kind != "ext" or self.unpack(">b") != 1:
                raise _Corrupt(f"chunk {key!r} of the array at offset {at} is not array number {i}")
            piece, piece_dtype, nbytes = self.array_header(length)
            dtype = piece_dtype if dtype is None else dtype
            if piece_dtype != dtype or len(piece) != 1 or offset + piece[0] > total:
                raise _Corrupt(f"chunks of the array at offset {at} do not fit its shape")
            if (total - offset) * dtype.itemsize > self.size - self.pos:
                raise _Truncated
            if self.scratch is not None and path is not None:
                self.read_through_scratch(nbytes, path)
            else:
                flat = torch.empty(total, dtype=dtype) if flat is None else flat
                self.read_into(_raw(flat[offset:offset + piece[0]]), path)
            offset += piece[0]
        if dtype is None or offset != total:
            raise _Corrupt(f"chunks of the array at offset {at} do not fill its shape")
        return flat


def _child(path: tuple | None, key) -> tuple | None:
    return None if path is None else path + (key,)


def read(path, device=None, state: str = "load") -> dict:
    """Decode a whole checkpoint with clear errors, checking every tensor read against its CRC.

    ``state``: ``"load"`` reads it; ``"skip"`` seeks past its tensors (None in their place) and leaves
    :data:`CHECKSUMS` in the result; ``"check"`` reads its tensors through a small buffer for their CRCs
    and keeps none (None in their place).
    """
    path = Path(path)
    try:
        f = open(path, "rb", buffering=1 << 16)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
    checksums = Checksums(threaded=state == "load")
    scratch = memoryview(bytearray(_PIECE)) if state == "check" else None
    with f:
        size = os.fstat(f.fileno()).st_size
        reader = _Reader(f, size, checksums, device, scratch)
        try:
            if size == 0:
                raise _Truncated
            kind, n = reader.header()
            if kind != "map":
                raise CheckpointError(f"{path}: not a purestep checkpoint (it does not hold a msgpack map)")
            top = {}
            for _ in range(n):  # ours writes "format" first; Flax's msgpack_serialize may sort the keys
                key = reader.key()
                top[key] = reader.value(skip=state == "skip" and key == "state", path=(key,))
            if reader.pos != size:
                raise _Corrupt(f"{size - reader.pos} unexpected bytes after the end of the checkpoint")
            if CHECKSUMS in top:
                problem = check_checksums(top[CHECKSUMS], checksums.wait(), ("state",) if state == "skip" else ())
                if problem:
                    raise _Corrupt(problem)
                if state != "skip":
                    del top[CHECKSUMS]
        except _Truncated:
            why = "empty file" if size == 0 else f"truncated: the file ends at byte {size}, inside the checkpoint"
            raise CheckpointError(f"{path}: {why} (an interrupted write or copy?)") from None
        except (_Corrupt, RecursionError) as e:
            why = e if isinstance(e, _Corrupt) else "containers nested too deeply"
            raise CheckpointError(f"{path}: corrupt ({why})") from None
        finally:
            checksums.close()
    if top.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a purestep checkpoint (format {top.get('format')!r}, expected {FORMAT!r})")
    if not isinstance(top.get("step"), int) or "state" not in top:
        raise CheckpointError(f"{path}: corrupt (no integer 'step' or no 'state' entry)")
    return top

