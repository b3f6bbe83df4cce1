"""Per-block gathering for the sharded step (``parallel=fsdp``, ``core.parallel.shard``): each layer of the stacked
leaves is all-gathered just before its block runs and is not kept for backward, so a rank holds about one full layer at
a time rather than the whole model: FSDP2's per-block ``unshard`` with ``reshard_after_forward=True`` (PyTorch FSDP,
Zhao et al. 2023, arXiv 2304.11277; torchtitan applies ``fully_shard`` to every ``TransformerBlock``), written for a
model that is a plain function of a params pytree.

- **Stand-ins.** The model gets the leaves that are not stacked gathered whole, once per step (embedding, final
  norm, head: :meth:`core.parallel.shard.Layout.gather_leaves`), and for every leaf stacked along the layer axis a
  stand-in on the meta device (its full shape and dtype, no data: arithmetic on it raises). The step hands the model
  :meth:`Blocks.unstack` (``core.layers.Layers``), which for a tree of stand-ins returns :class:`_Layers`:
  iterating it gathers layer ``i`` (one all-gather per dtype of layer ``i``'s slice of every stacked leaf, in
  ``gather_dtype``) when the loop reaches it.
- **Not kept for backward.** While the model runs, ``torch.autograd.graph.saved_tensors_hooks`` replace every
  tensor autograd saves that lives in a gathered layer's storage (a weight ``F.linear`` keeps for its input's
  gradient, a compiled block's saved views, the inputs ``core.remat.checkpoint`` keeps to recompute a block; under
  ``parallel=fsdp,tp`` a DTensor whose local piece is one) by a token; unpacking one in backward gathers the layer again, once, and keeps it until the layer's gradient is
  reduced. So a layer's full tensors die with the model's last reference to them, when its loop takes the next
  layer, and the recomputation of a checkpointed block re-gathers its layer.
- **Gradients.** A layer's full tensors are the outputs of one autograd node (``core.tree.LayerNode``), whose backward
  runs once the block's backward is done: it reduce-scatters their gradients in float32 into row ``i`` of this
  rank's gradient shard of each stacked leaf. With several micro-batches a layer's full float32 gradient is summed
  until the last micro-batch's backward, so each layer is still reduce-scattered once per optimizer step; the price
  is those sums, one full float32 gradient of every layer, kept between micro-batches (FSDP2's
  ``set_requires_gradient_sync(False)`` trade). The whole-gathered leaves' gradients are summed and reduce-scattered
  at the end of the step, with the loss and the aux metrics averaged (:meth:`core.parallel.shard.Layout.reduce`).

- **Prefetch.** Layer ``k + 1``'s all-gathers start as soon as layer ``k`` is handed to the model, and in backward
  layer ``k - 1``'s as soon as layer ``k``'s saved tensors are first unpacked; a layer's reduce-scatter is waited for
  when the next layer's is issued (or at the end of the step). Functional collectives run in the process group's
  background until their result is read, so each overlaps a block's compute; at most one layer is in flight ahead.
  ``Layout(prefetch=False)`` waits for each as it is issued (``recipe=bench.fsdp`` measures both).

Every rank runs the same model code, so the collectives come in the same order on every rank.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from purestep.core.parallel.distributed import wait
from purestep.core.tree import LayerNode, Tree, like, tree_unflatten, unstack, zip_leaves


class _Saved:
    """What autograd keeps of a saved tensor that lives in a gathered layer: the layer, which of its tensors, and
    the view of it (size, stride, offset)."""
    __slots__ = ("layer", "n", "view")

    def __init__(self, layer: "_Layer", n: int, t: torch.Tensor):
        self.layer, self.n, self.view = layer, n, (tuple(t.size()), t.stride(), t.storage_offset())


class _SavedPiece:
    """A saved DTensor (``parallel=fsdp,tp``: the block runs on DTensor views of the gathered pieces) whose local
    tensor lives in a gathered layer: that local tensor as a :class:`_Saved`, and how to view it as the DTensor
    again."""
    __slots__ = ("local", "mesh", "placements", "shape", "stride")

    def __init__(self, local: _Saved, t):
        self.local, self.mesh, self.placements, self.shape, self.stride = \
            local, t.device_mesh, t.placements, t.shape, t.stride()

    def tensor(self):
        local = self.local.layer.tensors()[self.local.n].as_strided(*self.local.view)
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=self.stride)


class _Layer:
    """Layer ``k`` of the stacked leaves at positions ``idx`` of :attr:`Blocks.shards`, for one pass of the model."""

    def __init__(self, blocks: "Blocks", idx: list, k: int, below: Optional["_Layer"] = None):
        self.blocks, self.idx, self.k, self.below = blocks, idx, k, below     # below: layer k - 1 of this pass
        self.held: Optional[list] = None     # the full (padded) tensors while this holds them
        self.weak: list = []                 # weak references to them (the model's references outlive ``held``)

    def take(self) -> list:
        """The layer gathered from every rank's shards, held until :meth:`release`."""
        self._hold(self.blocks.gather(self.idx, self.k))
        return self.held

    def _hold(self, tensors: list) -> None:
        self.held, self.weak = tensors, [weakref.ref(t) for t in tensors]
        for n, t in enumerate(tensors):
            self.blocks.owners[t.untyped_storage().data_ptr()] = (self, n)

    def release(self) -> None:
        """The model's loop has moved on: the layer lives as long as the model's own references to it."""
        self.held = None

    def alive(self, n: int) -> Optional[torch.Tensor]:
        return self.weak[n]() if self.weak else None

    def gone(self) -> bool:
        """Whether this layer must be gathered again to be used (its tensors died with the forward pass)."""
        return self.held is None and any(w() is None for w in self.weak)

    def tensors(self) -> list:
        """The full tensors for backward or a recomputation: still alive, or gathered again (held until the
        layer's gradient is reduced)."""
        if self.held is None:
            alive = [w() for w in self.weak]
            if any(t is None for t in alive):
                self.take()
            else:
                self.held = alive
        if self.below is not None and self.below.gone():     # backward walks down: fetch the next layer now
            self.blocks.prefetch(self.idx, self.below.k)
        return self.held

    def backward(self, grads: tuple) -> None:
        self.blocks.reduce(self.idx, self.k, grads)
        self.held = None


