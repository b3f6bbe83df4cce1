"""Benchmark: the step time of distillation from an offline teacher cache against the online teacher.

``purestep recipe=bench.distill [teacher=smollm2] data=PATH [k=32] [steps=12]`` builds a top-``k``
cache (``recipe=distill_cache``) of ``steps + warmup`` batches in a temporary folder, prepares both distill
runs with the same settings (``preset=smollm2`` shapes: a 16M student, 4 x 64 tokens) in this process and
times them step by step, interleaved (A B A B ...), so machine noise hits both alike. It prints the median
step times and their ratio; the ratio is the result.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from purestep.core.config import UserError, option, resolve
from purestep.core.device import synchronize
from purestep.recipes.distill import cache as distill_cache, recipe as distill

DESCRIPTION = "time distillation from a top-k teacher cache against the online teacher (ratio, same process)"


@dataclass
class Config:
    teacher: str = option("smollm2", "teacher: checkpoint or run folder, Hugging Face folder, .gguf, or 'smollm2'")
    data: str = option("stdlib", "text the batches come from (file, folder, glob, or 'stdlib')")
    preset: str = option("smollm2", "the recipe=distill preset whose student and batch shapes are timed",
                         choices=tuple(distill.PRESETS))
    k: int = option(32, "teacher ids kept per position in the cache", min=1)
    steps: int = option(12, "timed steps per variant", min=1)
    warmup: int = option(2, "untimed steps per variant first", min=0)


def step_time_ratio(online: distill.Config, cached: distill.Config, steps: int = 10, warmup: int = 2) -> dict:
    """Median step time of training from ``cached.cache`` over training with the online teacher, both
    prepared in this process and timed in interleaved rounds. Returns seconds and the ratio."""
    runs = {"online": distill.prepare_run(online), "cached": distill.prepare_run(cached)}
    built = {k: distill.train_steps(r, r.run.optimizer) for k, r in runs.items()}
    states = {k: r.run.state for k, r in runs.items()}
    times: dict[str, list] = {k: [] for k in runs}
    for i in range(warmup + steps):
        for name, r in runs.items():
            batch = built[name].batches.get(i)
            t0 = time.perf_counter()
            states[name], metrics = built[name].train(states[name], batch, r.teacher.frozen)
            metrics["loss"].item()
            synchronize(r.run.state.step.device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    online_s, cached_s = statistics.median(times["online"]), statistics.median(times["cached"])
    out = {"online_s": online_s, "cached_s": cached_s, "ratio": cached_s / online_s}
    print(f"step time: online teacher {online_s * 1e3:.1f} ms, {runs['cached'].teacher.cache.describe()} "
          f"{cached_s * 1e3:.1f} ms: cached/online = {out['ratio']:.3f} (median of {steps}, interleaved)")
    return out


def run(cfg: Config) -> dict:
    if cfg.steps < 1 or cfg.warmup < 0 or cfg.k < 1:
        raise UserError("steps and k must be >= 1, warmup >= 0")
    total = cfg.steps + cfg.warmup
    with tempfile.TemporaryDirectory(prefix="distill_bench-") as tmp:
        cache = Path(tmp) / "cache"
        common = {"teacher": cfg.teacher, "data": cfg.data, "steps": str(total), "out": str(Path(tmp) / "unused")}
        online = resolve(distill.Config, presets=distill.PRESETS, preset=cfg.preset, overrides=common)
        distill_cache.run(resolve(distill_cache.Config, overrides={
            "teacher": cfg.teacher, "data": cfg.data, "out": str(cache), "k": str(cfg.k), "steps": str(total),
            "batch_size": str(online.batch_size), "block_size": str(online.block_size), "seed": str(online.seed)}))
        cached = resolve(distill.Config, presets=distill.PRESETS, preset=cfg.preset,
                         overrides={**common, "cache": str(cache)})
        return step_time_ratio(online, cached, steps=cfg.steps, warmup=cfg.warmup)
