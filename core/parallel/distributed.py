"""Data parallel on ``torch.distributed`` for the pure step (launch with ``torchrun``).

Each rank reads its own rows of the same global batch (``core.data.text.Batches(rank=, world_size=)``), and
the step averages gradients, the loss and its aux metrics across ranks *inside* the step with one
bucketed all-reduce: every leaf is flattened into one float32 buffer, reduced with a functional
collective (``torch.distributed._functional_collectives.all_reduce``, which dynamo traces, so the
compiled step stays one graph), and split back. Since every rank then sees the same gradients and loss,
every rank takes the same non-finite skip and the same spike decision; host-side decisions that come
from local signals (preemption, the cost budget) are agreed with :meth:`Dist.agree`. Rank 0 alone writes
checkpoints and logs. NCCL on GPUs, gloo on CPU.

Sharded parallel (``parallel=fsdp``: params, gradients and optimizer state split across ranks) is
``core.parallel.shard``; this file joins the process group for both and says which one a run uses (:class:`Dist`).
``parallel``: ``auto`` is data parallel under ``torchrun`` and one process without it; ``ddp`` and ``fsdp``
need a launcher (``torchrun`` sets ``WORLD_SIZE``), ``none`` refuses one with several ranks. The process group
is joined with a short ``timeout`` (``PG_TIMEOUT``): when a peer dies, the survivors' next collective fails
within it instead of hanging for gloo's and NCCL's default 10-30 minutes.
"""
from __future__ import annotations

import datetime
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from purestep.core.config import ConfigError, UserError

PARALLEL = ("auto", "none", "ddp", "fsdp", "fsdp,tp", "hsdp")
SHARDED = ("fsdp", "fsdp,tp", "hsdp")   # the parallel modes that split the state across ranks (core.parallel.shard)
MESH_DIMS = {"fsdp,tp": ("dp", "tp"), "hsdp": ("rep", "dp")}    # the 2-D modes' mesh=, outer dim first
PG_TIMEOUT = 45.0     # seconds a collective waits for a peer before the survivors stop (a dead rank)
PATIENCE = 6 * 3600.0   # seconds a barrier waits while one rank works alone (tokenizing, writing a checkpoint)
_KEY = "purestep/rank/{}"   # each rank's host:pid in the process group's store: who died, when one does


class PeerLost(UserError):
    """A collective failed because another rank died or stopped answering: this rank stops without a save."""


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    sharded: bool = False     # parallel=fsdp: the state is split across ranks (core.parallel.shard)
    patient: Any = field(default=None, compare=False, repr=False)   # the gloo group barriers wait on, with
    #                                                                 PATIENCE (None: the default group)
    tensor: Any = field(default=None, compare=False, repr=False)    # parallel=fsdp,tp: this rank's
    #                                                                 core.parallel.tensor.TensorParallel
    hybrid: Any = field(default=None, compare=False, repr=False)    # parallel=hsdp: the (rep, dp) DeviceMesh

    @property
    def data_rank(self) -> int:
        """Which rows of a global batch this rank reads: its data-parallel rank (the ranks of one tensor-parallel
        group read the same rows)."""
        return self.rank if self.tensor is None else self.rank // self.tensor.size

    @property
    def data_world(self) -> int:
        """How many data-parallel ranks split a global batch."""
        return self.world_size if self.tensor is None else self.world_size // self.tensor.size

    @property
    def data_group(self):
        """The process group the data-parallel ranks reduce over (the default group without tensor parallelism)."""
        return dist.group.WORLD if self.tensor is None else self.tensor.mesh_2d["dp"].get_group()

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
        return mean_over_ranks(leaves, dist.group.WORLD, self.world_size)

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

    def share(self, value):
        """Rank 0's ``value`` (any picklable object) on every rank."""
        if not self.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.patient)
        return box[0]

    def barrier(self) -> None:
        """Wait for every rank, patiently (``PATIENCE``): one of them may be working alone."""
        if self.enabled:
            dist.barrier(group=self.patient)

    def lost_peer(self, error: BaseException, newest=None) -> Optional[PeerLost]:
        """``error`` as a :class:`PeerLost` naming the dead rank(s) when it is a failed collective of a run on
        several ranks (a peer crashed, was killed, or passed ``PG_TIMEOUT``); None for any other error.
        ``newest``: the checkpoint the run resumes from, for the message."""
        if not self.enabled or not isinstance(error, (RuntimeError, dist.DistError)) or \
                not any(w in str(error) for w in ("by peer", "Gloo", "gloo", "NCCL", "imed out", "Timeout")):
            return None
        dead = _dead_ranks(self)
        who = (f"rank {', '.join(map(str, dead))} of {self.world_size} died" if dead else
               f"a peer rank stopped answering (on another host; torchrun's summary names it)")
        resume = f"the newest checkpoint, {newest}, is intact: rerun the same command to resume" if newest else \
            "rerun the same command to resume from the newest checkpoint"
        return PeerLost(f"rank {self.rank}: {who} ({str(error).splitlines()[0][:160]}); stopped without a "
                        f"checkpoint; {resume}")

    @contextmanager
    def main_first(self):
        """Run the block on rank 0 first, then on the others (e.g. building a shared cache)."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()


# The functional collectives (``torch.distributed._functional_collectives``): the only collectives dynamo traces
# into a compiled step, and private, so every use goes through these four (``tests/test_torch_api.py`` runs them
# on the installed torch). Torch 2.11 has ``all_gather_tensor`` and ``reduce_scatter_tensor``; 2.13 and 2.14 call them
# ``all_gather_single`` and ``reduce_scatter_single`` and warn that the old names are deprecated.

def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over the ranks of ``group`` (every rank gets the sum)."""
    import torch.distributed._functional_collectives as funcol
    return funcol.all_reduce(x, "sum", group)


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x`` concatenated on dim 0, in rank order."""
    import torch.distributed._functional_collectives as funcol
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return gather(x, 0, group)


def reduce_scatter_sum(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over the ranks, cut into as many equal parts on dim 0 as there are ranks: rank r's part."""
    import torch.distributed._functional_collectives as funcol
    scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    return scatter(x, "sum", 0, group)


