"""Benchmark: memory per rank under ``parallel=fsdp``, and the all-gathers overlapping compute.

``purestep recipe=bench.fsdp [preset=100m] [ranks=4] [key=value ...]`` (``--help`` lists the keys).

Three launches of the same train step (``core.step.make_train_step``, AdamW with global clipping, the state donated
as the recipes run it) on the same Llama,
every process with the same rows (``batch_size`` x ``block_size``), one after the other:

- ``one process``: the step unsharded, the baseline of memory;
- ``fsdp, prefetch``: ``ranks`` ranks under ``torchrun`` (gloo on a CPU, NCCL on GPUs), the step gathered one block
  at a time (``core.parallel.shard_blocks``) as ``parallel=fsdp`` runs it: each layer's all-gather started one
  layer ahead (forward down the layers, backward up them) and each layer's reduce-scatter waited for one layer
  later, so both run while a block computes (FSDP2's implicit prefetch);
- ``fsdp, blocking``: the same with ``Layout(prefetch=False)``: each all-gather and reduce-scatter waited for as it
  is issued (the schedule before issue 51).

Each process reports its state bytes (params and optimizer state: the 1/N of sharding), its gradient bytes, its
memory once the state is built and its peak over the timed steps (resident set on a CPU, the allocator on CUDA),
and the median ms/step. One more step runs under ``torch.profiler``: per kind of collective, the time it was in
flight (gloo's event on its worker thread; NCCL's kernel) and the share of it during which a matmul ran (the main
thread's ``aten::mm``/``addmm``/``bmm`` on a CPU, any other kernel on CUDA). Rank 0's trace of ``fsdp, prefetch`` is
``OUT/trace.json`` (open it in Perfetto or chrome://tracing); every figure is in ``OUT/results.json``.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from purestep.core.config import ConfigError, option, same_as
from purestep.core.cli.runs import run_folder
from purestep.core.io.logging import memory_mb, progress, reset_peak_memory
from purestep.core.tree import leaves_of
from purestep.recipes.bench.common import StepBench, model_and_batch

DESCRIPTION = "memory per rank under parallel=fsdp against one process, and the all-gathers overlapping compute"
VARIANTS = ("one process", "fsdp, prefetch", "fsdp, blocking")
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
NCCL_KINDS = {"AllGather": "all_gather", "ReduceScatter": "reduce_scatter", "AllReduce": "all_reduce"}


@dataclass
class Config:
    d_model: int = same_as(StepBench, "d_model")
    n_layers: int = same_as(StepBench, "n_layers")
    n_heads: int = same_as(StepBench, "n_heads")
    n_kv_heads: int = same_as(StepBench, "n_kv_heads")
    vocab_size: int = same_as(StepBench, "vocab_size")
    block_size: int = same_as(StepBench, "block_size")
    batch_size: int = option(2, "sequences per step in every process", min=1)
    ranks: int = option(4, "ranks of the sharded launches (torchrun --nproc_per_node)", min=2)
    warmup: int = option(2, "untimed steps per launch (compilation happens here)", min=1)
    steps: int = option(3, "timed steps per launch (their median is the time per step)", min=1)
    compile: bool = option(False, "compile the block (compile_scope=block, as compile_scope=auto compiles a sharded "
                                  "model of more than 4 layers); eager keeps a CPU run short")
    threads: int = option(1, "torch.set_num_threads in every process (1: ranks * threads cores)", min=1)
    seed: int = same_as(StepBench, "seed")
    device: str = same_as(StepBench, "device")
    out: str = option("", "result folder (empty: runs/bench-fsdp-NAME)")
    name: str = option("", "run name under runs/ (empty: a timestamp)")

    def __post_init__(self):
        if self.device == "cuda" and torch.cuda.device_count() < self.ranks:
            raise ConfigError(f"ranks={self.ranks} on CUDA needs that many GPUs; this machine has "
                              f"{torch.cuda.device_count()}")


PRESETS = {
    "100m": {"vocab_size": 32000, "d_model": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4,
             "batch_size": 2, "block_size": 128},
}


def _build(cfg: Config, variant: str, dist, device):
    """The step, this process's (sharded) state and the batch of ``variant``."""
    import torch.distributed as torch_dist
    from purestep.core.parallel.shard import Layout
    from purestep.core.state import init_state
    from purestep.core.step import Compile, Parallel, make_train_step
    from purestep.models import llama
    from purestep.optim.health import stacked_predicate
    from purestep.recipes.train.optimizer import OptimizerSpec, make_optimizer
    model_cfg, params, batch = model_and_batch(cfg)      # on cfg.device: a rank's own GPU (distributed.init)
    spec = OptimizerSpec(lr=1e-3, clipping="global")
    layout = None
    if dist.sharded:
        layout = Layout(params, make_optimizer(spec).init, stacked=stacked_predicate(None), world=dist.world_size,
                        rank=dist.rank, group=torch_dist.group.WORLD, prefetch=variant == "fsdp, prefetch")
    opt = make_optimizer(spec, sharded=layout is not None)
    step = make_train_step(lambda p, b, layers=None: llama.loss(p, b, model_cfg, layers=layers), opt,
                           compile=Compile(cfg.compile, scope="block"), parallel=Parallel(shard=layout),
                           donate=True)        # as the recipes run it
    return step, init_state(layout.shard_params(params) if layout else params, opt), batch   # moments as shards


