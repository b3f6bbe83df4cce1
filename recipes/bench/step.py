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
from core.logging import progress
from core.state import init_state
from core.step import make_train_step
from models import llama
from models.llama_module import LlamaModule, load_params

DESCRIPTION = "time the compiled functional step against nn.Module + torch.optim.AdamW (ratios, same process)"


@dataclass
class Config:
    d_model: int = option(128, "model width", min=1)
    n_layers: int = option(4, "transformer blocks", min=1)
    n_heads: int = option(4, "attention heads", min=1)
    n_kv_heads: int = option(2, "key/value heads (grouped-query attention)", min=1)
    vocab_size: int = option(256, "vocabulary size (byte-level)", min=1)
    batch_size: int = option(16, "sequences per step", min=1)
    block_size: int = option(128, "tokens per sequence", min=1)
    warmup: int = option(3, "untimed steps per variant (compilation happens here)", min=0)
    steps: int = option(10, "timed steps per variant per round", min=1)
    rounds: int = option(3, "interleaved timing rounds; the median step time is reported", min=1)
    compile: bool = option(True, "include the two compiled variants")
    threads: int = option(0, "torch.set_num_threads (0 keeps the default)", min=0)
    seed: int = option(0, "seed for weights and the batch", min=0)


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
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model_cfg = llama.LlamaConfig(vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers,
                                  n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads)
    params = llama.init(model_cfg, seed=cfg.seed)
    tok = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.block_size + 1),
                        generator=torch.Generator().manual_seed(cfg.seed))
    batch = {"x": tok[:, :-1].contiguous(), "y": tok[:, 1:].contiguous()}
    variants = {"plain eager": _plain(model_cfg, params, batch, False),
                "functional eager": _functional(model_cfg, params, batch, False)}
    if cfg.compile:
        variants["plain compiled"] = _plain(model_cfg, params, batch, True)
        variants["functional compiled"] = _functional(model_cfg, params, batch, True)

    n_params = sum(t.numel() for t in optim.base.tree_leaves(params))
    print(f"bench_step: Llama d={cfg.d_model} L={cfg.n_layers} H={cfg.n_heads}/{cfg.n_kv_heads} "
          f"({n_params / 1e6:.2f}M params), batch {cfg.batch_size}x{cfg.block_size}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, step in variants.items():
        start = time.perf_counter()
        for _ in range(cfg.warmup):
            step().item()
        progress(f"  warmed up {name:<20} in {time.perf_counter() - start:6.1f}s")

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
