"""Benchmark: the standard recipe's training loop against nanoGPT's plain PyTorch loop, tokens per second.

``purestep recipe=bench.speed data=tinyshakespeare.txt`` (``--help`` lists the keys). The defaults are nanoGPT's
CPU shakespeare-char configuration (``config/train_shakespeare_char.py`` with its CPU settings: 4 layers, 4
heads, d=128, block 64, batch 12, lr 1e-3, beta2 0.99, 100 warmup steps, cosine to 1e-4).

In one process, on the same Llama (the same initial weights), the same data and the same batch shape:

- ``plain``: nanoGPT's ``train.py`` loop over ``models.llama_module.LlamaModule``: ``torch.compile(module)`` called
  as nanoGPT's ``model(X, Y)`` (the cross entropy compiled with the model), ``loss.backward()``, ``clip_grad_norm_``,
  nanoGPT's AdamW groups (``plain_optimizer``: fused, the faster on a CPU, or foreach), the learning rate set every
  step, the batch fetched synchronously, ``loss.item()`` every ``log_every`` steps; fp32 on both sides. The ratios
  are against it; ``loss_outside=true`` adds ``plain, loss outside`` (the cross entropy taken eagerly on the
  compiled module's logits, the weaker baseline of the earlier figures).
- ``standard``: ``recipes.standard.prepare_run`` and ``train_steps`` (the recipe's own config, data, state and
  steps, every default on: gradient health, spike detection with its snapshot ring, the non-finite skip) driven by
  ``recipes.train.loop.Loop``, the loop ``purestep recipe=standard`` runs (prefetch, metric pulls, TensorBoard
  and JSONL logging into a temporary folder).
- with ``overhead=true`` also ``standard`` without each default (``health=false``, ``spike.enabled=false``,
  ``skip_nonfinite=false``), for what each costs; ``without=`` names a subset. These variants step
  ``standard``'s own state in turn (params, optimizer state, data cursor; each keeps its spike detector's
  state), so one model is resident however many variants run, and every variant times the same model at the
  same point of training. ``steps`` and ``warmup`` are then multiples of ``log_every``: each variant's timed
  steps hold the same number of gradient-health steps.

The variants take turns: ``rounds`` rounds, each giving every variant ``steps`` steps (each round starts with the
next variant), timed from the end of a round's second step to the end of its last (what the loop does once per run
stays out: the rollback ring's starting copy, and the step after it, much slower at 100M: docs/design.md);
the median round is the time; "paired" is the median of each round's ratio to ``standard``'s time in it. Every
round also times a ``peak_size``-square fp32 matmul (the measured peak, 2 n^3 FLOPs); the step's FLOP/s is
tokens/s times PaLM's training FLOPs per token (``core.io.telemetry.flops_per_token``). Gradient health's cost is
also read off ``standard``'s own steps (its due steps against the others of their call). Ratios are the result.

What each default costs (``overhead=true``) is then measured step by step, as rounds cannot resolve a few
percent (at 100M this VM's speed drifted far more than that between rounds: docs/design.md, 'Measured choices'):
``pairs`` times per default, ``standard``'s train step, then the variant's, alone (outside the loop), on the shared
state, neither due for gradient health; the median of 1 - variant / standard is its share inside every step.
Added: health's due steps (above) and what its log steps write (scalars and histograms, timed), the spike ring's
copy of the state every ``ring_gap`` steps (``recipes.train.rollback``; a copy is timed).
"""
from __future__ import annotations

import math
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from purestep.core.config import ConfigError, option
from purestep.core.io.logging import Logger, progress
from purestep.core.spike import SpikeConfig
from purestep.core.io.telemetry import flops_per_token
from purestep.optim.health import computed
from purestep.models import llama
from purestep.models.llama_module import LlamaModule, load_params
from purestep.recipes import standard
from purestep.recipes.bench.plain_run import loss_of, nanogpt_adamw, nanogpt_lr
from purestep.recipes.train import backend
from purestep.recipes.train.backend import SCOPES
from purestep.recipes.train.hooks import Hook
from purestep.recipes.train.loop import Loop, LoopState, Measures
from purestep.recipes.train.metrics import write_health
from purestep.recipes.train.rollback import ring_gap, state_copy

