"""Per-tensor CRC-32s of a checkpoint (``zlib.crc32``, the checksum of zlib/gzip, RFC 1952), computed
on one worker thread so that the CRC of one piece overlaps the write or read of the next: ``zlib.crc32``
releases the GIL for buffers above 5 KiB, as file ``write`` and ``readinto`` do. Where the CRCs sit in
the file is ``core.io.checkpoint_format``'s business (the reserved top-level key ``"checksums"``).
"""
from __future__ import annotations

import zlib
from concurrent.futures import Future, ThreadPoolExecutor


class Checksums:
    """``zlib.crc32`` of each tensor's bytes, keyed by its path (a tuple of keys), fed piece by piece.

    Pieces of 64 KiB and more go to one worker thread (in order, so a tensor's CRC chains across its
    pieces) while the caller writes or reads the next; smaller ones are done at once when the worker is
    idle. ``threaded=False`` does everything at once (for a reused scratch buffer)."""

    def __init__(self, threaded: bool = True):
        self.crcs: dict[tuple, int] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="crc32") if threaded else None
        self.last: Future | None = None

    def add(self, path: tuple, data: memoryview) -> None:
        if self.pool is None or (len(data) < 1 << 16 and (self.last is None or self.last.done())):
            self.update(path, data)
        else:
            self.last = self.pool.submit(self.update, path, data)

    def update(self, path: tuple, data: memoryview) -> None:
        self.crcs[path] = zlib.crc32(data, self.crcs.get(path, 0))

    def busy(self) -> bool:
        return self.last is not None and not self.last.done()

    def wait(self) -> dict[tuple, int]:
        """Every CRC so far (re-raising a worker's error)."""
        if self.last is not None:
            self.last.result()
        return self.crcs

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def tree(self) -> dict:
        """The CRCs as nested maps, ``{"state": {"params": {"embed": crc, ..}}, ..}``."""
        out: dict = {}
        for path, crc in self.wait().items():
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = crc
        return out


def _flat(tree, path: tuple = ()) -> dict[tuple, int] | str:
    """A :meth:`Checksums.tree` as ``{path: crc}``, or what is wrong with it."""
    if isinstance(tree, int) and not isinstance(tree, bool) and 0 <= tree < 1 << 32 and path:
        return {path: tree}
    if not isinstance(tree, dict):
        return f"the checksums hold a {type(tree).__name__} at {'.'.join(map(str, path)) or 'the top'}"
    out: dict[tuple, int] = {}
    for key, value in tree.items():
        flat = _flat(value, path + (key,))
        if isinstance(flat, str):
            return flat
        out |= flat
    return out


def check_checksums(stored, found: dict[tuple, int], skipped: tuple = ()) -> str | None:
    """What is wrong when the ``stored`` tree is compared with the CRCs ``found`` while reading (None:
    they agree); stored paths under a top-level key in ``skipped`` were not read and are not looked at."""
    expected = _flat(stored)
    if isinstance(expected, str):
        return expected
    for path, crc in found.items():
        name = ".".join(map(str, path))
        if path not in expected:
            return f"tensor {name} has no checksum"
        if expected[path] != crc:
            return f"checksum mismatch in tensor {name}: its bytes changed after the save"
    for path in expected:
        if path not in found and path[0] not in skipped:
            return f"a checksum for {'.'.join(map(str, path))}, which holds no tensor"
    return None
