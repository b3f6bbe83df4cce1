"""Data parallel on ``torch.distributed`` for the pure step (launch with ``torchrun``).

Each rank reads its own rows of the same global batch (``core.data.Batches(rank=, world_size=)``), and
the step averages gradients, the loss and its aux metrics across ranks *inside* the step with one
bucketed all-reduce: every leaf is flattened into one float32 buffer, reduced with a functional
collective (``torch.distributed._functional_collectives.all_reduce``, which dynamo traces, so the
compiled step stays one graph), and split back. Since every rank then sees the same gradients and loss,
every rank takes the same non-finite skip and the same spike decision; host-side decisions that come
from local signals (preemption, the cost budget) are agreed with :meth:`Dist.agree`. Rank 0 alone writes
checkpoints and logs. NCCL on GPUs, gloo on CPU.

Sharded parallel (``parallel=fsdp``: params, gradients and optimizer state split across ranks) is
``core.shard``; this file joins the process group for both and says which one a run uses (:class:`Dist`).
``parallel``: ``auto`` is data parallel under ``torchrun`` and one process without it; ``ddp`` and ``fsdp``
need a launcher (``torchrun`` sets ``WORLD_SIZE``), ``none`` refuses one with several ranks. The process group
is joined with a short ``timeout`` (``PG_TIMEOUT``): when a peer dies, the survivors' next collective fails
within it instead of hanging for gloo's and NCCL's default 10-30 minutes.
"""
from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from core.config import ConfigError

PARALLEL = ("auto", "none", "ddp", "fsdp")
PG_TIMEOUT = 45.0     # seconds a collective waits for a peer before the survivors stop (a dead rank)


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    sharded: bool = False     # parallel=fsdp: the state is split across ranks (core.shard)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def all_reduce_mean(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Average tensors across ranks with one collective (traceable inside a compiled step)."""
        if not self.enabled or not leaves:
            return leaves
        import torch.distributed._functional_collectives as funcol
        flat = torch.cat([t.reshape(-1).to(torch.float32) for t in leaves])
        flat = funcol.all_reduce(flat, "sum", dist.group.WORLD) / self.world_size
        out, offset = [], 0
        for t in leaves:
            out.append(flat[offset:offset + t.numel()].reshape(t.shape).to(t.dtype))
            offset += t.numel()
        return out

    def agree(self, flag: bool) -> bool:
        """True on every rank if it is true on any rank (a host-side decision all ranks must share)."""
        if not self.enabled:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def each(self, value: float) -> list[float]:
        """``value`` of every rank, in rank order, on every rank (host-side telemetry: state bytes, peak memory)."""
        if not dist.is_initialized():
            return [value]
        t = torch.zeros(self.world_size, dtype=torch.float64, device=_collective_device())
        t[self.rank] = value
        dist.all_reduce(t)
        return t.tolist()

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    @contextmanager
    def main_first(self):
        """Run the block on rank 0 first, then on the others (e.g. building a shared cache)."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def init(device: torch.device, parallel: str = "auto", timeout: float = PG_TIMEOUT) -> tuple[Dist, torch.device]:
    """Join the process group ``torchrun`` describes (``WORLD_SIZE`` > 1, or any ``WORLD_SIZE`` with
    ``parallel=fsdp``), else a single-process ``Dist``; ``parallel`` as in the module docstring.

    On CUDA each rank takes ``cuda:LOCAL_RANK`` and NCCL; elsewhere gloo on the given device.
    """
    if parallel not in PARALLEL:
        raise ConfigError(f"parallel={parallel}: choose one of {', '.join(PARALLEL)}")
    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if parallel in ("ddp", "fsdp") and not launched:
        raise ConfigError(f"parallel={parallel} needs a launcher: run it under torchrun "
                          f"(torchrun --nproc_per_node=N bin/run ...), or use parallel=none")
    if parallel == "none" and world > 1:
        raise ConfigError(f"parallel=none under a launcher with {world} ranks; use parallel=ddp or parallel=fsdp")
    sharded = parallel == "fsdp"
    if world <= 1 and not sharded:
        return Dist(), device
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    if device.type == "cuda":
        device = torch.device("cuda", local)
    return Dist(rank, world, local, sharded), device


def shutdown() -> None:
    """Leave the process group once every rank is done: a rank that destroys it while rank 0 still writes its
    last checkpoint can take gloo's worker threads down with it (an abort at exit, seen on 2 CPU ranks)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