DEFAULTS = ("health", "spike", "skip")   # what overhead=true times standard without
WITHOUT = {"health": "standard, health=false", "spike": "standard, spike.enabled=false",
           "skip": "standard, no non-finite skip"}   # the variant without each, by name
DEFAULTS_TEXT = ",".join(DEFAULTS)
PAIRS = 20   # step pairs per default (overhead=true)

DESCRIPTION = ("tokens/s of purestep recipe=standard's loop against nanoGPT's plain loop (torch.compile(module) over "
               "the model and its loss + torch.optim.AdamW), interleaved; FLOP/s against a measured matmul peak; the "
               "defaults' costs")
LOSS_OUTSIDE = "plain, loss outside"   # the variant loss_outside=true adds


@dataclass
class Config:
    data: str = option("stdlib", "the corpus, as recipe=standard's data= (nanoGPT's: tinyshakespeare.txt)")
    tokenizer: str = option("char", "as recipe=standard's tokenizer=")
    vocab_size: int = option(0, "model vocabulary (0: the tokenizer's; the 100M shape: 32000)", min=0)
    d_model: int = option(128, "model width", min=1)
    n_layers: int = option(4, "transformer blocks", min=1)
    n_heads: int = option(4, "query heads", min=1)
    n_kv_heads: int = option(0, "key/value heads (0: n_heads)", min=0)
    batch_size: int = option(12, "sequences per step", min=1)
    block_size: int = option(64, "tokens per sequence", min=1)
    warmup: int = option(20, "untimed steps per variant (compilation happens here)", min=1)
    steps: int = option(30, "steps per variant per round (timed from the end of the second)", min=3)
    rounds: int = option(11, "interleaved rounds; the median round is the result (many short rounds: a shared "
                             "box's bursts fall in few of them)", min=1)
    log_every: int = option(10, "metric pulls (standard) and loss.item() (plain) every this many steps", min=1)
    compile: bool = option(True, "compile both loops (false: eager, for a quick look)")
    compile_scope: str = option("auto", "recipe=standard's compile_scope", choices=SCOPES)
    plain_optimizer: str = option("fused", "torch.optim.AdamW's implementation in the plain loop",
                                  choices=("fused", "foreach"))
    loss_outside: bool = option(False, "also time the plain loop with the cross entropy taken eagerly outside the "
                                       "compiled module (the weaker baseline): a variant named 'plain, loss outside'")
    overhead: bool = option(False, "also time standard without health, without spike detection, without the skip")
    without: str = option(DEFAULTS_TEXT, "with overhead=true, which of the three to time standard without "
                                               "(comma-separated: fewer resident copies of a large model)")
    pairs: int = option(PAIRS, "with overhead=true, then alternate standard's step with each variant's this many times "
                            "(each default's cost between neighbouring steps, as 100M's drift needs; 0: skip)", min=0)
    profile: int = option(0, "after the rounds, profile this many steps of standard and of plain (torch.profiler "
                               "with inductor's per-kernel records) and print their costliest kernels", min=0)
    peak_size: int = option(2048, "side of the square fp32 matmul that measures the machine's peak", min=1)
    threads: int = option(2, "torch.set_num_threads (0 keeps the default)", min=0)
    seed: int = option(1337, "seed for weights and data", min=0)

    def __post_init__(self):
        _without(self)   # a bad name is an error before anything is built
        for key, default in (("without", DEFAULTS_TEXT), ("pairs", PAIRS)):
            if getattr(self, key) != default and not self.overhead:
                raise ConfigError(f"{key}={getattr(self, key)} times overhead=true's variants: set overhead=true")
        if self.overhead and (self.steps % self.log_every or self.warmup % self.log_every):
            raise ConfigError(f"overhead=true: steps={self.steps} and warmup={self.warmup} must be multiples of "
                              f"log_every={self.log_every} (the variants share one state, so each variant's "
                              f"timed steps then hold the same number of gradient-health steps)")