class _Layers:
    """The layers of a tree of stand-ins (:meth:`Blocks.unstack`), each gathered when the iteration reaches it."""

    def __init__(self, blocks: "Blocks", idx: list, spec):
        self.blocks, self.idx, self.spec = blocks, idx, spec
        self.n = blocks.specs[idx[0]].shape[0]

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        layer = None
        for k in range(self.n):
            if layer is not None:
                layer.release()
            layer = _Layer(self.blocks, self.idx, k, below=layer)
            leaves = self.blocks.model_leaves(layer)
            if k + 1 < self.n:
                self.blocks.prefetch(self.idx, k + 1)       # in flight while this block computes
            tree = tree_unflatten(self.spec, leaves)
            tensor = self.blocks.layout.tensor
            yield tree if tensor is None else tensor.place(tree)    # parallel=fsdp,tp: this rank's pieces

    def __getitem__(self, k):
        raise TypeError("the layers of params sharded per block (parallel=fsdp) are gathered one at a time: iterate "
                        "the model's layers once, in order")


class Blocks:
    """One step's gathering of this rank's ``shards`` (a params tree split as ``layout.params``): the stacked leaves
    per layer, the others whole. ``train``: the model is differentiated (gradients reduce-scattered), else only run."""

    def __init__(self, layout, shards, train: bool = True):
        self.layout, self.tree = layout, shards
        self.shards, self.specs = zip_leaves(shards, layout.params)
        self.stacked = [j for j, s in enumerate(self.specs) if s.dim == 1]
        self.rest = [j for j, s in enumerate(self.specs) if s.dim != 1]
        full = layout.gather_leaves([self.shards[j] for j in self.rest], [self.specs[j] for j in self.rest])
        self.full = [f.detach().requires_grad_(train) for f in full]
        self.standins = {j: torch.empty(self.specs[j].shape, dtype=self._dtype(self.shards[j]), device="meta")
                         for j in self.stacked}
        self.by_id = {id(t): j for j, t in self.standins.items()}
        device = self.shards[0].device if self.shards else None
        self.anchor = torch.zeros((), device=device, requires_grad=True) if train else None
        self.grads = {j: torch.zeros_like(self.shards[j]) for j in self.stacked} if train else {}
        self.sums: dict = {}      # (j, k) -> layer k's full float32 gradient of leaf j summed over micro-batches
        self.last = True          # the micro-batch running is the step's last: its backward reduce-scatters
        self.owners: dict = {}    # storage address -> (layer, n) of every gathered tensor
        self.pending: dict = {}   # (leaves, k) -> layer k's all-gathers in flight (prefetched, not yet read)
        self.scattering = None    # (leaves, k, reduce-scatter in flight): the last layer's gradient, not yet added

    def _dtype(self, shard: torch.Tensor) -> torch.dtype:
        gather = self.layout.gather_dtype
        return gather if gather is not None and shard.is_floating_point() else shard.dtype

    def params(self):
        """The params tree the model gets: the whole-gathered leaves, stand-ins for the stacked ones."""
        leaves = [None] * len(self.shards)
        for j, t in zip(self.rest, self.full):
            leaves[j] = t
        for j, t in self.standins.items():
            leaves[j] = t
        return like(self.tree, leaves, order=self.tree)

    def inputs(self) -> list:
        """What ``torch.autograd.grad`` differentiates: the whole-gathered leaves, then the anchor."""
        return [*self.full, self.anchor]

    @contextlib.contextmanager
    def running(self, last: bool = True):
        """While the model runs on :meth:`params` (its layers from :meth:`unstack`), tensors saved for backward that
        live in a gathered layer become tokens. ``last``: the step's last micro-batch."""
        self.last = last
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack) if self.anchor is not None \
            else contextlib.nullcontext()
        try:
            with hooks:
                yield self.params()
        finally:
            if self.anchor is None:      # only run: nothing comes back for a backward
                self.close()

    def unstack(self, tree: Tree) -> list:
        """The layers of ``tree``: gathered one at a time when it is the stand-ins' tree, else ``unbind``'s."""
        return unstack(tree, self._layers)

    def unstack_with(self, others: list):
        """:meth:`unstack` for a model that also runs the stand-ins of ``others`` (:class:`Blocks` of frozen inputs:
        a sharded teacher, ``teacher_shard=true``) in the same pass: each tree's layers gathered by the
        :class:`Blocks` whose stand-ins it holds, ``unbind``'s for any other tree."""
        every = [self, *others]

        def layers(leaves: list, spec) -> Optional[_Layers]:
            return next((found for b in every if (found := b._layers(leaves, spec)) is not None), None)
        return lambda tree: unstack(tree, layers)

    def _layers(self, leaves: list, spec) -> Optional[_Layers]:
        idx = [self.by_id.get(id(t)) for t in leaves]
        if all(j is None for j in idx):
            return None
        if any(j is None for j in idx):
            raise ValueError("core.parallel.shard_blocks: a tree mixing the stacked params of a sharded step "
                             "(parallel=fsdp, gathered per block) with other tensors")
        return _Layers(self, idx, spec)

    def model_leaves(self, layer: _Layer) -> list:
        """Layer ``k``'s tensors as the model sees them: gathered (through ``core.tree.LayerNode`` when differentiated),
        the padding cut off."""
        full = LayerNode.apply(layer, self.anchor) if self.anchor is not None and torch.is_grad_enabled() \
            else layer.take()
        sizes = [self.specs[j].size for j in layer.idx]
        return [t if t.shape[0] == n else t.narrow(0, 0, n) for t, n in zip(full, sizes)]

    def gather(self, idx: list, k: int) -> list:
        """Layer ``k`` of the stacked leaves ``idx``, each full and padded (``[W chunk, ...]``): one
        all-gather per dtype (the prefetched one, when :meth:`prefetch` started it)."""
        world = self.layout.world

        def join(pieces: torch.Tensor, spec) -> torch.Tensor:     # [W, chunk numel] -> [W chunk, ...]
            out = torch.empty((world * spec.chunk,) + spec.shape[2:], dtype=pieces.dtype, device=pieces.device)
            out.view(world, -1).copy_(pieces)
            return out
        launched = self.pending.pop((tuple(idx), k), None) or self._launch(idx, k)
        with torch.no_grad():
            return self.layout.join_gathered(launched, [self.specs[j] for j in idx], join)

    def prefetch(self, idx: list, k: int) -> None:
        """Start layer ``k``'s all-gathers now, so that they run while the layer before it (forward) or after it
        (backward) computes: FSDP2's implicit prefetch, one layer ahead. Every rank runs the same model code, so
        every rank starts the same collectives in the same order."""
        if self.layout.prefetch and (tuple(idx), k) not in self.pending:
            self.pending[(tuple(idx), k)] = self._launch(idx, k)

    def _launch(self, idx: list, k: int) -> list:
        with torch.no_grad():
            return self.layout.launch_gather([self.shards[j][k] for j in idx])

    def reduce(self, idx: list, k: int, grads) -> None:
        """Layer ``k``'s full gradients of the leaves ``idx`` (padded; None is zero): reduce-scattered into row
        ``k`` of this rank's gradient shards in the step's last micro-batch (added there once the next layer's
        reduce-scatter is issued, or at the step's end: :meth:`_settle`), summed for it before."""
        world, rows = self.layout.world, []
        for j, g in zip(idx, grads):
            spec = self.specs[j]
            if g is None:
                g = torch.zeros((world * spec.chunk,) + spec.shape[2:], dtype=torch.float32,
                                device=self.grads[j].device)
            g = g.to(torch.float32)
            if (j, k) in self.sums:
                g = self.sums.pop((j, k)) + g
            elif not self.last:
                g = g.clone()          # kept past this backward: not autograd's buffer
            if not self.last:
                self.sums[(j, k)] = g
                continue
            rows.append(g.reshape(world, -1))
        if not self.last:
            return
        self._settle()
        self.scattering = (idx, k, self.layout.reduce_rows(rows))   # runs while the layer below computes
        if not self.layout.prefetch:
            self._settle()

    def _settle(self) -> None:
        """Wait for the last layer's reduce-scatter and add its mean into that layer's row of the gradient shards."""
        if self.scattering is None:
            return
        idx, k, summed = self.scattering
        self.scattering = None
        mine, offset = wait(summed) / self.layout.averaged, 0
        for j in idx:
            row = self.grads[j][k]
            row.add_(mine[offset:offset + row.numel()].view_as(row))
            offset += row.numel()

    def finish(self, full_grads: list, loss: torch.Tensor, aux: dict):
        """This rank's gradient shards (a tree like the params), the loss and aux averaged over ranks, from the
        summed gradients of the whole-gathered leaves (``full_grads``, in :meth:`inputs` order) and the layers'."""
        self.last = True
        for k in sorted({k for _, k in self.sums}):     # layers the last micro-batch did not reach
            idx = sorted(j for j, kk in self.sums if kk == k)
            self.reduce(idx, k, [None] * len(idx))
        self._settle()
        rest, loss, aux = self.layout.reduce(list(full_grads), loss, aux, specs=[self.specs[j] for j in self.rest])
        leaves = [None] * len(self.shards)
        for j, g in zip(self.rest, rest):
            leaves[j] = g
        for j, g in self.grads.items():
            leaves[j] = g
        self.close()
        return like(self.tree, leaves, order=self.tree), loss, aux

    def close(self) -> None:
        """Drop what this step gathered and the layers' references back here (a cycle the garbage collector would
        otherwise free late, gradient buffers and all)."""
        for launched in self.pending.values():      # prefetched and never read (a layer still alive): drained
            for _, _, every in launched:
                wait(every)
        if self.scattering is not None:
            wait(self.scattering[2])
        self.owners, self.grads, self.full, self.pending, self.scattering = {}, {}, [], {}, None

    def _pack(self, t):
        if isinstance(t, DTensor):    # parallel=fsdp,tp: the piece it views, if gathered here
            with torch.no_grad():
                local = self._pack(t.to_local())
            return _SavedPiece(local, t) if isinstance(local, _Saved) else t
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_meta:
            return t
        address = t.untyped_storage().data_ptr()
        hit = self.owners.get(address) if address else None
        if hit is None:
            return t
        layer, n = hit
        full = layer.alive(n)
        if full is None or full.untyped_storage().data_ptr() != address:   # a stale entry: the layer is gone
            return t
        return _Saved(layer, n, t)

    @staticmethod
    def _unpack(saved):
        if isinstance(saved, _SavedPiece):
            return saved.tensor()
        if isinstance(saved, _Saved):
            return saved.layer.tensors()[saved.n].as_strided(*saved.view)
        return saved
