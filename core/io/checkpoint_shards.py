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
process, and an export or ``recipe=generate`` reads it as any checkpoint; a sharded run that resumes asks it for
its own rank's box of each leaf instead (``core.parallel.shard.Layout.load``), as ``torch.distributed.checkpoint``
loads each rank's chunks.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

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


def join(top: dict, folder: Path, device=None, boxes: Optional[dict] = None) -> dict:
    """``top`` (an index read whole) with every :data:`MARKER` leaf made from the shard files it names, read one at
    a time: whole, or, for a leaf ``boxes`` names (``{path: {whole, offset, length}}``, as the shard files' own),
    only that box of it (the rank of another layout that resumes: ``core.parallel.shard.Layout.load``), so no rank
    holds a whole leaf it will not keep. A whole leaf ``boxes`` names is cut the same way (:func:`cut`). A missing
    file, pieces that do not cover what is wanted, or a leaf of another shape is a :class:`CheckpointError`."""
    boxes, wanted, shapes, covered = boxes or {}, {}, {}, {}
    for name in top[SHARDS]:
        path = Path(folder) / name
        if not path.is_file():
            raise CheckpointError(f"{path}: a shard of this checkpoint is missing")
        piece = read(path, device)
        for leaf, box in piece[BOXES].items():
            data = piece["state"][leaf]
            want = boxes.get(leaf) or {"whole": box["whole"], "offset": [0] * len(_view(box)), "length": _view(box)}
            if _view(want) != _view(box):
                raise CheckpointError(f"{folder}: {leaf}: shape {tuple(box['whole'])} in file, "
                                      f"{tuple(want['whole'])} expected")
            if leaf not in wanted:
                wanted[leaf] = torch.empty(want["length"], dtype=data.dtype, device=data.device)
                shapes[leaf], covered[leaf] = (want["length"] if leaf in boxes else box["whole"]), 0
            overlap = _overlap(box, want)
            if overlap is not None:
                part = data[overlap[0]]
                wanted[leaf][overlap[1]] = part
                covered[leaf] += part.numel()

    def walk(x, path):
        if isinstance(x, dict):
            return {k: walk(v, f"{path}.{k}") for k, v in x.items()}
        if not (isinstance(x, str) and x == MARKER):
            return _cut_leaf(x, boxes[path], path) if path in boxes else x
        if path not in wanted or covered[path] != wanted[path].numel():
            raise CheckpointError(f"{folder}: the shard files {list(top[SHARDS])} hold {covered.get(path, 0)} of "
                                  f"the {wanted[path].numel() if path in wanted else 'wanted'} elements of {path}")
        return wanted[path].reshape(shapes[path])
    return {**top, "state": walk(top["state"], "state")}


def cut(state_dict: dict, boxes: dict) -> dict:
    """``state_dict`` (one file's, every leaf whole) with the leaf at each path of ``boxes`` cut to its box (a copy:
    the whole leaf is not kept)."""
    def walk(x, path):
        if isinstance(x, dict):
            return {k: walk(v, f"{path}.{k}") for k, v in x.items()}
        return _cut_leaf(x, boxes[path], path) if path in boxes else x
    return walk(state_dict, "state")


def _cut_leaf(x, box: dict, path: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or list(x.shape) != list(box["whole"]):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise CheckpointError(f"{path}: shape {shape} in file, {tuple(box['whole'])} expected")
    view = x.reshape(_view(box))
    return view[tuple(slice(o, o + n) for o, n in zip(box["offset"], box["length"]))].clone()


def _view(box: dict) -> list:
    """The whole leaf's shape as the pieces see it (a 0-d leaf as ``[1]``)."""
    return list(box["whole"]) or [1]


def _overlap(piece: dict, want: dict) -> Optional[tuple]:
    """Where ``piece`` and ``want`` (boxes in one leaf) meet: the slices into each, or None."""
    mine, theirs = [], []
    for po, pn, wo, wn in zip(piece["offset"], piece["length"], want["offset"], want["length"]):
        lo, hi = max(po, wo), min(po + pn, wo + wn)
        if hi <= lo:
            return None
        mine.append(slice(lo - po, hi - po))
        theirs.append(slice(lo - wo, hi - wo))
    return tuple(mine), tuple(theirs)


def check(top: dict, folder: Path) -> None:
    """Every shard file ``top`` names is there and its framing and CRCs are good (a :class:`CheckpointError`)."""
    for name in top.get(SHARDS, ()):
        path = Path(folder) / name
        if not path.is_file():
            raise CheckpointError(f"{path}: a shard of this checkpoint is missing")
        read(path, state="check")