def _one(step, state, batch):
    state, metrics = step(state, batch)
    metrics["loss"].item()       # waits for the step (CUDA)
    return state


def measure(cfg: Config, variant: str, trace: Path | None = None) -> dict:
    """One process's figures (module docstring); ``trace``: where rank 0 writes its profiler trace."""
    import gc
    from purestep.core.device import resolve_device
    from purestep.core.parallel import distributed
    dist, device = distributed.init(resolve_device(cfg.device), "none" if variant == VARIANTS[0] else "fsdp")
    step, state, batch = _build(cfg, variant, dist, device)
    gc.collect()
    reset_peak_memory(device)
    built = memory_mb(device)
    for _ in range(cfg.warmup):
        state = _one(step, state, batch)
    reset_peak_memory(device)
    times = []
    for _ in range(cfg.steps):
        start = time.perf_counter()
        state = _one(step, state, batch)
        times.append(time.perf_counter() - start)
    peak = memory_mb(device)
    state, flight = _profiled(step, state, batch, device, trace if dist.rank == 0 else None)
    mib = 2 ** 20
    result = {"rank": dist.rank, "ms_per_step": statistics.median(times) * 1e3, "built_mib": built, "peak_mib": peak,
              "state_mib": _bytes((state.params, state.opt_state)) / mib, "grad_mib": _bytes(state.params) / mib,
              "collectives": flight}
    distributed.shutdown(dist)
    return result


def _bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in leaves_of(tree) if isinstance(t, torch.Tensor))