def wait(x: torch.Tensor) -> torch.Tensor:
    """The collective's result as a plain tensor, once it has arrived (eager code before reading it)."""
    import torch.distributed._functional_collectives as funcol
    return funcol.wait_tensor(x)


def mean_over_ranks(leaves: list[torch.Tensor], group, world: int) -> list[torch.Tensor]:
    """``leaves`` (any shapes and dtypes) averaged over the ``world`` ranks of ``group``: one float32 buffer, one
    functional ``all_reduce`` (which dynamo traces), split back into each leaf's shape and dtype."""
    flat = torch.cat([t.reshape(-1).to(torch.float32) for t in leaves])
    flat = all_reduce_sum(flat, group)
    return split_mean(flat, [(t.shape, t.dtype) for t in leaves], world)


def split_mean(flat: torch.Tensor, layout: list, world: int) -> list[torch.Tensor]:
    """``flat`` (a sum over ``world`` ranks) cut into leaves of ``layout``'s ``(shape, dtype)``s and divided by
    ``world``, each leaf a tensor of its own, not a view of ``flat``: in a compiled step ``torch.cond`` (gradient
    health's gate, ``optim.health``) refuses operands that alias one another, and inductor writes each quotient
    straight into its leaf, so this costs no more than dividing ``flat`` whole."""
    out, offset = [], 0
    for shape, dtype in layout:
        n = math.prod(shape)
        out.append((flat[offset:offset + n] / world).reshape(shape).to(dtype))
        offset += n
    return out


