"""Benchmark: the functional train step against the plain PyTorch loop: time, peak memory, compile time.

``purestep recipe=bench.step [key=value ...]`` (``--help`` lists the keys).

Four ways to take the same training step on the same Llama and the same batch:

- ``plain eager``        ``nn.Module`` forward returning the loss (nanoGPT's ``model(X, Y)``), ``.backward()``,
                          ``clip_grad_norm_``, ``torch.optim.AdamW(fused=True)`` (the faster on a CPU)
- ``plain compiled``     the same with ``torch.compile(module)``: the cross entropy compiled with the model (the
                          optimizer stays eager, the usual way)
- ``functional eager``   ``core.step.make_train_step``, not compiled (gradients by ``torch.autograd``)
- ``functional compiled`` the same step compiled: with ``compile_scope=block`` (the default, as the recipes
                          run on a CPU beyond 4 layers) one block graph shared by every layer plus the update
                          graph; with ``step`` forward, backward, clipping and AdamW in one graph
                          (``torch.func``), or with ``grad_mode=autograd`` the loss's graph (its backward split
                          off by AOTAutograd) and the update's

Both functional variants donate the state (``donate=true``, as the recipes run); ``donate=false`` times the
pure step. ``fused=true`` (with ``compile=false``) gives the functional eager step torch's fused in-place AdamW, as
the recipes' ``fused=true`` (``optim.fused``). ``loss_outside=true`` adds ``plain compiled, loss outside``: the
cross entropy taken eagerly on the compiled module's logits (the weaker baseline of the earlier figures). fp32 on
every side.

With ``isolate=true`` (the default) each variant runs alone in a fresh Python process (``python -c`` of
:func:`measure_variant`), so its peak memory is its own: the child's peak RSS (``getrusage(RUSAGE_SELF)
.ru_maxrss``, read after its steps; the model, the batch and the imported torch included), and its steady
peak, over the steps after the first: the heap's free memory given back (glibc's ``malloc_trim``, so the first
step's compile leaves it) and the resident high-water mark reset (Linux; CUDA: the allocator's peak). The child times
its first step (the compile, for the compiled variants; run even with ``warmup=0``), with torch's compiler
imported before the timer in every variant, its ``warmup - 1`` further untimed steps, then ``rounds`` rounds of
``steps`` steps; the median round is the time per step. The variants run one after the other, so machine noise is
not shared by them as with ``isolate=false``: there all four are built in this process, warmed up, then timed in
interleaved rounds (A B C D A B C D ...), and the process-wide RSS gives no per-variant memory (its column is then
empty).

The table gives ms/step, tokens/s, peak MB, steady MB, on the CPU the tensors' peak over one more step
(``recipes.bench.common.cpu_allocated_peak_mb``: what CUDA's ``max_memory_allocated`` counts, without the heap the
C library keeps), and the ratios of time and memory to ``plain eager``. Ratios,
not bare times, are the result: this machine is shared and noisy. ``preset=100m`` is the ~100M-parameter
shape (d=768, 12 layers, 12 query / 4 KV heads, 32k vocabulary, batch 2 x 128) with few steps.
"""
from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from purestep import optim
from purestep.core.config import ConfigError, option
from purestep.core.host_memory import release_free_memory
from purestep.core.io.logging import memory_mb, progress, reset_peak_memory
from purestep.recipes.bench.common import StepBench, cpu_allocated_peak_mb, model_and_batch, warm_up
from purestep.core.state import init_state
from purestep.core.step import COMPILE_SCOPES, Compile, Gradients, make_train_step
from purestep.recipes.train.backend import GRAD_MODES, auto_grad_mode
from purestep.models import llama
from purestep.models.llama_module import LlamaModule, load_params
from purestep.recipes.bench.plain_run import loss_of

DESCRIPTION = ("time, peak memory and compile time of the functional step against nn.Module (its loss inside) + "
               "torch.optim.AdamW (one process per variant)")
LOSS_OUTSIDE = ", loss outside"   # the suffix of loss_outside=true's variant


