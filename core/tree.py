"""Pytree helpers over nested dicts of tensors keyed by readable names.

Parameters, gradients and optimizer moments are plain nested dicts whose leaves are tensors, e.g.
``{"embed": T, "layers": {"attn": {"wq": T, ...}}}``. A leaf's *name* is its dotted path
(``"layers.attn.wq"``). Everything here is out of place and traceable by ``torch.compile`` (optree is
traced natively by dynamo on torch >= 2.10), in the spirit of ``jax.tree_util`` / ``optax.tree``.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import sys

import optree
import torch

Tree = Any

tree_map = optree.tree_map
tree_leaves = optree.tree_leaves
tree_structure = optree.tree_structure
tree_flatten = optree.tree_flatten
tree_unflatten = optree.tree_unflatten


def leaves_of(tree: Tree) -> list:
    """``tree``'s leaves in ``tree_map``'s order, collected with a ``tree_map`` (see :func:`map_flat`).

    That order is sorted keys in eager optree but dict insertion order under dynamo: to pair the leaves of
    two trees, use :func:`zip_leaves`, never two calls of this.
    """
    leaves: list = []
    tree_map(leaves.append, tree)
    return leaves


def zip_leaves(tree: Tree, *rest: Tree) -> tuple[list, ...]:
    """The leaves of ``tree`` and, matched to them by path as ``tree_map`` matches them, those of every tree
    in ``rest``: one list per tree, all in ``tree``'s leaf order."""
    columns: tuple[list, ...] = tuple([] for _ in range(1 + len(rest)))

    def collect(*leaves):
        for column, leaf in zip(columns, leaves):
            column.append(leaf)

    tree_map(collect, tree, *rest)
    return columns


def like(tree: Tree, leaves: Iterable, order: Tree | None = None) -> Tree:
    """``leaves`` put back in ``tree``'s shape. They are in ``tree``'s leaf order (:func:`leaves_of`), or
    in ``order``'s, a tree of the same structure they were collected from with :func:`zip_leaves` (the two
    orders may differ under dynamo when the dicts were built in different key orders)."""
    if order is None:
        out = iter(leaves)
        return tree_map(lambda _: next(out), tree)
    leaves = list(leaves)
    return tree_map(lambda _, i: leaves[i], tree, like(order, range(len(leaves))))


def map_flat(fn: Callable[[list], list], tree: Tree) -> Tree:
    """``fn`` applied to the list of ``tree``'s leaves at once, the result put back in ``tree``'s shape.

    The same as ``tree_unflatten(spec, fn(leaves))``, written with two ``tree_map``s because dynamo traces
    those but not a ``TreeSpec`` constant nor ``tree_leaves`` of a tree holding an empty dict (torch 2.13).
    """
    return like(tree, fn(leaves_of(tree)))


