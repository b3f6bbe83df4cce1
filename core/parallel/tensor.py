"""Tensor parallelism by DTensor placements, applied to each block from outside the model.

Megatron-LM's split of a transformer block (Shoeybi et al. 2019, arXiv 1909.08053), written as torchtitan writes
it with ``parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel``, the TP plan of its Llama): the
attention's query, key and value projections and the MLP's gate and up projections are split on their output
features across the ``tp`` ranks of a mesh (column parallel, ``Shard(0)`` of an ``[out, in]`` weight), the
attention's output projection and the MLP's down projection on their input features (row parallel,
``Shard(1)``). So each rank computes ``n_heads / tp`` query heads, ``n_kv_heads / tp`` KV heads and ``d_ff / tp``
hidden units, and each row-parallel product is a partial sum that DTensor makes whole (one all-reduce) before the
residual add. The norms, the embedding and the head are replicated.

How it is applied: the model's loop takes its layers from ``layers.unstack`` and hands each to
``layers.block(block_fn)`` (``core.layers``). The step's per-block gathering (``core.parallel.shard_blocks``) hands
out each layer's params as ``DTensor.from_local`` views of this rank's pieces (:meth:`TensorParallel.place`,
placements from :data:`LLAMA_PLAN`), and :meth:`TensorParallel.block` wraps the block function: on such a layer the
block's tensor inputs (the residual stream, RoPE tables) become ``Replicate`` DTensors and its output leaves as a
plain, replicated tensor; a layer of plain tensors (a frozen teacher's, whole on every rank) runs as it is. Autograd through ``from_local`` returns plain gradients of this rank's pieces, the replicated
leaves' gradients summed over the ``tp`` ranks where DTensor holds them as partial sums. Outside the blocks the
model runs on plain tensors, identical on every ``tp`` rank. The model is unchanged.

Where the block's math needs it: plain tensors the block makes for itself (the causal mask inside SDPA's math
kernel) are taken as replicated (``implicit_replication``), and on the CPU, where DTensor has no sharding rule for
the fused CPU attention kernel, SDPA runs its math kernel (CUDA's flash and memory-efficient kernels have rules).

With ``parallel=fsdp,tp`` (``recipes``: ``mesh=dp:D,tp:T``) the state is first split across the ``tp`` ranks of
each data-parallel group by :meth:`TensorParallel.local`, then sharded across the ``dp`` ranks
(``core.parallel.shard.Layout(tensor=...)``), as torchtitan's 2-D FSDP2 + TP holds it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from purestep.core.tree import tree_leaves, tree_map_with_name

# torchtitan's Llama TP plan: the weights split on their output features (column parallel) and on their input
# features (row parallel), by their leaf names in a Llama layer (``models.llama``)
LLAMA_PLAN = {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise",
              "w_gate": "colwise", "w_up": "colwise", "w_down": "rowwise"}


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place on a 2-D ``DeviceMesh`` ``mesh_2d`` of dims (``dp``, ``tp``): ``rank`` among the ``size``
    ranks of its tensor-parallel group, and the ``plan`` that says which layer leaves are split (module
    docstring). :func:`mesh` builds one."""
    size: int
    rank: int
    mesh_2d: Any = field(compare=False, repr=False)
    plan: dict = field(default_factory=lambda: dict(LLAMA_PLAN))

    @property
    def mesh(self):
        """The 1-D mesh of this rank's tensor-parallel group."""
        return self.mesh_2d["tp"]

    @property
    def group(self):
        return self.mesh.get_group()

    def dim(self, name: str, leaf: torch.Tensor, stacked: bool = True) -> Optional[int]:
        """The dim of ``leaf`` (named ``name`` in the params) that this plan splits, or None: the output
        features of a column-parallel weight, the input features of a row-parallel one; ``stacked``: the leaf has
        a leading layer axis (``layers.*``)."""
        if stacked and not name.startswith("layers."):
            return None
        kind = self.plan.get(name.rsplit(".", 1)[-1])
        if kind is None:
            return None
        return leaf.ndim - (2 if kind == "colwise" else 1)

    def check(self, params) -> None:
        """A ValueError naming the first planned leaf whose split dim does not divide by ``size``."""
        def one(name, p):
            d = self.dim(name, p)
            if d is not None and p.shape[d] % self.size:
                raise ValueError(f"tensor parallel over {self.size} ranks: {name} of shape {tuple(p.shape)} has "
                                 f"{p.shape[d]} features on its split dim, not a multiple of {self.size}")
        tree_map_with_name(one, params)

    def local(self, params):
        """This rank's pieces of full ``params`` (plain tensors; every unplanned leaf whole)."""
        def one(name, p):
            d = self.dim(name, p)
            return p if d is None else p.chunk(self.size, d)[self.rank].clone()
        return tree_map_with_name(one, params)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """A leaf split on ``dim`` made whole from every rank's piece (eager; checkpoints)."""
        import torch.distributed as dist
        pieces = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(pieces, x.contiguous(), group=self.group)
        return torch.cat(pieces, dim=dim)

    def place(self, layer):
        """One layer's params (this rank's pieces, plain) as DTensors on :attr:`mesh`: each planned leaf ``Shard`` on
        its split dim, the others ``Replicate``. The step's per-block gathering calls it on the layers it hands the
        model (``core.parallel.shard_blocks``), so a block :meth:`block` wraps knows its own layers from another
        model's (a frozen teacher's, run whole)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        def placed(name: str, p):
            if not isinstance(p, torch.Tensor):
                return p
            d = self.dim(name, p, stacked=False)
            return DTensor.from_local(p, self.mesh, [Replicate() if d is None else Shard(d)], run_check=False)
        return tree_map_with_name(placed, layer)

    def block(self, fn: Callable) -> Callable:
        """``fn`` (a model's block, ``fn(layer params, x, *args, **kwargs) -> x``) run tensor parallel where the
        layer is placed (:meth:`place`): every other tensor argument ``Replicate``, the output a plain tensor. A
        layer of plain tensors (a frozen teacher's) runs ``fn`` as it is."""
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor.experimental import implicit_replication
        mesh = self.mesh

        def replicated(t):
            return DTensor.from_local(t, mesh, [Replicate()], run_check=False) if isinstance(t, torch.Tensor) else t

        def run(layer, *args, **kwargs):
            if not any(isinstance(t, DTensor) for t in tree_leaves(layer)):
                return fn(layer, *args, **kwargs)
            args = [replicated(a) for a in args]
            kwargs = {k: replicated(v) for k, v in kwargs.items()}
            with implicit_replication(), _attention_kernels(mesh.device_type):
                out = fn(layer, *args, **kwargs)
            return out.full_tensor() if isinstance(out, DTensor) else out
        return run


def _attention_kernels(device_type: str):
    """SDPA's math kernel on the CPU, where DTensor has no sharding rule for the fused CPU kernel; the default
    choice elsewhere."""
    import contextlib
    if device_type != "cpu":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.MATH)


def mesh(device_type: str, dp: int, tp: int) -> TensorParallel:
    """This rank's :class:`TensorParallel` on a new (``dp``, ``tp``) mesh over the joined process group
    (``init_device_mesh``: rank ``r`` is data-parallel rank ``r // tp`` and tensor-parallel rank ``r % tp``)."""
    from torch.distributed.device_mesh import init_device_mesh
    grid = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return TensorParallel(tp, grid["tp"].get_local_rank(), grid)