@dataclass
class Config(StepBench):
    n_kv_heads: int = option(2, "key/value heads (grouped-query attention)", min=0)
    compile: bool = option(True, "include the two compiled variants")
    isolate: bool = option(True, "each variant in its own fresh process (gives per-variant peak memory)")
    repeats: int = option(1, "processes per variant with isolate=true (medians of time, the largest peak memory)",
                          min=1)
    cold_compile: bool = option(True, "compile into a new, empty inductor cache (TORCHINDUCTOR_CACHE_DIR): each "
                                      "process with isolate=true, so the first step times a cold compile")
    donate: bool = option(True, "the functional step writes the new state into the old buffers, as the recipes run it "
                                "(false: the pure step)")
    fused: bool = option(False, "the functional eager step's AdamW and clipping in place by torch's fused kernel, "
                               "as the recipes' fused=true (optim.fused); eager only: needs compile=false")
    compile_scope: str = option("block", "what one graph covers in the functional compiled variant: the whole step, "
                                "or one block shared by every layer (core.step)", choices=COMPILE_SCOPES)
    grad_mode: str = option("auto", "the functional variants' gradient engine (core.step.Gradients): func, "
                            "torch.func in the one graph; autograd, the loss compiled apart with its backward split "
                            "off by AOTAutograd, the update apart; auto: as the recipes choose (func for the whole "
                            "step up to 4 layers, else autograd)", choices=GRAD_MODES)
    loss_outside: bool = option(False, "also time plain compiled with the cross entropy taken eagerly outside the "
                                       "compiled module (the weaker baseline): 'plain compiled, loss outside'")

    def __post_init__(self):
        if self.fused and self.compile:
            raise ConfigError("fused=true is the eager step's (a compiled step's update is fused by inductor "
                              "already): set compile=false")
        if self.grad_mode == "func" and self.compile and self.compile_scope == "block":
            raise ConfigError("grad_mode=func runs the whole step as one torch.func graph: with compile=true it needs "
                              "compile_scope=step (or grad_mode=autograd or auto)")
        if self.loss_outside and not self.compile:
            raise ConfigError("loss_outside=true times plain compiled with the loss outside the compiled module: it "
                              "needs compile=true (eager, inside and outside are the same operations)")
        if self.repeats > 1 and not self.isolate:
            raise ConfigError(f"repeats={self.repeats} runs each variant in that many processes: it needs "
                              f"isolate=true (isolate=false times the variants in rounds: set repeats=1, more rounds=)")


PRESETS = {
    "100m": {"vocab_size": 32000, "d_model": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4,
             "batch_size": 2, "block_size": 128, "warmup": 2, "steps": 3, "rounds": 2, "repeats": 2},
}


def _plain(cfg: llama.LlamaConfig, params, batch, compiled: bool, loss_inside: bool = True):
    """The plain step: ``nn.Module`` forward returning the loss (``torch.compile(module)`` when compiled; with
    ``loss_inside=False`` the cross entropy taken eagerly on its logits), ``.backward()``, clipping and
    ``torch.optim.AdamW(fused=True)``. The compile itself happens in the first call, as the functional step's does."""
    module = load_params(LlamaModule(cfg).to(params["embed"].device), params)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    forward = torch.compile(module) if compiled else module

    def step():
        loss = loss_of(forward, batch["x"], batch["y"], loss_inside)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)   # nanoGPT's train.py frees the gradients here, right after the step
        return loss.detach()

    return step


def _functional(cfg: llama.LlamaConfig, params, batch, compiled: bool, bench: Config):
    if bench.fused:
        opt = optim.fused_adamw(lr=1e-3, weight_decay=0.1, mask=None, max_norm=1.0)
    else:
        opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=1e-3, weight_decay=0.1, mask=None))
    train_step = make_train_step(lambda p, b, layers=None: llama.loss(p, b, cfg, layers=layers), opt,
                                 compile=Compile(compiled, scope=bench.compile_scope), donate=bench.donate,
                                 gradients=Gradients(_grad_mode(bench, cfg, compiled)))
    holder = {"state": init_state(params, opt)}

    def step():
        holder["state"], metrics = train_step(holder["state"], batch)
        return metrics["loss"]

    return step


