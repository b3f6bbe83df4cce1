"""Benchmark: what AdaGC and the gradient health statistics add to the compiled train step.

``purestep recipe=bench.health [key=value ...]`` (``--help`` lists the keys).

Variants, all on the same tiny Llama and the same batch, in one process:

- ``compiled, global clip``      ``make_train_step`` under ``torch.compile``: ``chain(clip_by_global_norm(1),
                                 adamw)``, the baseline
- ``compiled, AdaGC + health``   the same step with ``chain(adagc(), adamw)`` and
                                 ``extra_metrics=GradientHealth(params).metrics`` (per-tensor and per-layer
                                 statistics packed into one tensor inside the graph); the goal is at most 5%
                                 over the baseline
- ``compiled, AdaGC`` and ``compiled, global clip + health`` (``breakdown=true``): each half alone
- ``plain eager``                ``nn.Module`` + ``clip_grad_norm_`` + ``torch.optim.AdamW``
- ``plain eager + .item() stats`` the same loop computing the same per-parameter statistics the naive way
                                 (the usual eager logging): grad norm, weight norm, non-finite count and update norm of
                                 every parameter, each pulled with ``.item()``, every step

Each variant is warmed up (compiles happen there), then timed one step at a time, interleaved (A B C A B C
..., ``rounds * steps`` steps each, each step waited for with ``.item()``), so a burst of load from other
processes hits every variant alike; the median step time of each and the ratios are printed, with the
10th..90th percentile as a noise gauge. Ratios are the result, not the times.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from purestep import optim
from purestep.core.config import option
from purestep.recipes.bench.common import StepBench, model_and_batch, warm_up
from purestep.core.state import init_state
from purestep.core.step import make_train_step
from purestep.core.update import Monitors
from purestep.models import llama
from purestep.models.llama_module import LlamaModule, load_params

DESCRIPTION = "time AdaGC + gradient health statistics in the compiled step against global clipping (ratios)"


@dataclass
class Config(StepBench):
    d_model: int = option(64, "model width", min=1)
    n_layers: int = option(2, "transformer blocks", min=1)
    block_size: int = option(64, "tokens per sequence", min=1)
    steps: int = option(20, "timed steps per variant per round", min=1)
    rounds: int = option(10, "rounds; each variant takes rounds * steps single timed steps, interleaved", min=1)
    breakdown: bool = option(False, "also time AdaGC alone and health alone (two more compiled graphs)")


def _functional(cfg: llama.LlamaConfig, params, batch, *, adagc: bool, health: bool):
    clip = optim.adagc() if adagc else optim.clip_by_global_norm(1.0)
    opt = optim.chain(clip, optim.adamw(lr=1e-3, weight_decay=0.1))
    extra = optim.GradientHealth(params, clip_norm=None if adagc else 1.0).metrics if health else None
    train_step = make_train_step(lambda p, b: llama.loss(p, b, cfg), opt, compile=True,
                                 monitors=Monitors(extra_metrics=extra))
    holder = {"state": init_state(params, opt)}

    def step():
        holder["state"], metrics = train_step(holder["state"], batch)
        return metrics["loss"]

    return step


def _plain(cfg: llama.LlamaConfig, params, batch, *, item_stats: bool):
    module = load_params(LlamaModule(cfg).to(params["embed"].device), params)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    named = list(module.named_parameters())
    log: dict[str, list[float]] = {}

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(module(batch["x"]).flatten(0, 1), batch["y"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0, foreach=True)
        if item_stats:
            before = {name: p.detach().clone() for name, p in named}
            for name, p in named:
                log[name] = [p.grad.norm().item(), p.norm().item(), (~torch.isfinite(p.grad)).sum().item()]
        opt.step()
        if item_stats:
            for name, p in named:
                log[name].append((p.detach() - before[name]).norm().item())
        return loss.detach()

    return step


def _time_one(step) -> float:
    start = time.perf_counter()
    step().item()  # wait for the step (a no-op on CPU, a sync on CUDA), the same for every variant
    return time.perf_counter() - start


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(cfg: Config) -> dict:
    model_cfg, params, batch = model_and_batch(cfg)
    variants = {
        "compiled, global clip": _functional(model_cfg, params, batch, adagc=False, health=False),
        "compiled, AdaGC + health": _functional(model_cfg, params, batch, adagc=True, health=True),
    }
    if cfg.breakdown:
        variants["compiled, AdaGC"] = _functional(model_cfg, params, batch, adagc=True, health=False)
        variants["compiled, global clip + health"] = _functional(model_cfg, params, batch, adagc=False, health=True)
    variants["plain eager"] = _plain(model_cfg, params, batch, item_stats=False)
    variants["plain eager + .item() stats"] = _plain(model_cfg, params, batch, item_stats=True)

    warm_up("bench.health", cfg, params, variants)

    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(cfg.rounds * cfg.steps):
        for name, step in variants.items():
            times[name].append(_time_one(step))
    medians = {name: statistics.median(ts) for name, ts in times.items()}

    base, plain = medians["compiled, global clip"], medians["plain eager"]
    print()
    print("| variant | ms/step (median) | p10..p90 | vs compiled global clip | vs plain eager |")
    print("|---|---:|---:|---:|---:|")
    for name, t in medians.items():
        lo, hi = _percentile(times[name], 0.1) * 1e3, _percentile(times[name], 0.9) * 1e3
        print(f"| {name} | {t * 1e3:.2f} | {lo:.2f}..{hi:.2f} | {t / base:.3f} | {t / plain:.3f} |")
    overhead = medians["compiled, AdaGC + health"] / base - 1
    naive = medians["plain eager + .item() stats"] / plain - 1
    print(f"\nAdaGC + health in the compiled step: {overhead * 100:+.1f}% (goal: at most +5%)")
    print(f"per-parameter .item() statistics in the plain loop: {naive * 100:+.1f}%")
    spread = {name: (_percentile(ts, 0.1) * 1e3, _percentile(ts, 0.9) * 1e3) for name, ts in times.items()}
    return {"ms_per_step": {k: v * 1e3 for k, v in medians.items()}, "p10_p90_ms": spread,
            "adagc_health_overhead": overhead, "item_stats_overhead": naive}
