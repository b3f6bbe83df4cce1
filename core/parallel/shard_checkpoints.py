"""The checkpoint side of ``core.parallel.shard.Layout`` (a base class of it): each sharded leaf gathered as a
one-file checkpoint writes it (:meth:`LayoutCheckpoints.deferred`), the pieces every rank writes of a sharded one
(:meth:`LayoutCheckpoints.pieces`, ``core.io.checkpoint_shards``), and a checkpoint of any layout read as this rank's
shards, box by box (:meth:`LayoutCheckpoints.load`)."""
from __future__ import annotations

from typing import Callable

import torch

from purestep.core.io import checkpoint as ckpt
from purestep.core.io.checkpoint import Deferred
from purestep.core.parallel.distributed import all_gather, wait
from purestep.core.parallel.leaf_spec import LeafSpec, whole_shape
from purestep.core.tree import tree_map


class LayoutCheckpoints:
    """What a ``Layout`` (``world``, ``rank``, ``group``, ``tensor``, the ``params`` and ``opt`` specs, its ``_join``)
    does for checkpoints."""

    def gather_leaf(self, x: torch.Tensor, spec: LeafSpec) -> torch.Tensor:
        """One sharded leaf made whole on every rank (eager; a checkpoint writes it): across the data-parallel
        ranks, then across the tensor-parallel ones where the leaf is split there too."""
        piece = x
        if spec.dim is not None:
            every = all_gather(x.reshape(-1).contiguous(), self.group)
            piece = self._join(wait(every).view(self.world, -1), spec).clone()
        return piece if spec.tp_dim is None else self.tensor.gather(piece, spec.tp_dim)

    def deferred(self, state):
        """``state`` with every sharded leaf a ``core.io.checkpoint.Deferred`` that gathers it when written."""
        return self._map_sharded(state, lambda x, spec: Deferred(lambda: self.gather_leaf(x, spec)))

    def writers(self) -> int:
        """How many ranks write a sharded checkpoint (``core.io.checkpoint_shards``): those of the first replica
        (all of them but under ``parallel=hsdp``), every one a different piece; global ranks ``0 .. writers - 1``."""
        return self.world * (1 if self.tensor is None else self.tensor.size)

    def pieces(self, state) -> tuple[dict, dict]:
        """This rank's part of every sharded leaf of ``state`` as ``core.io.checkpoint_shards`` writes it:
        ``({path: its real rows}, {path: {whole, offset, length}})``, the path as ``core.io.checkpoint`` names the
        leaf (``state.params.layers.wq``); a piece of padding alone, and another tensor-parallel rank's copy of a leaf
        tensor parallelism leaves whole, are left out."""
        data, boxes = {}, {}
        for path, x, spec in self._sharded_leaves(state):
            if self.tensor is not None and spec.tp_dim is None and self.tensor.rank:
                continue      # a leaf tensor parallelism leaves whole: its first tp rank's pieces are written
            box = self._box(spec)
            if all(box["length"]):
                local = x.reshape(spec.local_shape() if spec.dim is not None else box["length"])
                data[path] = local.narrow(spec.dim, 0, box["length"][spec.dim]).contiguous() \
                    if spec.dim is not None else local
                boxes[path] = box
        return data, boxes

    def load(self, path, template, device=None) -> dict:
        """A checkpoint (``core.io.checkpoint.load``: any format, saved on any layout) with this rank's part of
        ``template``'s state (full, meta leaves), as :meth:`shard` cuts it: a sharded save's pieces are read file
        by file into this rank's boxes, so no leaf is made whole here (``core.io.checkpoint_shards.join``)."""
        top = ckpt.load(path, template=self.boxed(template), device=device, boxes=self.boxes(template))
        return {**top, "state": self.placed(top["state"])}

    def boxes(self, state) -> dict:
        """``{dotted path: box}`` (:meth:`_box`) of every leaf of ``state`` this rank holds a part of."""
        return {path: self._box(spec) for path, _, spec in self._sharded_leaves(state)}

    def _sharded_leaves(self, state):
        """``(dotted path, leaf, spec)`` of every params and optimizer leaf of ``state`` split across ranks, the path
        as ``core.io.checkpoint`` names it (``state.params.layers.attn.wq``)."""
        for prefix, tree, specs in (("state.params", state.params, self.params),
                                    ("state.opt_state", state.opt_state, self.opt)):
            for path, x, spec in _named(tree, specs, prefix):
                if spec.dim is not None or spec.tp_dim is not None:
                    yield path, x, spec

    def boxed(self, state):
        """``state`` (full) with every leaf this rank holds a part of a meta tensor of its box's shape: the template
        a checkpoint read with :meth:`boxes` fills."""
        return self._map_sharded(state, lambda x, spec: torch.empty(self._box(spec)["length"], dtype=x.dtype,
                                                                     device="meta"))

    def placed(self, state):
        """``state`` read in boxes (:meth:`boxed`) as this rank's shards, as :meth:`shard` cuts a full state."""
        return self._map_sharded(state, self._placed)

    def _placed(self, x: torch.Tensor, spec: LeafSpec) -> torch.Tensor:
        """This rank's box of a leaf (its real rows) as its shard: zero rows past the leaf's end (:meth:`_cut`)."""
        if spec.dim is None:
            return x
        shard = x.new_zeros(spec.local_shape())
        shard.narrow(spec.dim, 0, x.shape[spec.dim]).copy_(x)
        return shard

    def _box(self, spec: LeafSpec) -> dict:
        """Where this rank's piece of a leaf split as ``spec`` sits in the whole leaf (a 0-d leaf seen as ``[1]``):
        the fsdp rows ``[rank * chunk, ...)`` of this tensor-parallel rank's piece, past the pieces before it."""
        view = list(spec.shape) or [1]
        offset, length = [0] * len(view), list(view)
        if spec.dim is not None:
            offset[spec.dim] = self.rank * spec.chunk
            length[spec.dim] = max(0, min(spec.chunk, spec.size - self.rank * spec.chunk))
        if spec.tp_dim is not None:
            offset[spec.tp_dim] += self.tensor.rank * view[spec.tp_dim]
        return {"whole": list(whole_shape(spec, self.tensor)), "offset": offset, "length": length}

    def gather_state(self, state):
        """The full train state (every leaf gathered; for tests and small models)."""
        return self._map_sharded(state, self.gather_leaf)

    def _map_sharded(self, state, fn: Callable):
        """``state`` with ``fn(leaf, spec)`` in place of every sharded params/optimizer leaf."""
        def one(x, spec):
            return x if spec.dim is None and spec.tp_dim is None else fn(x, spec)
        return state._replace(params=tree_map(one, state.params, self.params),
                              opt_state=tree_map(one, state.opt_state, self.opt))


def _named(tree, specs, path: str):
    """``(dotted path, tensor, spec)`` for every tensor of ``tree`` beside its spec in ``specs`` (the same
    structure), the path named as ``core.io.checkpoint.to_state_dict`` names it: NamedTuple fields, sequence
    indices, dict keys."""
    if isinstance(tree, torch.Tensor):
        yield path, tree, specs
    elif hasattr(tree, "_fields"):
        for f in tree._fields:
            yield from _named(getattr(tree, f), getattr(specs, f), f"{path}.{f}")
    elif isinstance(tree, (tuple, list)):
        for i, (x, s) in enumerate(zip(tree, specs)):
            yield from _named(x, s, f"{path}.{i}")
    elif isinstance(tree, dict):
        for k, x in tree.items():
            yield from _named(x, specs[k], f"{path}.{k}")