def _grad_mode(bench: Config, cfg: llama.LlamaConfig, compiled: bool):
    """The functional variant's ``core.step.Gradients`` mode: ``bench.grad_mode``, or as the recipes choose."""
    if bench.grad_mode != "auto":
        return bench.grad_mode
    return auto_grad_mode(cfg.n_layers, bench.compile_scope) if compiled else None


def _time(step, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        loss = step()
    loss.item()  # wait for the last step (a no-op on CPU, a sync on CUDA)
    return (time.perf_counter() - start) / n


def _build(cfg: Config, name: str, model_cfg, params, batch):
    plain_or_functional, mode = name.removesuffix(LOSS_OUTSIDE).split()
    if plain_or_functional == "plain":
        return _plain(model_cfg, params, batch, mode == "compiled", loss_inside=not name.endswith(LOSS_OUTSIDE))
    return _functional(model_cfg, params, batch, mode == "compiled", cfg)


def _names(cfg: Config) -> list[str]:
    extra = ["plain compiled", "functional compiled"] if cfg.compile else []
    return ["plain eager", "functional eager"] + extra + (["plain compiled" + LOSS_OUTSIDE] if cfg.loss_outside else [])


def _peak_mb(device: torch.device) -> float:
    """This process's peak memory in MB: ``torch.cuda.max_memory_allocated`` on CUDA, else the peak resident set
    size (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def measure_variant(cfg: Config, name: str) -> dict:
    """Build variant ``name`` alone, time its first step and its median round, and read the peak memory: over
    the whole process, and over the steps after the first (the steady state, when this platform can say)."""
    model_cfg, params, batch = model_and_batch(cfg)
    step = _build(cfg, name, model_cfg, params, batch)
    del params   # the variant holds its own copy (a module, or the train state)
    device = batch["x"].device
    # torch.optim.AdamW imports torch's compiler (dynamo, inductor) as the plain variants are built, the functional
    # step at its first call: one AdamW here imports it for every variant, so the first step times compiling (a warm
    # cache's load included), not the import (docs/design.md, 'Measured choices')
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    start = time.perf_counter()
    step().item()
    first = time.perf_counter() - start
    gc.collect()
    release_free_memory()                # what the first step freed (its compile) leaves the resident set,
    steady = reset_peak_memory(device)   # so the peak after it is the steps' own
    for _ in range(cfg.warmup - 1):
        step().item()
    per_step = statistics.median(_time(step, cfg.steps) for _ in range(cfg.rounds))
    result = {"seconds_per_step": per_step, "first_step_s": first, "peak_mb": _peak_mb(device),
              "steady_mb": memory_mb(device) if steady else None}
    if device.type == "cpu":   # after the timing: one more step, profiled
        result["allocated_mb"] = cpu_allocated_peak_mb(lambda: step().item())
    return result


def _child_main() -> None:
    """Entry of a child process: a JSON ``[config, variant]`` on stdin, the JSON result as stdout's last line."""
    fields, name = json.loads(sys.stdin.read())
    print(json.dumps(measure_variant(Config(**fields), name)))


def _in_fresh_process(cfg: Config, name: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    code = "from purestep.recipes.bench.step import _child_main; _child_main()"
    with tempfile.TemporaryDirectory(prefix="bench-inductor-") as cache:
        if cfg.cold_compile:
            env["TORCHINDUCTOR_CACHE_DIR"] = cache
        done = subprocess.run([sys.executable, "-c", code], input=json.dumps([asdict(cfg), name]), env=env,
                              stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _isolated(cfg: Config) -> dict[str, dict]:
    """Every variant ``repeats`` times, each run in its own process, the variants taking turns."""
    model_cfg, params, _ = model_and_batch(cfg)
    warm_up("bench.step (one process per variant)", cfg, params, {})
    runs: dict[str, list[dict]] = {name: [] for name in _names(cfg)}
    for repeat in range(cfg.repeats):
        for name in runs:
            r = _in_fresh_process(cfg, name)
            runs[name].append(r)
            progress(f"  {name} ({repeat + 1}/{cfg.repeats}): first step {r['first_step_s']:.1f}s, "
                     f"{r['seconds_per_step'] * 1e3:.1f} ms/step, peak {r['peak_mb']:,.0f} MB"
                     + (f", after the first step {r['steady_mb']:,.0f} MB" if r["steady_mb"] else "")
                     + (f", tensors {r['allocated_mb']:,.0f} MB" if r.get("allocated_mb") else ""))
    return {name: {"seconds_per_step": statistics.median(r["seconds_per_step"] for r in rs),
                   "first_step_s": statistics.median(r["first_step_s"] for r in rs),
                   "peak_mb": max(r["peak_mb"] for r in rs),
                   "steady_mb": None if None in (steady := [r["steady_mb"] for r in rs]) else max(steady),
                   "allocated_mb": max((r["allocated_mb"] for r in rs if "allocated_mb" in r), default=None)}
            for name, rs in runs.items()}


def _interleaved(cfg: Config) -> dict[str, dict]:
    model_cfg, params, batch = model_and_batch(cfg)
    variants = {name: _build(cfg, name, model_cfg, params, batch) for name in _names(cfg)}
    warm_up("bench.step", cfg, params, variants)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(cfg.rounds):
        for name, step in variants.items():
            times[name].append(_time(step, cfg.steps))
    return {name: {"seconds_per_step": statistics.median(ts)} for name, ts in times.items()}


MEMORY = (("peak_mb", "memory_vs_plain_eager", "peak MB"), ("steady_mb", "steady_vs_plain_eager", "steady MB"),
          ("allocated_mb", "allocated_vs_plain_eager", "tensors MB"))   # key, its ratio's key, its column


def _table(cfg: Config, results: dict[str, dict]) -> dict:
    tokens = cfg.batch_size * cfg.block_size
    base = results["plain eager"]
    print()
    print("| variant | ms/step | tokens/s | " + " | ".join(c for _, _, c in MEMORY) + " | vs plain eager (time) | "
          + " | ".join(f"vs plain eager ({c.removesuffix(' MB')})" for _, _, c in MEMORY) + " | first step s |")
    print("|---|" + "---:|" * (4 + 2 * len(MEMORY)))
    rows = {}
    for name, r in results.items():
        t = r["seconds_per_step"]
        rows[name] = {"ms_per_step": t * 1e3, "tokens_per_sec": tokens / t,
                      "ratio_vs_plain_eager": t / base["seconds_per_step"]}
        cells = {key: ["-", "-"] for key, _, _ in MEMORY}
        for key, ratio, _ in MEMORY:
            if r.get(key) is not None and base.get(key):
                rows[name].update({key: r[key], ratio: r[key] / base[key]})
                cells[key] = [f"{r[key]:,.0f}", f"{r[key] / base[key]:.2f}"]
        first = "-"
        if "first_step_s" in r:
            rows[name]["first_step_s"] = r["first_step_s"]
            first = f"{r['first_step_s']:.1f}"
        print(f"| {name} | {t * 1e3:.1f} | {tokens / t:,.0f} | " + " | ".join(cells[k][0] for k, _, _ in MEMORY)
              + f" | {t / base['seconds_per_step']:.2f} | " + " | ".join(cells[k][1] for k, _, _ in MEMORY)
              + f" | {first} |")
    return rows


def run(cfg: Config) -> dict:
    if cfg.isolate:
        return _table(cfg, _isolated(cfg))
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="bench-inductor-") as cache:
        if cfg.cold_compile:   # this process compiles every variant into one new, empty cache
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        try:
            return _table(cfg, _interleaved(cfg))
        finally:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            if before is not None:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
