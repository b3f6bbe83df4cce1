"""Benchmark: the functional train step against the plain PyTorch loop, side by side in one process.

``bin/run recipe=bench.step [key=value ...]`` (``--help`` lists the keys).

Four ways to take the same training step on the same Llama and the same batch:

- ``plain eager``        ``nn.Module`` forward, ``.backward()``, ``clip_grad_norm_``, ``torch.optim.AdamW(foreach=True)``
- ``plain compiled``     the same with ``torch.compile(module)`` (the optimizer stays eager, the usual way)
- ``functional eager``   ``core.step.make_train_step`` (``torch.func.grad_and_value``), not compiled
- ``functional compiled`` the same step under ``torch.compile(fullgraph=True)``: forward, backward,
                          clipping and AdamW in one graph

Each variant is warmed up (compiles happen there), then the variants are timed in interleaved rounds
(A B C D A B C D ...) so machine noise hits all of them alike, and the median time per step is
reported with tokens/s and the ratio to ``plain eager`` and to ``plain compiled``. Ratios, not bare
times, are the result: this machine is shared and noisy.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import optim
from core.config import option
from recipes.bench.common import StepBench, model_and_batch, warm_up
from core.state import init_state
from core.step import make_train_step
from models import llama
from models.llama_module import LlamaModule, load_params

DESCRIPTION = "time the compiled functional step against nn.Module + torch.optim.AdamW (ratios, same process)"


@dataclass
class Config(StepBench):
    n_kv_heads: int = option(2, "key/value heads (grouped-query attention)", min=0)
    compile: bool = option(True, "include the two compiled variants")


def _plain(cfg: llama.LlamaConfig, params, batch, compiled: bool):
    module = load_params(LlamaModule(cfg), params)
    forward = torch.compile(module) if compiled else module
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward(batch["x"]).flatten(0, 1), batch["y"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0, foreach=True)
        opt.step()
        return loss.detach()

    return step


def _functional(cfg: llama.LlamaConfig, params, batch, compiled: bool):
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=1e-3, weight_decay=0.1, mask=None))
    train_step = make_train_step(lambda p, b: llama.loss(p, b, cfg), opt, compile=compiled)
    holder = {"state": init_state(params, opt)}

    def step():
        holder["state"], metrics = train_step(holder["state"], batch)
        return metrics["loss"]

    return step


def _time(step, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        loss = step()
    loss.item()  # wait for the last step (a no-op on CPU, a sync on CUDA)
    return (time.perf_counter() - start) / n


def run(cfg: Config) -> dict:
    model_cfg, params, batch = model_and_batch(cfg)
    variants = {"plain eager": _plain(model_cfg, params, batch, False),
                "functional eager": _functional(model_cfg, params, batch, False)}
    if cfg.compile:
        variants["plain compiled"] = _plain(model_cfg, params, batch, True)
        variants["functional compiled"] = _functional(model_cfg, params, batch, True)

    warm_up("bench.step", cfg, params, variants)

    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(cfg.rounds):
        for name, step in variants.items():
            times[name].append(_time(step, cfg.steps))
    medians = {name: statistics.median(ts) for name, ts in times.items()}

    tokens = cfg.batch_size * cfg.block_size
    base = medians["plain eager"]
    base_c = medians.get("plain compiled")
    print()
    print("| variant | ms/step | tokens/s | vs plain eager | vs plain compiled |")
    print("|---|---:|---:|---:|---:|")
    for name, t in medians.items():
        vs_c = f"{t / base_c:.2f}" if base_c else "-"
        print(f"| {name} | {t * 1e3:.1f} | {tokens / t:,.0f} | {t / base:.2f} | {vs_c} |")
    return {name: {"ms_per_step": t * 1e3, "tokens_per_sec": tokens / t, "ratio_vs_plain_eager": t / base}
            for name, t in medians.items()}