PRESETS = {
    "100m": {"vocab_size": 32000, "d_model": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4,
             "batch_size": 2, "block_size": 128, "warmup": 10, "steps": 10, "rounds": 3, "log_every": 10},
}


def standard_config(cfg: Config, sharing: int = 1, **changes) -> standard.Config:
    """recipe=standard's config for this benchmark (nanoGPT's hyperparameters), with ``changes``; ``sharing``
    variants step one state, so its schedule spans all their steps."""
    model = llama.LlamaConfig(vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers,
                              n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads)
    total = (cfg.warmup + cfg.steps * cfg.rounds) * sharing + 3 * cfg.pairs * (sharing - 1)
    base = dict(data=cfg.data, tokenizer=cfg.tokenizer, model=model, batch_size=cfg.batch_size,
                block_size=cfg.block_size, lr=1e-3, beta2=0.99, warmup_steps=min(100, total), min_lr=1e-4,
                steps=total, eval_every=0, sample_tokens=0, log_every=cfg.log_every, compile=cfg.compile,
                compile_scope=cfg.compile_scope, seed=cfg.seed, device="cpu", resume="never")
    return standard.Config(**{**base, **changes})


class Standard:
    """recipe=standard's run (``prepare_run``) stepped ``n`` steps at a time through its loop; with ``owner``, the
    steps go on from ``owner``'s state (this variant keeps only its spike detector's state, ``monitor``)."""

    def __init__(self, cfg: standard.Config, folder: Path, owner: Optional["Standard"] = None):
        p = standard.prepare_run(cfg, write=False)
        self.cfg, self.loop, self.owner = p.cfg, LoopState(), owner or self
        self.state = None if owner else p.run.state
        self.monitor = p.run.state.monitor
        self.steps = standard.train_steps(p, p.run.optimizer)
        self.logger = Logger(folder, console=False)
        self.measures = Measures(tokens_per_step=cfg.batch_size * cfg.block_size)
        self.params = None if owner else standard.full_params(p)
        self.model_cfg = p.model_cfg
        self.health_excess: list[float] = []   # seconds a timed health step took beyond the call's others
        self.health_packed = None              # the statistics of the newest due step_once

    def __call__(self, n: int) -> float:
        """Run ``n`` more steps; returns seconds per step from the end of the second to the end of the last (what
        the loop does once per run stays out, as a run enters it once: the rollback ring's starting copy of the
        state, and the step after it, much slower at 100M; docs/design.md, 'Measured choices')."""
        state = self.owner.state._replace(monitor=self.monitor)
        first = int(state.step) + 1
        cfg = replace(self.cfg, steps=first - 1 + n)
        clock = _Clock()
        with Loop(cfg, state, self.steps, self.logger, counters=self.loop, hooks=[clock],
                  measures=self.measures) as loop:
            for batch in loop:
                loop.stepped(*self.steps.train(loop.state, batch))
        result = loop.result
        self.owner.state, self.monitor = result.state, result.state.monitor
        if self.cfg.health:
            self.health_excess += clock.due_excess(first, self.cfg.log_every)
        return clock.per_step()

    def step_once(self) -> float:
        """One train step on the shared state, outside the loop (the batch fetched first); returns its seconds."""
        state = self.owner.state._replace(monitor=self.monitor)
        batch = self.steps.batches.get(int(state.cursor))
        start = time.perf_counter()
        state, metrics = self.steps.train(state, batch, None)
        took = time.perf_counter() - start
        self.owner.state, self.monitor = state, state.monitor
        if "health" in metrics and computed(metrics["health"]):
            self.health_packed = metrics["health"]   # for _health_log_share
        return took