def named_leaves(tree: Tree) -> list[tuple[str, Any]]:
    """(dotted name, leaf) pairs in optree's deterministic (sorted-key) order."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    return [(".".join(str(k) for k in path), leaf) for path, leaf in zip(paths, leaves)]


def names(tree: Tree) -> list[str]:
    return [n for n, _ in named_leaves(tree)]


def tree_map_with_name(fn: Callable[[str, Any], Any], tree: Tree, *rest: Tree) -> Tree:
    """``tree_map`` whose function also receives the leaf's dotted name as its first argument (optree's path:
    dict keys, sequence and NamedTuple indices). A walk in plain Python over dicts, lists and tuples, which every
    dynamo traces: torch 2.11's polyfill of ``optree.tree_map_with_path`` fails on a function that returns
    Python values (``ValueError: length mismatch`` while unflattening ``optim.common.decay_mask``'s booleans)."""
    def walk(prefix: str, node, *others):
        if isinstance(node, dict):
            return {k: walk(f"{prefix}{k}.", node[k], *(o[k] for o in others)) for k in node}
        if isinstance(node, (list, tuple)):
            children = [walk(f"{prefix}{i}.", x, *(o[i] for o in others)) for i, x in enumerate(node)]
            return type(node)(*children) if hasattr(node, "_fields") else type(node)(children)
        if node is None:
            return None
        return fn(prefix[:-1], node, *others)
    return walk("", tree, *rest)


def flatten_dict(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dict -> flat ``{"a.b.c": leaf}`` (insertion order kept)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_dict(value, name + "."))
        else:
            flat[name] = value
    return flat


def unflatten_dict(flat: dict[str, Any]) -> dict:
    """Flat ``{"a.b.c": leaf}`` -> nested dict. The inverse of :func:`flatten_dict`."""
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, last = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def zeros_like(tree: Tree, dtype: torch.dtype | None = None) -> Tree:
    return tree_map(lambda t: torch.zeros_like(t, dtype=dtype), tree)


def clone(tree: Tree) -> Tree:
    """A deep copy of every tensor leaf (a branch of a state is a clone of its pytree)."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def cast(tree: Tree, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> Tree:
    """Move floating-point leaves to ``dtype`` and every tensor leaf to ``device``."""

    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        target = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        return t.to(device=device if device is not None else t.device, dtype=target)

    return tree_map(move, tree)


def detach(tree: Tree) -> Tree:
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


def is_sharded(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (one rank's view of a tensor split across ranks). Asked
    of the module only if something imported it (whatever made a DTensor did): importing it costs most of a second
    at every start."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def whole(x):
    """``x`` as a plain tensor holding its whole value: a DTensor's ``full_tensor()`` (a partial sum over ranks
    all-reduced, a shard all-gathered), anything else as it is."""
    return x.full_tensor() if is_sharded(x) else x


def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """``t``'s squared L2 norm, accumulated in at least float32 (so fp16/bf16 cannot overflow). Of a DTensor, its sum
    of squares: a partial sum that adds up across ranks, so the squared norms of many sharded leaves sum into one
    value made whole by one all-reduce (:func:`whole`)."""
    wide = torch.promote_types(t.dtype, torch.float32)
    if is_sharded(t):
        return (t if t.dtype == wide else t.to(wide)).square().sum()
    return torch.linalg.vector_norm(t, dtype=wide).square()


def squared_norms(tree: Tree) -> list[torch.Tensor]:
    """Per-leaf squared L2 norms (:func:`squared_norm`)."""
    return [squared_norm(t) for t in tree_leaves(tree)]


def global_norm(tree: Tree) -> torch.Tensor:
    """L2 norm over every element of every leaf, in at least float32 (no host sync), a plain tensor. Over sharded
    leaves (DTensors) the squared norms are the ranks' partial sums, summed across ranks before the root by one
    all-reduce (:func:`whole`).

    Each leaf takes a ``vector_norm`` (:func:`squared_norms`), compiled or not, one code path: on the CPU that is
    what ``torch.nn.utils.clip_grad_norm_(foreach=True)``'s ``_foreach_norm`` runs leaf by leaf, the same bits;
    inductor has no CPU lowering of ``_foreach_norm`` (it runs
    the eager op, one kernel per leaf, three times per step for the gradient norm, the clip and the parameter
    norm), while ``vector_norm`` is fused into the kernels that already read the leaf (the health statistics
    read the same gradients and weights), and the compiler merges repeated norms of the same leaves.
    """
    sq = squared_norms(tree)
    if not sq:
        return torch.zeros(())
    wide = torch.float64 if any(s.dtype == torch.float64 for s in sq) else torch.float32
    total = torch.stack([s.to(wide) for s in sq]).sum()
    return whole(total).sqrt()


def size(tree: Tree) -> int:
    """Total number of elements over all tensor leaves."""
    return sum(t.numel() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def apply_updates(params: Tree, updates: Tree) -> Tree:
    """``params + updates``, cast back to each param's dtype (optax ``apply_updates``), as one
    ``torch._foreach_add`` over the leaves."""
    ps, us = zip_leaves(params, updates)
    sums = torch._foreach_add(ps, us) if ps else []
    return like(params, [s.to(p.dtype) for s, p in zip(sums, ps)])


def where(cond: torch.Tensor, on_true: Tree, on_false: Tree) -> Tree:
    """Leafwise ``torch.where``: pick a whole pytree without a host branch."""
    return tree_map(lambda a, b: torch.where(cond, a, b), on_true, on_false)


def allclose(a: Tree, b: Tree, rtol: float = 1e-5, atol: float = 1e-8) -> bool:
    la, lb = tree_leaves(a), tree_leaves(b)
    return len(la) == len(lb) and all(torch.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(la, lb))


def max_abs_diff(a: Tree, b: Tree) -> float:
    """Largest absolute difference between two pytrees of the same structure (for tests and reports)."""
    diffs = [(x.double() - y.double()).abs().max().item() for x, y in zip(tree_leaves(a), tree_leaves(b))]
    return max(diffs) if diffs else 0.0


def fingerprint(tree: Tree) -> str:
    """SHA-256 (16 hex digits) over every leaf's name, shape, dtype and bytes: a pytree's identity
    (e.g. which teacher a cache was computed with)."""
    import hashlib
    h = hashlib.sha256()
    for name, t in named_leaves(tree):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()[:16]


def stack(trees: Iterable[Tree]) -> Tree:
    """Stack a sequence of same-structured pytrees along a new leading axis (the layer axis)."""
    trees = list(trees)
    return tree_map(lambda *xs: torch.stack(xs), *trees)


class LayerNode(torch.autograd.Function):
    """``anchor -> layer.take()``: one layer's tensors as the outputs of one autograd node, whose backward hands their
    gradients (None where none) to ``layer.backward(grads)`` as soon as the layer's own backward is done. The anchor
    is a 0-d tensor that requires grad, so the outputs do too (its own gradient is None). How a layer source (see
    :func:`unstack`) makes a layer: ``core.parallel.shard_blocks`` gathers it and reduce-scatters its gradients,
    ``core.row_grads`` writes them."""

    @staticmethod
    def forward(ctx, layer, anchor: torch.Tensor):
        ctx.layer = layer
        ctx.set_materialize_grads(False)
        return tuple(layer.take())

    @staticmethod
    def backward(ctx, *grads):
        ctx.layer.backward(grads)
        return None, None


def unstack(tree: Tree, source: Callable | None = None) -> list[Tree]:
    """The inverse of :func:`stack`: unbind every leaf once along axis 0 into a list of pytrees.

    ``torch.unbind`` gives views whose gradients are gathered by one ``stack`` in backward; indexing
    ``w[i]`` in a loop would make autograd scatter into a full-size zero tensor per layer.

    ``source(leaves, spec)`` (a step's, handed to the model through ``core.layers.Layers``) may hand out the layers
    of a tree it owns lazily instead, and returns None for any other tree: under ``parallel=fsdp`` layer i is
    gathered from the ranks' shards when the iteration reaches it (``core.parallel.shard_blocks``); on the autograd
    path each layer's gradients are written into their rows as its backward ends (``core.row_grads``). Iterate the
    result once, in order, done with a layer's tree when taking the next.
    """
    leaves, spec = tree_flatten(tree)
    if not leaves:
        return []
    layers = None if source is None else source(leaves, spec)
    if layers is not None:
        return layers
    columns = [leaf.unbind(0) for leaf in leaves]
    return [tree_unflatten(spec, [col[i] for col in columns]) for i in range(len(columns[0]))]
