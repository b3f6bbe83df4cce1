"""``dry_run=true``: what a run would be and cost, printed before anything is written.

A recipe that can (``recipes/standard.py``, ``recipes/distill/recipe.py``) defines ``dry_run(cfg) -> str``:
it builds the run as ``run`` would (config, tokenized data, model, train state) with no run folder
(``recipes.train.setup.start(cfg, None, ...)``: a fresh state that nothing writes), then :func:`describe`
probes a few train steps eagerly (``compile=false``, on that throwaway state, batches from the real data)
and projects the wall time of ``steps`` and its cost at ``cost_per_hour``. The data cache may be written
(tokenizing is most of a dry run's time on a new corpus); the run folder is not created.

The projection counts training steps only: evaluations, samples and checkpoints come on top, and a
``compile=true`` run first pays its compile time and then usually runs faster than the eager probe.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
import torch

from purestep.core.io import checkpoint as ckpt
from purestep.core.config import UserError
from purestep.core.device import synchronize
from purestep.core.tree import size, tree_leaves
from purestep.recipes.train.loop import Steps
from purestep.recipes.train.setup import resolve_run_folder

PROBE_WARMUP = 2          # eager steps before timing (allocator, first-call caches)
PROBE_STEPS = 8           # timed steps at most ...
PROBE_SECONDS = 10.0      # ... or this long, whichever comes first (at least 3 are timed; the median is the step time)


def probe_config(cfg):
    """The config the probe builds its steps with: ``cfg`` with ``compile=false``; refuses what it cannot
    project: a run hook's refusal (``recipes.train.hooks.RunHook.dry_run_refusal``, e.g. a layer whose branches
    multiply the steps by choices made while training)."""
    for hook in cfg.run_hooks():
        refusal = hook.dry_run_refusal()
        if refusal is not None:
            raise UserError(refusal)
    return dataclasses.replace(cfg, compile=False, compile_mode="default")   # no warning about the probe's own choice


def tree_bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def probe(steps: Steps, state, frozen, device: torch.device) -> tuple[float, int]:
    """Seconds per train step of ``steps.train`` from ``state`` (eager, the loop's own batch reads included): the
    median of the timed steps (a stall of the machine during one of a few steps does not scale the projection),
    and how many steps were timed."""
    cursor = int(state.cursor)
    for _ in range(PROBE_WARMUP):
        state, metrics = steps.train(state, steps.batches.get(cursor), frozen)
        cursor += 1
    synchronize(device)
    float(metrics["loss"])
    times, t0 = [], time.perf_counter()
    while len(times) < 3 or (len(times) < PROBE_STEPS and time.perf_counter() - t0 < PROBE_SECONDS):
        start = time.perf_counter()
        state, metrics = steps.train(state, steps.batches.get(cursor), frozen)
        synchronize(device)
        times.append(time.perf_counter() - start)
        cursor += 1
    float(metrics["loss"])
    return statistics.median(times), len(times)


def duration(seconds: float) -> str:
    for unit, size_ in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size_:
            return f"{seconds / size_:.3g} {unit}"
    return f"{seconds:.3g} s"


def megabytes(n: int) -> str:
    return f"{n / 2**20:.4g} MiB"


def resume_point(cfg, folder: Path) -> tuple[str, int]:
    """What the run folder holds and the step the run would start from (the checkpoint ``resume`` picks;
    a ``resume=never`` over checkpoints is the same error as the real run's)."""
    path = resolve_run_folder(cfg, folder)
    if path is None:
        return f"{folder} ({'exists, no checkpoints' if folder.exists() else 'not created'})", 0
    step = int(ckpt.read_meta(path).get("step", 0))
    return f"{folder} (resumes from {path.name} at step {step:,})", step


def describe(cfg, *, recipe: str, folder: Path, model: str, data: str, train_tokens: int, state, steps: Steps,
             device: torch.device, world_size: int = 1, frozen=None, extra: tuple[str, ...] = ()) -> str:
    """The plan as printed by ``dry_run=true``: sizes, the probe's step time, the projected wall time and cost."""
    seconds, timed = probe(steps, state, frozen, device)
    threads = torch.get_num_threads()
    tokens_per_step = cfg.batch_size * cfg.block_size * cfg.grad_accum * world_size
    params, moments = tree_bytes(state.params), tree_bytes(state.opt_state)
    where, start = resume_point(cfg, folder)
    left = max(cfg.steps - start, 0)
    wall = seconds * left
    cost = (f"{wall / 3600 * cfg.cost_per_hour:.4g} at cost_per_hour={cfg.cost_per_hour:g}"
            + (f" (budget {cfg.budget:g})" if cfg.budget else "")) if cfg.cost_per_hour else \
        "not metered (cost_per_hour=0)"
    rows = [
        ("run folder", where),
        ("model", model),
        ("parameters", f"{size(state.params):,}"),
        *(tuple(line.split(": ", 1)) for line in extra),
        ("data", data),
        ("train state", f"{megabytes(params + moments)} (params {megabytes(params)} + optimizer moments "
                        f"{megabytes(moments)}; {cfg.dtype} compute, fp32 master)"),
        ("tokens/step", f"{tokens_per_step:,} (batch_size {cfg.batch_size} x block_size {cfg.block_size} x "
                        f"grad_accum {cfg.grad_accum} x {world_size} rank{'s' if world_size > 1 else ''}); "
                        f"{cfg.steps * tokens_per_step / max(train_tokens, 1):.3g} epochs in {cfg.steps:,} steps"),
        ("step time", f"{seconds * 1e3:.4g} ms (median of {timed} eager steps after {PROBE_WARMUP} warm-up, "
                      f"compile=false; {device}, {threads} thread{'s' if threads > 1 else ''})"),
        ("steps/s", f"{1 / seconds:.4g} ({tokens_per_step / seconds:,.0f} tokens/s)"),
        ("wall time", f"{duration(wall)} for {left:,} steps (training steps only; evaluation, samples, "
                      f"checkpoints{' and compiling' if cfg.compile else ''} come on top)"),
        ("cost", cost),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"dry run of recipe={recipe}: nothing trained, no run folder created",
                      *(f"  {k.ljust(width)}  {v}" for k, v in rows)])

