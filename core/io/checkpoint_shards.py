"""Sharded checkpoints: every rank writes its own pieces of the state, rank 0 an index, and a load joins them.

A sharded run (``parallel=fsdp``, ``fsdp,tp``, ``hsdp``) with ``checkpoint_shards=true`` saves step ``N`` as:

- ``step_N.shard-I-of-K.msgpack``, one per writing rank (every rank of the first replica), each written by its rank
  at the same time, atomically (``core.io.checkpoint.save``): the real rows of its piece of every sharded leaf (no
  padding), named by their dotted path, and where each sits in the whole leaf (``boxes``: the whole shape, the
  offset and length of the piece on every dim);
- ``step_N.msgpack``, rank 0's index, written once every piece is on disk: the state as one process writes it, but
  each sharded leaf a marker (:data:`MARKER`), and the shard files' names (``shards``).

As ``torch.distributed.checkpoint`` plans a save (every rank writes what it holds, with the chunk metadata a
load needs to reshard), kept in this format. Discovery (``core.io.checkpoint.latest``) sees only the index, so a
save killed before its index leaves the previous checkpoint newest; it checks the index's shard files too, and
:func:`join` refuses a missing or short one, naming it. :func:`join` makes every leaf whole (a ``load`` of the
index returns what the one-file format holds), so a run resumes on any number of ranks, any mesh, or in one
process, and an export or ``recipe=generate`` reads it as any checkpoint.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from purestep.core.io.checkpoint_format import CheckpointError, read

MARKER = "sharded: see this checkpoint's shard files"     # a sharded leaf's value in the index
SHARDS = "shards"                                         # the index's extra: the shard files' names, in order
BOXES = "boxes"                                           # a shard file's extra: {path: {whole, offset, length}}
_SHARD_FILE = re.compile(r"step_\d+\.shard-\d+-of-\d+\.msgpack$")


def shard_name(step: int, index: int, count: int) -> str:
    """The file rank ``index`` of ``count`` writes for step ``step``."""
    return f"step_{step:09d}.shard-{index:05d}-of-{count:05d}.msgpack"


def shard_files(folder: Path) -> list:
    """The shard files in ``folder``."""
    return [p for p in folder.iterdir() if _SHARD_FILE.fullmatch(p.name)]


def drop_unreferenced(folder: Path, indexes: list) -> None:
    """Delete the shard files in ``folder`` that none of ``indexes`` (the index files there: step files and their
    links) names: a save killed before its index, or a checkpoint pruned. An index that cannot be read keeps none."""
    from purestep.core.io.checkpoint import read_meta
    found = shard_files(folder)
    if not found:
        return
    named = set()
    for index in indexes:
        try:
            named.update(read_meta(index).get(SHARDS, ()))
        except (CheckpointError, OSError):
            continue
    for p in found:
        if p.name not in named:
            p.unlink(missing_ok=True)


def split(state_dict: dict, paths: set) -> dict:
    """``state_dict`` (nested, as ``to_state_dict`` makes it) with the leaf at every dotted path of ``paths``
    (below ``state``) replaced by :data:`MARKER`: the index's state."""
    def walk(x, path):
        if isinstance(x, dict):
            return {k: walk(v, f"{path}.{k}") for k, v in x.items()}
        return MARKER if path in paths else x
    return walk(state_dict, "state")


def join(top: dict, folder: Path, device=None) -> dict:
    """``top`` (an index read whole) with every :data:`MARKER` leaf made whole from the shard files it names,
    read one at a time. A missing file, or pieces that do not cover a leaf, is a :class:`CheckpointError`."""
    wholes, shapes, covered = {}, {}, {}
    for name in top[SHARDS]:
        path = Path(folder) / name
        if not path.is_file():
            raise CheckpointError(f"{path}: a shard of this checkpoint is missing")
        piece = read(path, device)
        for leaf, box in piece[BOXES].items():
            data = piece["state"][leaf]
            if leaf not in wholes:     # a 0-d leaf is written as [1]
                wholes[leaf] = torch.empty(list(box["whole"]) or [1], dtype=data.dtype, device=data.device)
                shapes[leaf], covered[leaf] = tuple(box["whole"]), 0
            wholes[leaf][tuple(slice(o, o + n) for o, n in zip(box["offset"], box["length"]))] = data
            covered[leaf] += data.numel()

    def walk(x, path):
        if isinstance(x, dict):
            return {k: walk(v, f"{path}.{k}") for k, v in x.items()}
        if not (isinstance(x, str) and x == MARKER):
            return x
        if path not in wholes or covered[path] != wholes[path].numel():
            raise CheckpointError(f"{folder}: the shard files {list(top[SHARDS])} hold {covered.get(path, 0)} of "
                                  f"the elements of {path}")
        return wholes[path].reshape(shapes[path])
    return {**top, "state": walk(top["state"], "state")}


def check(top: dict, folder: Path) -> None:
    """Every shard file ``top`` names is there and its framing and CRCs are good (a :class:`CheckpointError`)."""
    for name in top.get(SHARDS, ()):
        path = Path(folder) / name
        if not path.is_file():
            raise CheckpointError(f"{path}: a shard of this checkpoint is missing")
        read(path, state="check")
