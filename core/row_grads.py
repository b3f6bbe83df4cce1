"""Gradients of layer-stacked leaves written row by row during backward, each layer's freed as it lands.

A model reaches its stacked layers through ``core.layers.Layers.unstack``. Its default, ``torch.unbind``, gives
views whose backward is one ``stack``: every layer's gradient of a stacked leaf stays alive until backward reaches
the first layer, then ``stack`` copies them into a fresh full-size tensor, so the peak holds one stacked leaf
twice (for a 100M Llama's MLP weights, the gap between the block-compiled step's peak and plain PyTorch's in
``recipe=bench.step``; docs/design.md, 'Measured choices'). Here :meth:`RowGradients.unstack`, which the step hands
the model, gives each layer's rows through one autograd node per layer (``core.tree.LayerNode``, as
``core.parallel.shard_blocks`` gathers a layer), whose backward copies the layer's gradients into their rows of the
stacked gradients as soon as autograd has them all, and drops them. Rows are copied on a micro-batch's first
landing, added after, so the numbers are ``unbind``'s to the bit. (A post-accumulate-grad hook on per-layer leaf
tensors frees them as early, but ``AccumulateGrad`` first clones a gradient whose strides differ from the leaf's, as
a matmul's transposed product does: a second copy.)

Only where the model's Python loop runs eagerly (an eager step, or ``compile_scope="block"``, whose compiled
block is called once per layer): a compiled objective keeps ``unbind``.
"""
from __future__ import annotations

from typing import Optional

import torch

from purestep.core.tree import LayerNode, Tree, tree_unflatten, unstack


class _Row:
    """Layer ``i``'s rows of the stacked leaves at positions ``ks``, made by ``core.tree.LayerNode``."""

    def __init__(self, rows: "RowGradients", ks: tuple, i: int):
        self.rows, self.ks, self.i = rows, ks, i

    def take(self) -> list:
        return [self.rows.live[k].detach()[self.i] for k in self.ks]

    def backward(self, grads: tuple) -> None:
        self.rows.land(self.ks, self.i, grads)


class _Layers:
    """The layers, each made when the model's loop reaches it: its ``LayerNode`` then comes after the layers
    before it, so backward runs it as soon as the layer's own backward is done (autograd runs the ready node made
    last first), not after every layer (what making them all up front would do, holding every layer's
    gradients, as ``unbind`` does)."""

    def __init__(self, rows: "RowGradients", ks: tuple, n: int, spec):
        self.rows, self.ks, self.n, self.spec = rows, ks, n, spec

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not -self.n <= i < self.n:
            raise IndexError(f"layer {i} of {self.n}")
        row = _Row(self.rows, self.ks, i % self.n)
        return tree_unflatten(self.spec, list(LayerNode.apply(row, self.rows.anchor)))

    def __iter__(self):
        return (self[i] for i in range(self.n))


class RowGradients:
    """Gradients of ``live`` (leaf tensors requiring grad) with the stacked leaves' gathered by row.

    ``loss = loss_fn(..., layers=Layers(unstack=rows.unstack))`` (``core.layers``) then ``rows.backward(loss)`` once
    per micro-batch, then :meth:`gradients` gives one gradient per ``live`` leaf, summed over the micro-batches
    (zeros where none).
    """

    def __init__(self, live: list[torch.Tensor]):
        self.live = live
        self.index = {id(t): k for k, t in enumerate(live) if t.ndim >= 1}
        self.anchor = torch.zeros((), device=live[0].device, requires_grad=True) if live else None
        self.stacked: list[Optional[torch.Tensor]] = [None] * len(live)
        self.written: list[set] = [set() for _ in live]
        self.direct: list[Optional[torch.Tensor]] = [None] * len(live)   # gradients through the whole leaf

    def unstack(self, tree: Tree) -> list:
        """The layers of ``tree``: by rows when its leaves are (stacked) ``live`` leaves, else ``unbind``'s."""
        return unstack(tree, self._layers)

    def _layers(self, leaves: list, spec) -> Optional[list]:
        ks = tuple(self.index.get(id(leaf)) for leaf in leaves)
        if None in ks:
            return None                         # not (only) this step's leaves: unstack's unbind
        return _Layers(self, ks, leaves[0].shape[0], spec)

    def land(self, ks: tuple, i: int, grads: tuple) -> None:
        for k, grad in zip(ks, grads):
            if grad is None:
                continue
            if self.stacked[k] is None:
                self.stacked[k] = torch.empty_like(self.live[k])   # pages are touched row by row as layers land
            if i in self.written[k]:
                self.stacked[k][i].add_(grad)
            else:
                self.stacked[k][i].copy_(grad)
                self.written[k].add(i)

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward: rows into the stacked gradients, the rest summed in ``direct``."""
        grads = torch.autograd.grad(loss, self.live + [self.anchor], allow_unused=True)[:-1]
        self.direct = [g if d is None else (d if g is None else d + g) for d, g in zip(self.direct, grads)]

    def gradients(self) -> list[torch.Tensor]:
        out = []
        for k, leaf in enumerate(self.live):
            stacked, direct = self.stacked[k], self.direct[k]
            if stacked is None:
                out.append(torch.zeros_like(leaf) if direct is None else direct)
                continue
            for i in set(range(leaf.shape[0])) - self.written[k]:
                stacked[i].zero_()
            out.append(stacked if direct is None else stacked.add_(direct))
        return out
