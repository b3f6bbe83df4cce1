"""Speed and memory, bf16 and compiled: the functional step against the plain PyTorch loop on the same Llama and
the same batch, in one process, and the card's bf16 matmul peak measured in the same run (for MFU).

- ``functional``: ``core.step.make_train_step`` over ``llama.loss`` with ``optim.chain(clip_by_global_norm(1.0),
  adamw(weight_decay=0.1))``, bf16 autocast over fp32 master weights, compiled with the recipes' ``compile_scope``
  rule (``recipes.train.backend.auto_scope``: the whole step on CUDA; on a CPU one block graph beyond 4 layers) and
  ``grad_mode`` rule (``auto_grad_mode``: beyond 4 layers the loss's graph and the update's, through autograd), the
  state donated, as ``purestep`` runs it.
- ``plain``: ``models.llama_module.LlamaModule`` (the same weights) under ``torch.compile(module)`` called as
  nanoGPT's ``model(X, Y)``, so the cross entropy is compiled with the module, bf16 autocast, ``loss.backward()``,
  ``clip_grad_norm_(1.0)``, ``torch.optim.AdamW(fused=True, weight_decay=0.1)``: nanoGPT's loop, the baseline the
  ratio is against. ``plain_loss_outside`` takes the cross entropy eagerly on the compiled module's logits instead
  (the weaker baseline of the earlier figures, where the vocabulary is large).

Each variant is built alone (the other freed), runs ``warmup`` untimed steps (the first compiles), then ``steps``
timed steps; peak memory is ``max_memory_allocated`` over the timed steps (state, gradients, activations: what the
variant needs to keep training). Tokens/s times PaLM's FLOPs per token (``core.io.telemetry.flops_per_token``) over
the measured matmul peak is the MFU.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from purestep import optim
from purestep.core.state import init_state
from purestep.core.step import Compile, Gradients, make_train_step
from purestep.core.io.telemetry import GPU_PEAK_FLOPS, flops_per_token
from purestep.core.tree import size
from purestep.models import llama
from purestep.models.llama_module import LlamaModule, load_params
from purestep.recipes.bench.gpu.report import Report
from purestep.recipes.train.backend import auto_grad_mode, auto_scope


@dataclass(frozen=True)
class Shape:
    model: dict
    batch: int
    block: int


SHAPES = {   # GPT-2 small's width and depth with Llama blocks; Llama-3.2-1B's dims (random init)
    "124m": Shape(dict(vocab_size=50304, d_model=768, n_layers=12, n_heads=12), batch=16, block=1024),
    "1b": Shape(dict(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                     rope_theta=500000.0), batch=4, block=1024),
    "tiny": Shape(dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2), batch=2, block=64),
}
LR, WEIGHT_DECAY, CLIP = 3e-4, 0.1, 1.0


def matmul_peak(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of an ``n``-square bf16 matrix product on ``device`` (fp32 on the CPU), the mean of ``reps`` after
    three warm-ups."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(cfg: llama.LlamaConfig, shape: Shape, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg.vocab_size, (shape.batch, shape.block + 1), generator=g).to(device)
    return {"x": tok[:, :-1].contiguous(), "y": tok[:, 1:].contiguous()}


def _functional(cfg, params, batch, device, compile, scope=None, grad_mode=None):
    opt = optim.chain(optim.clip_by_global_norm(CLIP), optim.adamw(lr=LR, weight_decay=WEIGHT_DECAY))
    grad_mode = grad_mode or (None if scope else auto_grad_mode(cfg.n_layers, auto_scope(cfg.n_layers, device.type)))
    scope = scope or auto_scope(cfg.n_layers, device.type)
    precision = "bf16" if device.type == "cuda" else "fp32"
    step = make_train_step(lambda p, b, layers=None: llama.loss(p, b, cfg, layers=layers), opt, precision=precision,
                           compile=Compile(compile, scope=scope), donate=True, gradients=Gradients(grad_mode))
    holder = {"state": init_state(params, opt, precision=precision)}

    def run():
        holder["state"], metrics = step(holder["state"], batch)
        return metrics["loss"]
    return run, f"make_train_step, compile_scope={scope}{', grad_mode=' + grad_mode if grad_mode else ''}, donated"


def _plain(cfg, params, batch, device, compile, loss_inside: bool = True):
    """nanoGPT's loop; ``loss_inside``: the cross entropy compiled with the module (``LlamaModule.forward(x, y)``
    returns the loss, as nanoGPT's ``GPT.forward``), else computed eagerly on the compiled module's logits."""
    module = load_params(LlamaModule(cfg).to(device), params)
    forward = torch.compile(module) if compile else module
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    half = device.type == "cuda"

    def run():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=half):
            if loss_inside:
                loss = forward(batch["x"], batch["y"])
            else:
                logits = forward(batch["x"])
        if not loss_inside:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["y"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP, foreach=True)
        opt.step()
        return loss.detach()
    return run, ("torch.compile(LlamaModule), the loss inside" if loss_inside else
                 "torch.compile(LlamaModule), the loss outside") + " + AdamW(fused=True)"


VARIANTS = {"functional": _functional, "plain": _plain,     # functional: the recipes' compile_scope=auto
            "functional_step": lambda *args: _functional(*args, scope="step", grad_mode="func"),  # one graph, any depth
            "functional_block": lambda *args: _functional(*args, scope="block"),   # one block graph for every layer
            "plain_loss_outside": lambda *args: _plain(*args, loss_inside=False)}  # the loss eager, on the logits


def measure(name: str, shape: Shape, device: torch.device, compile: bool, warmup: int, steps: int,
            profile_to: Path | None = None) -> dict:
    """One variant alone: first step (compile), ``warmup - 1`` more, then ``steps`` timed; peak over those. With
    ``profile_to`` two more steps run under ``torch.profiler`` (:func:`profile_steps`)."""
    cfg = llama.LlamaConfig(**shape.model)
    params = llama.init(cfg, seed=0, device=device)
    n_params = size(params)
    batch = _batch(cfg, shape, device)
    step, how = VARIANTS[name](cfg, params, batch, device, compile)
    del params
    start = time.perf_counter()
    first = float(step())
    first_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    last = float(loss)
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    tokens = shape.batch * shape.block
    return {"variant": name, "how": how, "params": n_params, "first_step_s": round(first_s, 1),
            "ms_per_step": seconds * 1e3, "tokens_per_s": tokens / seconds, "peak_mib": peak,
            "loss_first": first, "loss_last": last,
            "flops_per_token": flops_per_token(n_params, cfg.n_layers, shape.block, cfg.d_model),
            **(_profiled(step, device, profile_to) if profile_to else {})}


def _profiled(step, device: torch.device, path: Path) -> dict:
    """:func:`profile_steps`, its failure reported beside the timing instead of failing it (the profiler needs
    CUPTI on CUDA)."""
    try:
        return profile_steps(step, device, path)
    except Exception as e:   # noqa: BLE001 - the timing above stands without the profile
        return {"profile_error": f"{type(e).__name__}: {e}"}


def profile_steps(step, device: torch.device, path: Path, steps: int = 2, top: int = 25) -> dict:
    """``steps`` more steps under ``torch.profiler``: the device's busy time per step beside the wall time (a step
    whose kernels keep the device busy for less than its wall time waits on the host: launches, guards, Python),
    the kernel count, and the ``top`` operators and kernels by self device time, written to ``path``."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    self_device = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))  # noqa: E731
    kernels = [e for e in events if self_device(e) > 0 and getattr(e, "device_type", None) is not None
               and "cuda" in str(e.device_type).lower()]
    busy = sum(self_device(e) for e in kernels) / steps / 1e3
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = events.table(sort_by=sort, row_limit=top, max_name_column_width=90)
    path.write_text(f"wall {wall * 1e3:.1f} ms/step, device busy {busy:.1f} ms/step, "
                    f"{sum(e.count for e in kernels) // steps} kernels/step\n\n{table}\n")
    heaviest = sorted(kernels, key=self_device, reverse=True)[:8]
    return {"profile": {"wall_ms": wall * 1e3, "device_busy_ms": busy, "kernels_per_step":
                        sum(e.count for e in kernels) // steps, "file": path.name,
                        "top": [(e.key[:80], round(self_device(e) / steps / 1e3, 2), e.count // steps)
                                for e in heaviest]}}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_speed(report: Report, device: torch.device, shapes: tuple[str, ...], compile: bool, warmup: int,
              steps: int, gate: bool = True, variants: tuple[str, ...] = ("functional", "plain"),
              profile: bool = False) -> None:
    """The matmul peak, then per shape both variants (functional first) and their ratios; with ``gate`` a ratio
    item fails when the functional step is slower or peaks higher than plain; with ``profile`` each variant's
    profile (:func:`profile_steps`) is written beside the report."""
    peak = None
    with report.item("speed", "matmul_peak") as item:
        peak = matmul_peak(device, 8192 if device.type == "cuda" else 512)
        spec = next((v for k, v in GPU_PEAK_FLOPS.items() if k in _card(device)), None)
        item.update(flops=peak, spec_flops=spec, summary=f"{peak / 1e12:.1f} TFLOP/s measured" +
                    (f" ({peak / spec:.0%} of the {spec / 1e12:.0f} TFLOP/s spec)" if spec else ""))
    for shape_name in shapes:
        shape, rows = SHAPES[shape_name], {}
        for name in variants:
            _free(device)
            with report.item("speed", f"{shape_name}/{name}") as item:
                rows[name] = measure(name, shape, device, compile, warmup, steps,
                                     report.folder / f"profile-{shape_name}-{name}.txt" if profile else None)
                r = rows[name]
                if peak:
                    r["mfu"] = r["tokens_per_s"] * r["flops_per_token"] / peak
                item.update(r, summary=f"{r['tokens_per_s']:,.0f} tokens/s, {r['ms_per_step']:.1f} ms/step"
                            + (f", peak {r['peak_mib']:,.0f} MiB" if r["peak_mib"] else "")
                            + (f", MFU {r['mfu']:.1%}" if "mfu" in r else "")
                            + (f"; profiled: device busy {r['profile']['device_busy_ms']:.1f} of "
                               f"{r['profile']['wall_ms']:.1f} ms" if "profile" in r else ""))
        _free(device)
        if {"functional", "plain"} <= set(rows):
            with report.item("speed", f"{shape_name}/ratio") as item:
                item.update(_ratio(rows, shape_name, shape, gate))
    _free(device)


def _card(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _ratio(rows: dict, shape_name: str, shape: Shape, gate: bool) -> dict:
    """``functional`` (the recipes' compile scope) over ``plain`` (the loss compiled with the module); ``gate``: a
    failure below 1.0x tokens/s or above 1.0x peak memory. The other variants are reported beside it, each over
    ``plain``."""
    f, p = rows["functional"], rows["plain"]
    speed = f["tokens_per_s"] / p["tokens_per_s"]
    memory = f["peak_mib"] / p["peak_mib"] if f["peak_mib"] and p["peak_mib"] else None
    others = {name: r["tokens_per_s"] / p["tokens_per_s"] for name, r in rows.items()
              if name not in ("functional", "plain")}   # each over plain
    out = {"tokens_per_s_ratio": speed, "peak_memory_ratio": memory, "other_ratios": others,
           "summary": f"functional / plain: {speed:.3f}x tokens/s" +
                      (f", {memory:.3f}x peak memory" if memory else "") +
                      "".join(f"; {name}: {r:.3f}x tokens/s" for name, r in others.items()),
           "table": _table(rows, shape_name, shape)}
    assert not gate or (speed >= 1.0 and (memory is None or memory <= 1.0)), out["summary"]
    return out


def _table(rows: dict, shape_name: str, shape: Shape) -> str:
    lines = [f"{shape_name}: {next(iter(rows.values()))['params'] / 1e6:.1f}M params, batch {shape.batch} x "
             f"{shape.block} tokens, bf16 autocast", "",
             "| variant | tokens/s | ms/step | peak MiB | MFU | first step s | how |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows.values():
        peak = f"{r['peak_mib']:,.0f}" if r["peak_mib"] else "-"
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else "-"
        lines.append(f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.1f} | {peak} | {mfu} "
                     f"| {r['first_step_s']} | {r['how']} |")
    return "\n".join(lines)
