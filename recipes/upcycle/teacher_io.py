"""The teacher's block inputs and targets for the upcycle recipe's blockwise phase: recomputed per batch, or cached
once on disk by data cursor.

:class:`TeacherSource` gives training batch number ``cursor`` with the teacher's block I/O
(``models.blockwise.teacher_io``, under ``no_grad``). With ``blockwise.cache_teacher=true`` it reads them from
:class:`BlockIOCache`: a bf16 memmap of ``cache_batches`` entries where entry i is the teacher's I/O on training
batch number i (the data cursor, not ``id(x)``), built atomically by ``core.io.cache.build_folder``, shared by
every run with the same teacher, data, seed and shapes, and cycled by ``cursor % cache_batches``.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from purestep.core.data.text import cache_root
from purestep.core.io import cache
from purestep.core.io.logging import format_duration
from purestep.models import blockwise


class TeacherSource:
    """Training batch number ``cursor`` with the teacher's block inputs and targets (``match``)."""

    def __init__(self, teacher_params, tcfg, batches, cache: Optional["BlockIOCache"] = None, match: str = "block"):
        self.teacher_params, self.tcfg, self.batches, self.cache = teacher_params, tcfg, batches, cache
        self.match = match

    def get(self, cursor: int) -> dict:
        if self.cache is None:
            x = self.batches.get(cursor)["x"]
            inputs, targets = blockwise.teacher_io(self.teacher_params, self.tcfg, x, self.match)
            return {"x": x, "inputs": inputs, "targets": targets}
        i = cursor % self.cache.n
        inputs, targets = self.cache.get(i, self.batches.device)
        return {"x": self.batches.get(i)["x"], "inputs": inputs, "targets": targets}


class BlockIOCache:
    """A bf16 memmap of the teacher's block inputs and targets for training batches 0..n-1.

    ``<root>/<key>/`` holds ``inputs.bin``, ``targets.bin`` ([n, L, B, T, d] bf16 stored as int16) and
    ``meta.json``; the key hashes everything the contents depend on. Written by ``core.io.cache.build_folder``
    (a temporary folder renamed into place), so a killed build never leaves a cache that is later trusted.
    """
    VERSION = 1

    def __init__(self, folder: Path, meta: dict, arrays: dict):
        self.folder, self.meta, self.n = folder, meta, meta["n"]
        self.inputs, self.targets = arrays["inputs"], arrays["targets"]

    @staticmethod
    def layout(meta: dict) -> dict:
        if meta["version"] != BlockIOCache.VERSION:
            raise ValueError(f"version {meta['version']}")
        return {name: ("int16", meta["shape"]) for name in ("inputs", "targets")}

    @property
    def nbytes(self) -> int:
        return self.inputs.nbytes + self.targets.nbytes

    def get(self, i: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        def load(a):
            return torch.from_numpy(np.array(a[i])).view(torch.bfloat16).to(device=device, dtype=torch.float32)
        return load(self.inputs), load(self.targets)

    @classmethod
    def open_or_build(cls, source: TeacherSource, n: int, identity: dict, root: Optional[Path] = None,
                      say=print) -> "BlockIOCache":
        root = Path(root or cache_root("teacher"))
        identity = {**identity, "target": source.match}
        key = hashlib.sha256(json.dumps({**identity, "n": n, "version": cls.VERSION}, sort_keys=True)
                             .encode()).hexdigest()[:20]
        folder = root / key
        found = cache.open_folder(folder, cls.layout)
        if found is not None:
            opened = cls(folder, *found)
            say(f"teacher cache: reusing {folder} ({opened.nbytes / 2**30:.2f} GiB, {n} batches)")
            return opened
        cache.build_folder(folder, lambda builder: _build_block_io(builder, source, n, identity, folder, say),
                           keep=lambda f: cache.open_folder(f, cls.layout) is not None)
        return cls(folder, *cache.read_folder(folder, cls.layout))


def _build_block_io(builder, source: TeacherSource, n: int, identity: dict, folder: Path, say) -> dict:
    """Teacher block I/O of batches 0..n-1 into ``inputs.bin`` / ``targets.bin``; returns the meta."""
    start, last = time.perf_counter(), 0.0
    first = source.get(0)
    shape = (n, *first["inputs"].shape)
    nbytes = 2 * math.prod(shape) * 2
    say(f"teacher cache: building {n} batches x 2 x {list(shape[1:])} bf16 = {nbytes / 2**30:.2f} GiB in {folder}")
    files = {name: builder.array(name, np.int16, shape) for name in ("inputs", "targets")}
    for i in range(n):
        batch = first if i == 0 else source.get(i)
        for name, arr in files.items():
            arr[i] = batch[name].to("cpu", torch.bfloat16).view(torch.int16).numpy()
        now = time.perf_counter()
        if now - last > 10 or i == n - 1:
            last = now
            say(f"teacher cache: {i + 1}/{n} batches, {format_duration(now - start)}")
    return {**identity, "n": n, "shape": list(shape), "dtype": "bfloat16", "version": BlockIOCache.VERSION}
