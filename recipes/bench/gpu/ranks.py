"""bench.gpu's multi-GPU section: ``recipe=standard`` with ``parallel=ddp`` and ``parallel=fsdp`` over every GPU of
the machine (at most ``MAX_RANKS``, NCCL), against one process of the same command.

Each rank keeps the one process's rows (weak scaling, as torchrun users scale out), so N ranks ideally train N times
the tokens per second. The report gives, per command: tokens/s (the median of the run's logged rates over its second
half: the first steps compile), the scaling efficiency (tokens/s / (N x one process's)), and each rank's peak memory
(the run's own ``peak memory per rank`` line), which fsdp lowers and ddp does not. The shape is GPT-2 small's body
(d 768, 12 layers, 12 heads, block 1024) on bytes: ``recipe=standard`` takes its vocabulary from its tokenizer.

With fewer than two GPUs the section is one skipped item saying so. ``scale=tiny`` runs it on the CPU with 2 gloo
ranks at a tiny size, so the command and its parsing never rot (the test suite runs it).
"""
from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path

import torch

from purestep.recipes.bench.gpu.jobs import Job, bin_run, run_jobs, torchrun
from purestep.recipes.bench.gpu.report import Report

MAX_RANKS = 8
PARALLEL = ("ddp", "fsdp")


def rank_count(device: torch.device, tiny: bool) -> int:
    """How many ranks the section runs: 2 gloo ranks at tiny scale, else every GPU up to ``MAX_RANKS``."""
    if tiny:
        return 2
    return min(torch.cuda.device_count(), MAX_RANKS) if device.type == "cuda" else 0


def rank_jobs(device: str, tiny: bool, data: str, ranks: int, steps: int) -> list[Job]:
    """One process, then ``ranks`` ranks under each of ``PARALLEL``: the same command, bf16 and compiled on a GPU."""
    size = ["preset=tiny", "model.d_model=32", "block_size=32", "batch_size=4", "compile=false"] if tiny else \
        ["model.d_model=768", "model.n_layers=12", "model.n_heads=12", "block_size=1024", "batch_size=16",
         "dtype=bf16"]
    common = ["recipe=standard", f"data={data}", *size, f"steps={steps}", "eval_every=0", "sample_tokens=0",
              "save_every=0", "log_every=1", f"device={device}"]
    one = Job("one_process", bin_run(*common, "out=ranks-one"), section="ranks")
    return [one] + [Job(f"{parallel}_{ranks}", torchrun(ranks, *common, f"parallel={parallel}",
                                                        f"out=ranks-{parallel}"), ("one_process",), section="ranks")
                    for parallel in PARALLEL]


def run_ranks(report: Report, device: torch.device, tiny: bool, data: str, folder: Path, seconds: float) -> None:
    """The section: its jobs (at most ``seconds`` in all), then one summary item per parallel command."""
    ranks = rank_count(device, tiny)
    if ranks < 2:
        report.add("ranks", {"name": "multi_gpu", "ok": None, "reason": f"needs 2 or more GPUs (this machine has "
                                                                        f"{torch.cuda.device_count()})"})
        return
    done = run_jobs(report, rank_jobs(device.type, tiny, data, ranks, 8 if tiny else 60), folder,
                    time.monotonic() + seconds, parallel=1)
    for parallel in PARALLEL:
        job = done[f"{parallel}_{ranks}"]
        if not (job.result.get("ok") and done["one_process"].result.get("ok")):
            continue      # its own item says why
        with report.item("ranks", f"{parallel}_{ranks}_scaling") as item:   # a log it cannot read: that item fails
            one, tps = throughput(folder / "ranks-one"), throughput(folder / f"ranks-{parallel}")
            peaks = peak_per_rank(folder / f"{job.name}.log")
            item.update(ranks=ranks, tokens_per_s=tps, one_process_tokens_per_s=one,
                        efficiency=round(tps / (ranks * one), 3), peak_mib_per_rank=peaks,
                        summary=f"{ranks} ranks {tps:,.0f} tokens/s = {tps / (ranks * one):.2f} x {ranks} x one "
                                f"process's {one:,.0f}; peak MiB per rank {peaks}")


def throughput(run: Path) -> float:
    """The median logged tokens/s over the second half of a run's steps (``metrics.jsonl``)."""
    rates = [row["tokens_per_sec"] for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if "tokens_per_sec" in row]
    if not rates:
        raise ValueError(f"{run / 'metrics.jsonl'} logged no tokens_per_sec")
    return statistics.median(rates[len(rates) // 2:])


def peak_per_rank(log: Path) -> list[float]:
    """Each rank's peak memory in MiB, from the run's ``peak memory per rank: rank 0 N MiB ...`` line."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if "peak memory per rank:" in line]
    return [float(mib) for mib in re.findall(r"rank \d+ ([\d.]+) MiB", lines[-1])] if lines else []