class _Clock(Hook):
    """The time at the end of every step's train step (the first hook to run after it)."""

    def __init__(self):
        self.times: list[float] = []

    def after_step(self, ctx):
        self.times.append(time.perf_counter())

    def per_step(self) -> float:
        return _per_step(self.times)

    def due_excess(self, first: int, every: int) -> list[float]:
        """Seconds each timed step whose count is a multiple of ``every`` (gradient health's due steps; the
        first step counts ``first``) took beyond the median of the call's other timed steps."""
        took = {first + k: b - a for k, (a, b) in enumerate(zip(self.times, self.times[1:]), start=1) if k >= 2}
        due = [n for n in took if n % every == 0]
        rest = [t for n, t in took.items() if n % every]
        return [took[n] - statistics.median(rest) for n in due] if rest else []


class Plain:
    """nanoGPT's ``train.py`` loop (CPU: no GradScaler, no autocast) over the same Llama as an ``nn.Module``; the
    loss compiled with it (``model(X, Y)``), or with ``loss_inside=False`` taken eagerly on its logits."""

    def __init__(self, cfg: Config, std: Standard, loss_inside: bool = True):
        module = load_params(LlamaModule(std.model_cfg), std.params)
        self.forward = torch.compile(module) if cfg.compile else module
        params, self.opt = nanogpt_adamw(module, 1e-3, 0.99, fused=cfg.plain_optimizer == "fused")
        self.params, self.batches, self.total = params, std.steps.batches, cfg.warmup + cfg.steps * cfg.rounds
        self.it, self.log_every, self.loss_inside = 0, cfg.log_every, loss_inside

    def __call__(self, n: int) -> float:
        """Run ``n`` more steps; returns seconds per step from the end of the second to the end of the last."""
        times = []
        for _ in range(n):
            for group in self.opt.param_groups:
                group["lr"] = nanogpt_lr(self.it, self.total)
            batch = self.batches.get(self.it)
            loss = loss_of(self.forward, batch["x"], batch["y"], self.loss_inside)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.it += 1
            if self.it % self.log_every == 0:
                loss.item()
            times.append(time.perf_counter())
        return _per_step(times)


def _per_step(times: list) -> float:
    """Seconds per step between the end of the second step and the end of the last (fewer steps: what there is;
    the warm-up's calls)."""
    first = min(1, len(times) - 1)
    return (times[-1] - times[first]) / max(len(times) - 1 - first, 1)


