"""How one leaf of a train state is split across ranks (``core.parallel.shard.Layout`` builds one
:class:`LeafSpec` per leaf): the fsdp dim and shard sizes, and under tensor parallelism the dim its pieces split
first. The helpers find, from an optimizer's ``init`` on meta tensors, which optimizer-state leaves follow which
param's dims (AdamW's moments do; counters and hyperparameters do not)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from purestep.core.tree import tree_map


@dataclass(frozen=True)
class LeafSpec:
    """How one leaf is split: along ``dim`` of the full leaf (``shape``; a 0-d leaf is seen as ``[1]``), whose
    length ``size`` becomes ``chunk`` on every rank. ``dim`` None: replicated."""
    dim: Optional[int]
    size: int = 0
    chunk: int = 0
    shape: tuple = ()
    tp_dim: Optional[int] = None   # the dim tensor parallelism splits first (``shape`` is then this rank's piece)

    def local_shape(self) -> tuple:
        full = self.shape or (1,)
        return full[:self.dim] + (self.chunk,) + full[self.dim + 1:]


class LayoutError(ValueError):
    """A leaf this layout cannot split (named)."""


def split_dim(name: str, leaf: torch.Tensor, stacked: Callable[[str, torch.Tensor], bool]) -> int:
    """The dim ``leaf`` is sharded on: 1 for a leaf stacked along a layer axis, else 0."""
    if stacked(name, leaf):
        if leaf.ndim < 2:
            raise LayoutError(f"{name}: a stacked leaf of shape {tuple(leaf.shape)} has no dim besides the layer "
                              f"axis to shard on")
        return 1
    return 0


NO_TP = -1   # a leaf tensor parallelism leaves whole, in the trees that carry split dims while a layout is built


def or_no_tp(dim: Optional[int]) -> int:
    return NO_TP if dim is None else dim


def leaf_spec(dim: int, shape: tuple, world: int, tp_dim: int = NO_TP) -> LeafSpec:
    size = shape[dim] if shape else 1
    return LeafSpec(dim, size, max(1, math.ceil(size / world)), tuple(shape), None if tp_dim == NO_TP else tp_dim)


def tp_follows(init: Callable, meta, tp_dims):
    """For every optimizer-state leaf, the tensor-parallel split dim of the param it follows (``NO_TP`` for the
    others): the dim where the state of params one feature longer on their split dims differs."""
    grown = tree_map(lambda p, t: p if t == NO_TP else torch.empty(
        p.shape[:t] + (p.shape[t] + 1,) + p.shape[t + 1:], dtype=p.dtype, device="meta"), meta, tp_dims)
    a, b = init(meta), init(grown)

    def one(x, y):
        if not isinstance(x, torch.Tensor) or x.shape == y.shape:
            return NO_TP
        return next(i for i, (m, n) in enumerate(zip(x.shape, y.shape)) if m != n)
    return tree_map(one, a, b)


def probe(params, dims, size: int):
    """Meta tensors shaped like ``params`` with every leaf's shard dim set to ``size``."""
    def one(p, d):
        shape = tuple(p.shape) or (1,)
        return torch.empty(shape[:d] + (size,) + shape[d + 1:], dtype=p.dtype, device="meta")
    return tree_map(one, params, dims)


def follows(a: torch.Tensor, b: torch.Tensor) -> Optional[int]:
    """The one dim where two probes' optimizer leaves differ (the leaf follows a param's shard dim), or None."""
    if not isinstance(a, torch.Tensor) or a.shape == b.shape:
        return None
    diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
    if a.ndim != b.ndim or len(diff) != 1:
        raise LayoutError(f"an optimizer state leaf of shape {tuple(a.shape)} depends on a param's shape in a way "
                          f"this layout cannot shard (only elementwise state, like AdamW's moments)")
    return diff[0]


def whole_shape(spec: LeafSpec, tensor) -> tuple:
    """The full leaf's shape: ``spec.shape`` with the tensor-parallel split dim whole again."""
    if spec.tp_dim is None:
        return spec.shape
    shape = list(spec.shape)
    shape[spec.tp_dim] *= tensor.size
    return tuple(shape)
