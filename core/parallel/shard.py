"""Sharded data parallel for the pure step: params, gradients and optimizer state split across ranks.

ZeRO stage 3 (Rajbhandari et al. 2020, arXiv 1910.02054) with FSDP2's per-parameter layout (PyTorch FSDP,
Zhao et al. 2023, arXiv 2304.11277; torchtitan's ``fully_shard``: every parameter split on one dim, padded to
a multiple of the world size), written the way SimpleFSDP has it (Zhang et al. 2024, arXiv 2411.00284): the
collectives are ordinary ops of the traced step, so ``torch.compile`` sees one graph with them inside.

**Layout** (:class:`Layout`). Every leaf of the params, and every optimizer-state leaf whose shape follows a
param's (the moments), lives on each rank as a shard of one dim: a leaf stacked along a leading layer axis
(``[L, out, in]``, ``[L, d]``) on dim 1, its first non-layer dim, so every rank holds a slice of every layer;
any other leaf on dim 0; a 0-d leaf as a 1-element vector. With ``c = ceil(n / W)``, rank ``r`` holds
``[r c, (r + 1) c)``, zero past ``n``. Nothing is replicated, not even a tiny leaf (rank 0 holds it, the others
zero padding): then a sum of squares over every rank's shards counts each element once. The update sees the
shards as DTensors (:meth:`Layout.on_dtensors`: ``DTensor.from_local`` views, ``Shard`` on the leaf's dim), so
the optimizer, ``core.tree.global_norm``, ``optim.adagc`` and ``optim.health`` are written for whole tensors: a
norm of a sharded leaf is DTensor's partial sum, made whole by one all-reduce. Zero padding stays zero: its
gradient is zero, so are its AdamW moments and its decay.
Optimizer-state leaves that do not follow a param (hyperparameters, counters, AdaGC's per-tensor and per-layer
gamma) and the rest of the train state (step, key, cursor, loss scale, spike monitor) are replicated: every
rank computes them from the same global statistics.

**The step** (``core.step.make_train_step(parallel=Parallel(shard=...))``). Eager, and with
``Compile(scope="block")`` (the model's loop in Python, one compiled block), the step gathers the stacked leaves
**one block at a time** (``core.parallel.shard_blocks``):
layer ``i``'s slice of every stacked leaf is all-gathered (one all-gather per dtype) when the model's
loop reaches layer ``i`` and is not kept for backward (saved-tensor hooks put a token in its place; backward
gathers it again, as does the recomputation of a checkpointed block under ``remat``), and its gradient is
reduce-scattered (one reduce-scatter, float32, divided by W) by the backward of that gather, into row
``i`` of this rank's gradient shards; the other leaves (embedding, final norm, head) are gathered whole once per
step and reduce-scattered at its end. With gradient accumulation a layer's full float32 gradient is summed over the
micro-batches and reduce-scattered once, in the last micro-batch's backward (once per optimizer step; the sums are
a full-size float32 gradient of every layer between micro-batches). A step compiled whole (``compile_scope=step``:
one graph through ``torch.func.grad``, or under ``remat`` the loss as one graph) gathers the params **whole once
per step** (:meth:`Layout.gather`) and reduce-scatters the summed full gradients once (:meth:`Layout.reduce`): in
one traced graph there is no per-layer autograd node and no saved-tensor hook to free a layer with, so there the
full params and gradients exist for the step. Either way params
are gathered in ``gather_dtype`` under bf16 (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``; their gradients
come back float32 for the float32 shards, its ``reduce_dtype``), the loss and the aux metrics are averaged (one
``all_reduce``), and the optimizer runs on local shards. Gathered per block, the collectives run ahead of the
compute (``prefetch``, the default): layer ``i + 1``'s all-gather starts as block ``i`` begins (in backward, layer
``i - 1``'s), and a layer's reduce-scatter is waited for when the next one is issued, so both run in the process
group's background while a block computes (FSDP2's implicit prefetch). Not built: per-block gathering of a sharded
frozen teacher (gathered whole per step).

**Why the gathers are plain tensors and functional collectives rather than DTensor or ``fully_shard``**:
``torch.func.grad`` fails over DTensor inputs (it wraps them and loses ``redistribute``; torch 2.14 still), and
``fully_shard`` modules give ``torch.autograd.grad`` no gradients on torch 2.13. Keeping the collectives outside
what ``torch.func`` differentiates (per block: in an autograd node of their own) leaves both gradient paths,
buffer donation and checkpoints on ordinary tensors, and makes the padding explicit. The update is past the
gradient, so there the shards are DTensors (:meth:`Layout.on_dtensors`): ``torch.cond`` takes no DTensor operands,
so gradient health computes its statistics on every step of a sharded run and selects them.

**Checkpoints** hold full leaves, as a one-process run writes them: :meth:`Layout.deferred` turns each
sharded leaf into a ``core.io.checkpoint.Deferred`` that gathers it when the writer reaches it (peak extra
memory: the largest leaf), and :meth:`Layout.shard` cuts a loaded full state, so a run resumes on any number
of ranks. Or every rank writes its own pieces (:meth:`Layout.pieces`, ``core.io.checkpoint_shards``), which a load
joins into the same full leaves. Those methods live in ``core.parallel.shard_checkpoints``.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from purestep.core.parallel.leaf_spec import (NO_TP, LayoutError, LeafSpec, follows, leaf_spec, or_no_tp, probe,
                                               split_dim, tp_follows, whole_shape)
from purestep.core.parallel.distributed import (all_gather, all_reduce_sum, mean_over_ranks, reduce_scatter_sum,
                                                split_mean)
from purestep.core.parallel.shard_checkpoints import LayoutCheckpoints
from purestep.core.tree import leaves_of, like, tree_map, tree_map_with_name, zip_leaves


class Layout(LayoutCheckpoints):
    """Where every leaf of a train state lives across ``world`` ranks of ``group`` (module docstring).

    ``Layout(params, optimizer.init, stacked=, world=, rank=, group=)``; ``params`` (full) may be on the meta
    device. ``prefetch=False``: a step gathered per block starts each layer's all-gather when the layer is used and
    waits for it, and waits for each layer's reduce-scatter (the blocking schedule; ``bench.fsdp`` measures both).
    ``tensor`` (a ``core.parallel.tensor.TensorParallel``): the params are first split across its ranks, and this
    layout shards this rank's pieces across the ``world`` data-parallel ranks of ``group`` (``parallel=fsdp,tp``).
    ``replicas`` (``(process group, R)``): HSDP (FSDP2's ``HYBRID_SHARD``, a 2-D mesh of ``R`` replicas of ``world``
    shards, ``parallel=hsdp``): the state is sharded within ``group`` and the same in each of the ``R`` groups; a
    reduce-scatter's result is then summed over the replicas (one all-reduce), and the gradient, loss and aux are
    means over all ``R x world`` ranks.
    """

    def __init__(self, params, init: Callable, *, stacked: Callable[[str, torch.Tensor], bool], world: int,
                 rank: int, group=None, gather_dtype: Optional[torch.dtype] = None, prefetch: bool = True,
                 tensor=None, replicas: Optional[tuple] = None):
        self.world, self.rank, self.group, self.gather_dtype = world, rank, group, gather_dtype
        self.prefetch, self.tensor, self.replicas = prefetch, tensor, replicas
        meta = tree_map(lambda p: torch.empty(p.shape, dtype=p.dtype, device="meta"), params)
        tp_dims = tree_map_with_name(lambda name, p: NO_TP if tensor is None else or_no_tp(tensor.dim(name, p)),
                                     meta)
        if tensor is not None:
            meta = tensor.local(meta)
        dims = tree_map_with_name(lambda name, p: split_dim(name, p, stacked), meta)
        self.params = tree_map(lambda p, d, t: leaf_spec(d, tuple(p.shape), world, t), meta, dims, tp_dims)
        a, b = init(probe(meta, dims, 1)), init(probe(meta, dims, 2))
        full = init(meta)
        followed = tp_follows(init, meta, tp_dims) if tensor is not None else tree_map(lambda x: NO_TP, a)

        def opt_spec(x, y, f, t):
            d = follows(x, y)
            return LeafSpec(None) if d is None else leaf_spec(d, tuple(f.shape), world, t)
        self.opt = tree_map(opt_spec, a, b, full, followed)

    # ------------------------------------------------------------------------- host side: cut and describe

    def _cut(self, x: torch.Tensor, spec: LeafSpec) -> torch.Tensor:
        if spec.dim is None:
            return x
        x = x.reshape(spec.shape or (1,))
        pad = spec.chunk * self.world - spec.size
        if pad:
            shape = list(x.shape)
            shape[spec.dim] = pad
            x = torch.cat([x, x.new_zeros(shape)], dim=spec.dim)
        return x.narrow(spec.dim, self.rank * spec.chunk, spec.chunk).clone()

    def _piece(self, x: torch.Tensor, spec: LeafSpec) -> torch.Tensor:
        """This tensor-parallel rank's piece of a full leaf (the leaf itself without tensor parallelism)."""
        if spec.tp_dim is None or not isinstance(x, torch.Tensor):
            return x
        return x.chunk(self.tensor.size, spec.tp_dim)[self.tensor.rank]

    def _cut_full(self, x: torch.Tensor, spec: LeafSpec) -> torch.Tensor:
        return self._cut(self._piece(x, spec), spec)

    def shard_params(self, params):
        """This rank's shards of full ``params``."""
        return tree_map(self._cut_full, params, self.params)

    def shard(self, state):
        """This rank's part of a full train state (a ``TrainState``: params and optimizer state cut)."""
        return state._replace(params=self.shard_params(state.params),
                              opt_state=tree_map(self._cut_full, state.opt_state, self.opt))

    def full_shapes(self):
        """The full params as meta tensors (their shapes and dtypes: counts, FLOPs, health rows)."""
        return tree_map(lambda spec: torch.empty(whole_shape(spec, self.tensor), device="meta"), self.params)

    def describe(self, per_block: bool = False) -> str:
        """One line: which leaves are sharded on which dim, and how the step gathers them (``per_block``: the
        stacked leaves one layer at a time, ``core.parallel.shard_blocks``)."""
        by_dim: dict = {}
        for spec in leaves_of(self.params):
            by_dim[spec.dim] = by_dim.get(spec.dim, 0) + 1
        dims = ", ".join(f"{n} on dim {d}" for d, n in sorted(by_dim.items()))
        gathered = "stacked leaves gathered per block (the others once per step)" if per_block else \
            "gathered once per step"
        tensor = "" if self.tensor is None else (
            f"; every block tensor parallel over {self.tensor.size} ranks (attention heads and MLP features split, "
            f"core.parallel.tensor), the split leaves sharded as pieces")
        replicas = "" if self.replicas is None else (
            f"; hsdp: {self.replicas[1]} replicas of the shards, their gradients summed by one all-reduce")
        return (f"fsdp over {self.world} ranks: every param leaf and optimizer moment sharded ({dims}; stacked "
                f"leaves on their first non-layer dim, zero-padded to a multiple of {self.world}), {gathered}, "
                f"gradients reduce-scattered once per optimizer step{tensor}{replicas}")

    # ------------------------------------------------------------------------- inside the step (traceable)

    def on_dtensors(self, apply: Callable, device_type: str, params=None) -> Callable:
        """``apply(state, grads, loss, aux, due=) -> (state, metrics)`` (``core.update.apply_gradients``) run on
        DTensor views of this rank's shards: every sharded params, gradient and optimizer leaf a
        ``DTensor.from_local`` of its (padded) shard on a 1-D ``DeviceMesh`` of the layout's group, ``Shard`` on its
        dim; every other optimizer leaf ``Replicate``. No data moves to make them. So the optimizer, the norms and
        the health statistics are written for whole tensors and take no collective of their own: a norm of a
        sharded leaf is a partial sum that DTensor makes whole (one all-reduce where the code asks for it,
        ``core.tree.whole``). The new state comes back as this rank's shards (plain tensors), the metrics as plain
        whole values. ``params``: the part of :attr:`params` the state's params are (all of them by default; the
        trainable part of a student whose optimizer state :attr:`opt` follows it)."""
        mesh = self.mesh(device_type)
        specs = self.params if params is None else params

        def run(state, grads, loss, aux, due=None):
            state = state._replace(params=self._views(state.params, specs, mesh),
                                   opt_state=self._views(state.opt_state, self.opt, mesh))
            new, metrics = apply(state, self._views(grads, specs, mesh), loss, aux, due=due)
            return tree_map(_local, new), tree_map(_local, metrics)
        return run

    def mesh(self, device_type: str):
        """The ``DeviceMesh`` the update's DTensors live on: 1-D over the layout's group; 2-D (``dp``, ``tp``) with
        tensor parallelism, so a norm of a leaf split both ways sums over both."""
        from torch.distributed.device_mesh import DeviceMesh
        import torch.distributed as dist
        if self.tensor is None:
            return DeviceMesh.from_group(self.group or dist.group.WORLD, device_type)
        return self.tensor.mesh_2d

    def _views(self, tree, specs, mesh):
        """``tree``'s leaves as DTensors on ``mesh`` (:meth:`on_dtensors`): ``Shard`` on the layout's dim, and on
        the tensor-parallel split dim under ``tensor``; else ``Replicate``."""
        from torch.distributed.tensor import DTensor, Replicate, Shard
        tp = self.tensor

        def one(x, spec):
            if not isinstance(x, torch.Tensor):
                return x
            places = [Replicate() if spec.dim is None else Shard(spec.dim)]
            if tp is not None:
                places.append(Replicate() if spec.tp_dim is None else Shard(spec.tp_dim))
            if spec.dim is None and spec.tp_dim is None:
                return DTensor.from_local(x, mesh, places, run_check=False)
            full = list(x.shape)
            if spec.dim is not None:
                full[spec.dim] *= self.world
            if spec.tp_dim is not None:
                full[spec.tp_dim] *= tp.size
            return DTensor.from_local(x, mesh, places, run_check=False, shape=torch.Size(full),
                                      stride=torch.empty(full, device="meta").stride())
        return tree_map(one, tree, specs)

    def around(self, gradients: Callable, specs=None) -> Callable:
        """``gradients(full params, *args) -> (grads, loss, aux)`` as a function of this rank's shards: the params
        gathered whole (:meth:`gather`), the summed full gradients reduce-scattered to this rank's shard of their
        mean and the loss and aux averaged (:meth:`reduce`; ``specs``: the part of :attr:`params` the gradients
        cover). What a step compiled as one graph runs; the one-block-at-a-time gathering is
        ``core.parallel.shard_blocks``."""
        def sharded(params, *args):
            return self.reduce(*gradients(self.gather(params), *args), specs=specs)
        return sharded

    def gather(self, params):
        """The full params from this rank's shards: one all-gather per dtype (under ``tensor``: this
        tensor-parallel rank's pieces, what its step computes with; :meth:`gather_whole` joins those too)."""
        shards, specs = zip_leaves(params, self.params)
        return like(params, self.gather_leaves(shards, specs), order=params)

    def gather_whole(self, params):
        """The params whole from this rank's shards, as one process holds them (a sample's decode, an export)."""
        full = self.gather(params)
        if self.tensor is None:
            return full
        return tree_map(lambda x, spec: x if spec.tp_dim is None else self.tensor.gather(x, spec.tp_dim), full,
                        self.params)

    def gather_leaves(self, shards: list, specs: list, join: Optional[Callable] = None) -> list:
        """Full leaves from this rank's ``shards`` of leaves split as ``specs`` say (in ``gather_dtype``): one
        all-gather per dtype; ``join(pieces [W, shard numel], spec)`` makes each leaf (:meth:`_join`)."""
        return self.join_gathered(self.launch_gather(shards), specs, join)

    def launch_gather(self, shards: list) -> list:
        """The all-gathers of :meth:`gather_leaves` (one per dtype), started and not waited for: eagerly each runs
        in the process group's background while this rank computes, until :meth:`join_gathered` reads it."""
        if self.gather_dtype is not None:
            shards = [s.to(self.gather_dtype) if s.is_floating_point() else s for s in shards]
        launched = []
        for dtype in sorted({s.dtype for s in shards}, key=str):
            idx = [i for i, s in enumerate(shards) if s.dtype == dtype]
            flat = torch.cat([shards[i].reshape(-1) for i in idx])
            launched.append((idx, [shards[i].numel() for i in idx], all_gather(flat, self.group)))
        return launched

    def join_gathered(self, launched: list, specs: list, join: Optional[Callable] = None) -> list:
        """The full leaves from :meth:`launch_gather`'s all-gathers (waiting for them), in ``specs``' order."""
        join = join or self._join
        out: list = [None] * len(specs)
        for idx, sizes, every in launched:
            every, offset = every.view(self.world, -1), 0
            for i, n in zip(idx, sizes):
                out[i] = join(every[:, offset:offset + n], specs[i])
                offset += n
        return out

    def _join(self, pieces: torch.Tensor, spec: LeafSpec) -> torch.Tensor:
        """``[W, shard numel]`` -> the full leaf (the shards concatenated on ``spec.dim``, padding dropped)."""
        local = spec.local_shape()
        x = pieces.reshape((self.world,) + local).movedim(0, spec.dim)
        merged = local[:spec.dim] + (self.world * spec.chunk,) + local[spec.dim + 1:]
        return x.reshape(merged).narrow(spec.dim, 0, spec.size).reshape(spec.shape)

    def _rows(self, g: torch.Tensor, spec: LeafSpec) -> torch.Tensor:
        """A full gradient as ``[W, shard numel]`` in float32, row r being rank r's shard (padding zero)."""
        g = g.to(torch.float32).reshape(spec.shape or (1,))
        pad = spec.chunk * self.world - spec.size
        if pad:
            shape = list(g.shape)
            shape[spec.dim] = pad
            g = torch.cat([g, g.new_zeros(shape)], dim=spec.dim)
        full = g.shape
        g = g.reshape(full[:spec.dim] + (self.world, spec.chunk) + full[spec.dim + 1:])
        return g.movedim(spec.dim, 0).reshape(self.world, -1)

    def reduce(self, grads, loss: torch.Tensor, aux: dict, specs=None):
        """Full summed gradients -> this rank's shard of their mean over ranks (one reduce-scatter);
        the loss and the aux metrics (any shape) averaged over ranks (one ``all_reduce``). ``specs``: the part
        of :attr:`params` that ``grads`` covers (all of it by default)."""
        full, specs = zip_leaves(grads, self.params if specs is None else specs)
        summed = self.reduce_rows([self._rows(g, s) for g, s in zip(full, specs)])
        # gradients of params gathered in bf16 stay fp32, for the fp32 shards
        layout = [(s.local_shape(), torch.float32 if self.gather_dtype is not None and g.dtype == self.gather_dtype
                   else g.dtype) for g, s in zip(full, specs)]
        out = split_mean(summed, layout, self.averaged)
        names = sorted(aux)
        loss, *rest = mean_over_ranks([loss] + [aux[k] for k in names], *self.everyone)
        return like(grads, out, order=grads), loss, dict(zip(names, rest))

    def reduce_rows(self, rows: list) -> torch.Tensor:
        """Float32 ``[W, n_i]`` blocks (row r: rank r's part) -> this rank's parts, concatenated, of their sum over
        ranks: one reduce-scatter (eagerly in flight until read)."""
        if not rows:
            return torch.zeros(0)
        summed = reduce_scatter_sum(torch.cat(rows, dim=1).reshape(-1), self.group)
        return summed if self.replicas is None else all_reduce_sum(summed, self.replicas[0])

    @property
    def averaged(self) -> int:
        """How many ranks' gradients a step averages: the shards' ``world``, times the replicas under HSDP."""
        return self.world * (1 if self.replicas is None else self.replicas[1])

    @property
    def everyone(self) -> tuple:
        """``(group, size)`` the loss and aux metrics are averaged over: the layout's group, or every rank under
        HSDP (the default group)."""
        if self.replicas is None:
            return self.group, self.world
        import torch.distributed as dist
        return dist.group.WORLD, self.averaged

    @property
    def stacks(self) -> bool:
        """Whether a param leaf is stacked along a layer axis (sharded on dim 1): a step run block by block gathers
        those a layer at a time, through the model's ``layers`` (``core.parallel.shard_blocks``, ``core.layers``)."""
        return any(spec.dim == 1 for spec in leaves_of(self.params))

    def blocks(self, shards, train: bool = True):
        """A step's per-block gathering of ``shards`` (``core.parallel.shard_blocks.Blocks``)."""
        from purestep.core.parallel.shard_blocks import Blocks
        return Blocks(self, shards, train)

def _local(x):
    """A DTensor as a plain tensor: a shard as this rank's shard, anything else (replicated, partial) whole."""
    from torch.distributed.tensor import DTensor, Shard
    if not isinstance(x, DTensor):
        return x
    return x.to_local() if any(isinstance(p, Shard) for p in x.placements) else x.full_tensor()


def full_bytes(layout: Optional[Layout], state) -> int:
    """Bytes the params and optimizer state of ``state`` take in one process (all shards joined)."""
    if layout is None:
        return state_bytes(state)

    def one(t, spec):
        if not isinstance(t, torch.Tensor):
            return 0
        return (t.numel() if spec.dim is None else math.prod(whole_shape(spec, layout.tensor))) * t.element_size()
    return sum(one(t, s) for t, s in zip(*zip_leaves((state.params, state.opt_state), (layout.params, layout.opt))))


def state_bytes(state) -> int:
    """Bytes of this rank's params and optimizer state."""
    return sum(t.numel() * t.element_size() for t in leaves_of((state.params, state.opt_state))
               if isinstance(t, torch.Tensor))