def _dead_ranks(d: Dist) -> list[int]:
    """The ranks on this host whose process is gone (or a zombie), from the host:pid each rank put in the store."""
    import socket
    try:
        store = dist.distributed_c10d._get_default_store()
        entries = [store.get(_KEY.format(r)).decode() if store.check([_KEY.format(r)]) else ""
                   for r in range(d.world_size)]
    except Exception:  # noqa: BLE001 - the store may have died with its host rank: name nobody
        return []
    dead = []
    for r, entry in enumerate(entries):
        host, _, pid = entry.rpartition(":")
        if r != d.rank and host == socket.gethostname() and not _alive(int(pid)):
            dead.append(r)
    return dead


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _register(rank: int, world: int):
    """Put this rank's host:pid in the store; the patient group for barriers (``Dist.patient``)."""
    import socket
    try:
        dist.distributed_c10d._get_default_store().set(_KEY.format(rank), f"{socket.gethostname()}:{os.getpid()}")
    except Exception:  # noqa: BLE001 - naming a dead rank is a courtesy, never a reason not to train
        pass
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=PATIENCE))


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def init(device: torch.device, parallel: str = "auto", timeout: float = PG_TIMEOUT,
         mesh: str = "") -> tuple[Dist, torch.device]:
    """Join the process group ``torchrun`` describes (``WORLD_SIZE`` > 1, or any ``WORLD_SIZE`` with
    ``parallel=fsdp``), else a single-process ``Dist``; ``parallel`` as in the module docstring. ``parallel=fsdp,tp``
    lays the ranks out on the 2-D ``mesh`` (``dp:D,tp:T``, :func:`parse_mesh`; ``core.parallel.tensor.mesh``).

    On CUDA each rank takes ``cuda:LOCAL_RANK`` and NCCL; elsewhere gloo on the given device.
    """
    if parallel not in PARALLEL:
        raise ConfigError(f"parallel={parallel}: choose one of {', '.join(PARALLEL)}")
    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if parallel in ("ddp", *SHARDED) and not launched:
        raise ConfigError(f"parallel={parallel} needs a launcher: run it under torchrun "
                          f"(torchrun --nproc_per_node=N purestep ...), or use parallel=none")
    if parallel == "none" and world > 1:
        raise ConfigError(f"parallel=none under a launcher with {world} ranks; use parallel=ddp or parallel=fsdp")
    shape = parse_mesh(mesh, world, MESH_DIMS[parallel]) if parallel in MESH_DIMS else None
    if parallel == "fsdp,tp" and device.type == "cpu" and cpu_tensor_parallel_refusal():
        raise ConfigError(cpu_tensor_parallel_refusal())
    sharded = parallel in SHARDED
    if world <= 1 and not sharded:
        return Dist(), device
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    patient = None    # a group joined by someone else: barriers wait on its default group
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        patient = _register(rank, world)
    if device.type == "cuda":
        device = torch.device("cuda", local)
    tensor = hybrid = None
    if parallel == "fsdp,tp":
        from purestep.core.parallel.tensor import mesh as tensor_mesh
        tensor = tensor_mesh(device.type, *shape)
    elif parallel == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        hybrid = init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS["hsdp"])
    return Dist(rank, world, local, sharded, patient, tensor, hybrid), device


def cpu_tensor_parallel_refusal() -> str:
    """Why this torch cannot run ``parallel=fsdp,tp`` on the CPU ("" when it can): before 2.14, SDPA's math kernel
    (the CPU path of ``core.parallel.tensor``) flattens batch and heads into one dim, which DTensor refuses for heads
    sharded across ranks (torch 2.11: "Attempted to flatten multiple dimensions, with dimension 1 being sharded")."""
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version >= (2, 14):
        return ""
    return (f"parallel=fsdp,tp on the CPU needs torch >= 2.14 (this is {torch.__version__}): its attention kernel "
            f"flattens the heads that tensor parallel splits")


def parse_mesh(mesh: str, world: int, dims: tuple = ("dp", "tp")) -> tuple[int, int]:
    """``A:a,B:b`` for the mesh dims ``(A, B)`` -> ``(a, b)``, whose product must be the ``world`` size; a
    ConfigError naming the key otherwise (``dp:D,tp:T`` for ``parallel=fsdp,tp``, ``rep:R,dp:D`` for ``hsdp``)."""
    sizes = {}
    for part in filter(None, mesh.split(",")):
        name, _, size = part.partition(":")
        if name not in dims or not size.isdigit() or int(size) < 1 or name in sizes:
            sizes = None
            break
        sizes[name] = int(size)
    form = ",".join(f"{d}:{d[0].upper()}" for d in dims)
    if not sizes or set(sizes) != set(dims):
        mode = "fsdp,tp" if dims == MESH_DIMS["fsdp,tp"] else "hsdp"
        raise ConfigError(f"mesh={mesh!r}: parallel={mode} needs mesh={form} (e.g. mesh={dims[0]}:2,{dims[1]}:2)")
    a, b = sizes[dims[0]], sizes[dims[1]]
    if a * b != world:
        raise ConfigError(f"mesh={mesh}: {dims[0]} x {dims[1]} = {a * b} ranks, but torchrun started {world}")
    return a, b


def shutdown(d: Dist) -> None:
    """Leave the process group ``d`` joined (:func:`init`) once every rank is done: a rank that destroys it while
    rank 0 still writes its last checkpoint can take gloo's worker threads down with it (an abort at exit, seen on
    2 CPU ranks)."""
    if dist.is_initialized():
        dist.barrier(group=d.patient)
        dist.destroy_process_group()