def _profiled(step, state, batch, device, trace: Path | None):
    """One more step under ``torch.profiler``: the state after it and :func:`in_flight` of its events."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        state = _one(step, state, batch)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    return state, in_flight(prof.events(), device.type)


def in_flight(events, device_type: str) -> dict:
    """Per kind of collective: the ms it was in flight and the share of that time a matmul ran beside it. A
    collective is gloo's event on its worker thread (``gloo:all_gather``) or an NCCL kernel; a matmul is
    ``MATMULS`` on a CPU, any other kernel on CUDA."""
    def is_kernel(e) -> bool:
        return e.device_type == torch.autograd.DeviceType.CUDA

    def kind(e):
        if device_type == "cuda":       # ncclDevKernel_AllGather_RING_LL(...) -> all_gather
            nccl = is_kernel(e) and "nccl" in e.name.lower()
            return next((k for name, k in NCCL_KINDS.items() if name in e.name), "other") if nccl else None
        return e.name.removeprefix("gloo:") if e.name.startswith("gloo:") else None
    computing = _merged(sorted((e.time_range.start, e.time_range.end) for e in events
                               if (is_kernel(e) and kind(e) is None if device_type == "cuda" else e.name in MATMULS)))
    totals: dict = {}
    for e in events:
        k = kind(e)
        if k is None:
            continue
        start, end = e.time_range.start, e.time_range.end
        both = sum(max(0, min(end, b) - max(start, a)) for a, b in computing)
        total, over = totals.get(k, (0, 0))
        totals[k] = (total + end - start, over + both)
    return {k: {"ms": total / 1e3, "overlapped": over / total if total else 0.0} for k, (total, over) in totals.items()}


def _merged(intervals: list) -> list:
    """Sorted ``(start, end)`` pairs with overlapping ones joined."""
    out: list = []
    for a, b in intervals:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _launch(cfg: Config, variant: str, folder: Path) -> list[dict]:
    """``variant`` in fresh processes (``ranks`` of them under torchrun for fsdp): each rank's figures."""
    slug = variant.replace(", ", "-").replace(" ", "-")
    module = ["-m", "purestep.recipes.bench.fsdp", json.dumps(asdict(cfg)), variant, str(folder / slug)]
    ranks = 1 if variant == VARIANTS[0] else cfg.ranks
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={ranks}"]
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg.threads), PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([*launcher, *module], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench.fsdp: {variant} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return [json.loads((folder / f"{slug}.{r}.json").read_text()) for r in range(ranks)]


def _rank_main() -> None:
    """A launched process: ``python -m purestep.recipes.bench.fsdp CONFIG_JSON VARIANT PREFIX``; writes
    ``PREFIX.RANK.json`` (and rank 0 of ``fsdp, prefetch`` its trace beside it)."""
    fields, variant, prefix = json.loads(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    trace = prefix.parent / "trace.json" if variant == "fsdp, prefetch" else None
    result = measure(Config(**fields), variant, trace)
    Path(f"{prefix}.{result['rank']}.json").write_text(json.dumps(result))


def run(cfg: Config) -> dict:
    folder = run_folder(cfg.out, cfg.name, "bench-fsdp").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    results = {}
    for variant in VARIANTS:
        progress(f"bench.fsdp: {variant} ({1 if variant == VARIANTS[0] else cfg.ranks} process(es)) ...")
        results[variant] = _launch(cfg, variant, folder)
        progress(f"  {variant}: {max(r['ms_per_step'] for r in results[variant]):,.0f} ms/step, peak "
                 f"{max(r['peak_mib'] for r in results[variant]):,.0f} MiB")
    rows = table(cfg, results)
    (folder / "results.json").write_text(json.dumps({"config": asdict(cfg), "ranks": results, "rows": rows},
                                                    indent=1))
    progress(f"bench.fsdp: results in {folder}")
    return rows


def table(cfg: Config, results: dict) -> dict:
    """The markdown table (stdout) and its rows: per launch the largest rank's figures and their ratio to one
    process's, and each collective's time in flight and overlapped share (the largest rank's)."""
    one = results[VARIANTS[0]][0]
    print(f"\nbench.fsdp: Llama d={cfg.d_model} L={cfg.n_layers}, {cfg.batch_size}x{cfg.block_size} tokens per "
          f"process, {cfg.ranks} ranks, torch {torch.__version__}, {'compiled blocks' if cfg.compile else 'eager'}\n")
    print("| launch | ms/step | state + grads MiB | vs one process | memory once built MiB | peak MiB | vs one process "
          "| all-gather ms (overlapped) | reduce-scatter and all-reduce ms (overlapped) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for variant, ranks in results.items():
        worst = {k: max(r[k] for r in ranks) for k in ("ms_per_step", "built_mib", "peak_mib", "state_mib", "grad_mib")}
        persistent = worst["state_mib"] + worst["grad_mib"]
        flight = {k: max((_kinds(r["collectives"])[k] for r in ranks), key=lambda c: c["ms"])
                  for k in ("all_gather", "reductions")}
        rows[variant] = {**worst, "persistent_ratio": persistent / (one["state_mib"] + one["grad_mib"]),
                         "peak_ratio": worst["peak_mib"] / one["peak_mib"], "collectives": flight}
        cells = " | ".join(f"{c['ms']:,.0f} ({c['overlapped']:.0%})" if c["ms"] else "-" for c in flight.values())
        print(f"| {variant} | {worst['ms_per_step']:,.0f} | {persistent:,.0f} | {rows[variant]['persistent_ratio']:.3f} "
              f"| {worst['built_mib']:,.0f} | {worst['peak_mib']:,.0f} | {rows[variant]['peak_ratio']:.3f} | {cells} |")
    return rows


def _kinds(collectives: dict) -> dict:
    """One rank's :func:`in_flight` as its all-gathers and the rest (reduce-scatters and all-reduces; gloo runs a
    reduce-scatter as an all-reduce), each ``{"ms", "overlapped"}``."""
    def joined(parts: list) -> dict:
        ms = sum(c["ms"] for c in parts)
        return {"ms": ms, "overlapped": sum(c["ms"] * c["overlapped"] for c in parts) / ms if ms else 0.0}
    return {"all_gather": joined([c for k, c in collectives.items() if k == "all_gather"]),
            "reductions": joined([c for k, c in collectives.items() if k != "all_gather"])}


if __name__ == "__main__":
    _rank_main()