def matmul_peak(n: int, repeats: int = 3) -> float:
    """FLOP/s of the fastest of ``repeats`` ``n x n`` fp32 matmuls (2 n^3 FLOPs each)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def build(cfg: Config, folder: Path) -> dict:
    """The variants, keyed by name: ``standard`` first, ``plain`` second, ``plain, loss outside`` with
    ``loss_outside``, the overhead variants after."""
    left = _without(cfg) if cfg.overhead else ()
    n = 1 + len(left)
    std = Standard(standard_config(cfg, n), folder / "standard")
    variants = {"standard": std, "plain": Plain(cfg, std)}
    if cfg.loss_outside:
        variants[LOSS_OUTSIDE] = Plain(cfg, std, loss_inside=False)
    changes = {"health": {"health": False}, "spike": {"spike": SpikeConfig(enabled=False)},
               "skip": {"skip_nonfinite": False}}
    for default in left:
        variants[WITHOUT[default]] = Standard(standard_config(cfg, n, **changes[default]), folder / f"no{default}",
                                              owner=std)
    return variants


def _paired(times: list, standard: list) -> float:
    """The median over rounds of a variant's step time over standard's in the same round: the two ran back to back,
    so drift slower than a round cancels (a ratio of medians mixes rounds the machine ran at different speeds)."""
    return statistics.median(t / s for t, s in zip(times, standard))


def _without(cfg: Config) -> tuple:
    names = tuple(n.strip() for n in cfg.without.split(",") if n.strip())
    bad = [n for n in names if n not in DEFAULTS]
    if bad or not names:
        raise ConfigError(f"without={cfg.without!r}: name one or more of {', '.join(DEFAULTS)}, comma-separated")
    return names


def _rounds(cfg: Config, variants: dict) -> tuple[dict, list]:
    """Warm every variant up, then time ``rounds`` interleaved rounds; seconds per step of each round."""
    for name, run in variants.items():
        start = time.perf_counter()
        run(cfg.warmup)
        progress(f"  warmed up {name} ({cfg.warmup} steps) in {time.perf_counter() - start:.1f}s")
        if isinstance(run, Standard):
            run.health_excess.clear()   # the warm-up's due steps compile the update with health
    times: dict = {name: [] for name in variants}
    peaks = []
    names = list(variants)
    for r in range(cfg.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:   # each round starts with the next variant
            times[name].append(variants[name](cfg.steps))
        peaks.append(matmul_peak(cfg.peak_size))
        progress(f"  round {r + 1}/{cfg.rounds}: " + ", ".join(f"{n} {t[-1] * 1e3:.1f} ms" for n, t in times.items()))
    return times, peaks


def _step_pairs(cfg: Config, variants: dict) -> dict:
    """Each default's share of standard's train step, from ``pairs`` pairs per default: standard's step, then the
    variant's without it, on the shared state, alone (outside the loop), neither due for gradient health (its due
    steps are ``_health_cost``'s); the median of 1 - variant / standard. Neighbouring steps run at the same machine
    speed, where ``rounds`` of many steps do not (the 100M shape's drift between rounds: docs/design.md, 'Measured
    choices')."""
    std = variants["standard"]
    due = std.steps.health.due if std.steps.health and cfg.log_every > 1 else (lambda n: False)   # 1: all are
    shares: dict = {d: [] for d in DEFAULTS if WITHOUT[d] in variants}
    for _ in range(cfg.pairs):
        for default in shares:
            pair = []
            for run in (std, variants[WITHOUT[default]]):
                while due(int(std.state.step) + 1):
                    std.step_once()   # a due step, untimed
                pair.append(run.step_once())
            shares[default].append(1 - pair[1] / pair[0])
    return {d: statistics.median(v) for d, v in shares.items()}


def _ring_share(std: "Standard", step: float) -> float:
    """The spike ring's share of ``step``: a copy of the state (fastest of 3) every ``ring_gap`` steps."""
    copies = []
    for _ in range(3):
        start = time.perf_counter()
        state_copy(std.owner.state)
        copies.append(time.perf_counter() - start)
    return min(copies) / ring_gap(std.cfg.spike) / step


def _health_log_share(std: "Standard", step: float, repeats: int = 20) -> float:
    """Gradient health's host work on a log step as a share of ``step`` once every ``log_every`` steps: what
    ``recipes.train.metrics.TrainLog`` writes of it (its per-tensor scalars and histograms, to TensorBoard and
    ``metrics.jsonl``), the median of ``repeats`` writes of a due step's statistics."""
    health, packed = std.steps.health, std.health_packed
    took = []
    for _ in range(repeats):
        start = time.perf_counter()
        write_health(std.logger, health, 0, packed)
        took.append(time.perf_counter() - start)
    return statistics.median(took) / std.cfg.log_every / step


def _profile(name: str, run, steps: int, rows: int = 25) -> None:
    """Print the ``rows`` costliest ops and inductor kernels of ``steps`` steps of ``run``, per step."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(steps)
    print(f"\n{name}: {steps} steps profiled (self CPU time; divide by {steps} for per step)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=90))


def run(cfg: Config) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.profile:   # before anything compiles: the generated kernels then record themselves
        import torch._inductor.config as inductor_config
        inductor_config.cpp.enable_kernel_profile = True
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-speed-") as tmp:
        variants = build(cfg, Path(tmp))
        std = variants["standard"]
        times, peaks = _rounds(cfg, variants)
        excess = list(std.health_excess)    # the rounds' (a profile's steps add more)
        shares = _step_pairs(cfg, variants) if cfg.overhead and cfg.pairs else {}
        step = statistics.median(times["standard"])   # beside the step: health's log writes, the spike ring
        logs = _health_log_share(std, step) if shares and std.health_packed is not None else 0.0
        ring = _ring_share(std, step) if shares and std.cfg.spike.enabled else 0.0
        if cfg.profile:
            for name in ("standard", "plain"):
                _profile(name, variants[name], cfg.profile)
        for v in variants.values():
            if isinstance(v, Standard):
                v.logger.close()
    m = std.model_cfg
    per_token = flops_per_token(llama.matmul_params(std.params), m.n_layers, cfg.block_size, m.d_model)
    out = _table(cfg, std, times, excess, statistics.median(peaks), per_token, time.perf_counter() - start)
    if shares:
        out["defaults"] = _defaults_table(cfg, shares, (out["health_share"] or 0.0) + logs, ring)
    return out


def _table(cfg: Config, std: Standard, times: dict, excess: list, peak: float, per_token: float,
           wall: float) -> dict:
    tokens = cfg.batch_size * cfg.block_size
    med = {name: statistics.median(ts) for name, ts in times.items()}
    paired = {name: _paired(ts, times["standard"]) for name, ts in times.items()}
    m = std.model_cfg
    scope = f"{std.cfg.compile_scope}: {backend.compile_scope(std.cfg, std.params)}"
    print(f"\nbench.speed: Llama d={m.d_model} L={m.n_layers} H={m.n_heads}/{m.n_kv_heads} vocab {m.vocab_size}, "
          f"batch {cfg.batch_size}x{cfg.block_size}, compile={cfg.compile} (standard: compile_scope={scope}), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of "
          f"{cfg.rounds} interleaved rounds of {cfg.steps} steps; matmul peak {peak / 1e9:.1f} GFLOP/s "
          f"({cfg.peak_size}^2 fp32)")
    print("| variant | ms/step | tokens/s | vs plain (tokens/s) | vs standard (step time) | vs standard, paired "
          "| GFLOP/s | of peak |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for name, t in med.items():
        flops = tokens / t * per_token
        rows[name] = {"ms_per_step": t * 1e3, "tokens_per_sec": tokens / t, "vs_plain": med["plain"] / t,
                      "vs_standard": t / med["standard"], "paired_vs_standard": paired[name],
                      "flops": flops, "of_peak": flops / peak}
        r = rows[name]
        print(f"| {name} | {r['ms_per_step']:.1f} | {r['tokens_per_sec']:,.0f} | {r['vs_plain']:.3f} "
              f"| {r['vs_standard']:.3f} | {r['paired_vs_standard']:.3f} | {flops / 1e9:.2f} | {r['of_peak']:.1%} |")
    print(f"standard / plain tokens/s: {rows['standard']['vs_plain']:.3f}x (paired by round: "
          f"{paired['plain']:.3f}x); wall time {wall:.1f}s")
    health = _health_cost(cfg, excess, med["standard"])
    return {"rows": rows, "peak_flops": peak, "wall_seconds": wall, "health_share": health}


def _health_cost(cfg: Config, excesses: list, step: float) -> Optional[float]:
    """Print and return gradient health's share of standard's step from its due steps' excess over the same call's
    other steps (drift slower than a call cancels): the median excess once every ``log_every`` steps."""
    if not excesses:
        return None
    excess = statistics.median(excesses)
    share = excess / cfg.log_every / step
    print(f"gradient health, from standard's own steps: its {len(excesses)} timed due steps took a median "
          f"{excess * 1e3:+.1f} ms beyond the other steps of their call; once every {cfg.log_every} steps that is "
          f"{share:.2%} of the step")
    return share


def _defaults_table(cfg: Config, inside: dict, health_beside: float, ring: float) -> dict:
    """Print and return each default's share of standard's step: inside the step (``_step_pairs``), plus gradient
    health's due steps and log writes (``_health_cost``, ``_health_log_share``) and the spike rollback's ring copies
    (``_ring_share``)."""
    extra = {"health": health_beside, "spike": ring, "skip": 0.0}
    print(f"\neach default's cost, as a share of standard's step ({cfg.pairs} alternating step pairs per default, "
          f"median; added: health's due steps and what its log steps write, the spike ring's copies)")
    print("| default | inside every step (pairs) | due and log steps / ring copies | total |")
    print("|---|---:|---:|---:|")
    total = {}
    for default, share in inside.items():
        total[default] = share + extra[default]
        print(f"| {default} | {share:.2%} | {extra[default]:.2%} | {total[default]:.2%} |")
    return total
