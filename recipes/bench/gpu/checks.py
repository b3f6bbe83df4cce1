"""Correctness on the accelerator: the same steps on the CPU and the device, bf16 and fp16, compiled against eager,
donation, checkpoints through a file, cached generation, and which kernel SDPA took.

Every check trains a small Llama (``MODEL``) with the public pieces research code uses (``core.step.make_train_step``,
``optim.chain(clip_by_global_norm, adamw)``, ``core.state.init_state``) for ``STEPS`` steps on fixed random batches
and raises ``AssertionError`` with the measured figure when a tolerance is missed. The learning rate is small
(``LR``): Adam's first updates are ``lr * sign(g)`` for any gradient far above eps, so a gradient that is zero up
to rounding on one device and not on the other moves a weight by ``2 lr``; at 1e-5 that stays under the 1e-4
parameter tolerance while a device bug (a wrong mask, a lost dtype, a CPU tensor in a CUDA graph) does not.
"""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import torch

from purestep import optim
from purestep.core.compile import NO_MIX_ORDER_REDUCTION
from purestep.core.io import checkpoint
from purestep.core.state import init_state
from purestep.core.step import Compile, make_train_step
from purestep.core.tree import leaves_of, tree_map
from purestep.models import llama
from purestep.models.sampling import generate
from purestep.recipes.bench.gpu.report import Report, Skip
from purestep.recipes.train.backend import efficient_attention

MODEL = dict(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2)
STATE_HEAVY = dict(MODEL, d_model=512, n_layers=4)   # the donation check's: ~13M params, the state dominates the peak
TINY = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2)   # the CPU smoke's
BATCH, BLOCK, STEPS, LR = 4, 64, 5, 1e-5
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4          # fp32 on two devices (the tolerances)
HALF_TOL = {"bf16": 3e-2, "fp16": 1e-2}  # |loss - fp32 loss| / fp32 loss, each step
MUON_TOL = 5e-2                          # |delta_dev - delta_cpu| / |delta_cpu| of Muon's bf16 orthogonalised steps


def run_checks(report: Report, device: torch.device, compile: bool, tiny: bool = False) -> None:
    """Every check, each its own report item (a failure does not stop the next)."""
    cfg = llama.LlamaConfig(**(TINY if tiny else MODEL))
    with _no_tf32():
        with report.item("checks", "cpu_vs_device_fp32") as item:
            item.update(_cpu_vs_device(cfg, device))
        with report.item("checks", "compiled_vs_eager") as item:
            item.update(_compiled_vs_eager(cfg, device, compile))
        with report.item("checks", "compiled_vs_eager_mha") as item, _recipes_attention(compile):
            item.update(_compiled_vs_eager(llama.LlamaConfig(**{**(TINY if tiny else MODEL), "n_kv_heads": 0}),
                                           device, compile))
        for precision in ("bf16", "fp16"):
            with report.item("checks", f"{precision}_vs_fp32") as item:
                item.update(_half_vs_fp32(cfg, device, precision, compile))
        with report.item("checks", "donation") as item:
            item.update(_donation(cfg if tiny else llama.LlamaConfig(**STATE_HEAVY), device, compile))
        with report.item("checks", "muon_compiled_device_vs_eager_cpu") as item:
            item.update(_muon(cfg, device, compile))
        with report.item("checks", "checkpoint_roundtrip") as item:
            item.update(_checkpoint_roundtrip(cfg, device))
        with report.item("checks", "kv_cache_generation") as item:
            item.update(_kv_cache(cfg, device))
    with report.item("checks", "sdpa_kernel") as item:
        item.update(_sdpa_kernel(device))


@contextlib.contextmanager
def _no_tf32():
    """Full fp32 matmuls on CUDA for the comparisons (TensorFloat-32 keeps 10 mantissa bits)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@contextlib.contextmanager
def _recipes_attention(compile: bool):
    """SDPA's kernels as the recipes allow them in a compiled fp32 run (``recipes.train.backend``); a model without
    GQA would take the memory-efficient kernel in fp32."""
    before = torch.backends.cuda.mem_efficient_sdp_enabled()
    torch.backends.cuda.enable_mem_efficient_sdp(efficient_attention(compile, "fp32"))
    try:
        yield
    finally:
        torch.backends.cuda.enable_mem_efficient_sdp(before)


def batches(cfg: llama.LlamaConfig, n: int = STEPS, seed: int = 0) -> list[dict]:
    """``n`` fixed random batches on the CPU."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, cfg.vocab_size, (n, BATCH, BLOCK + 1), generator=g)
    return [{"x": t[:, :-1].contiguous(), "y": t[:, 1:].contiguous()} for t in tok]


def train(cfg: llama.LlamaConfig, device: torch.device, *, precision: str = "fp32", compile: bool | Compile = False,
          donate: bool = False, steps: int = STEPS, peaks: dict | None = None,
          opt=None) -> tuple[list[float], object]:
    """``steps`` steps from the seeded init on ``device``: the losses and the final state. ``peaks`` (CUDA) gets
    ``"mib"``: the peak allocated over the steps after the first (the compile's own allocations left out).
    ``opt``: the transform (default: clipped AdamW at ``LR``)."""
    opt = opt or optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=LR, weight_decay=0.1))
    step = make_train_step(lambda p, b, layers=None: llama.loss(p, b, cfg, layers=layers), opt, precision=precision,
                           compile=compile, donate=donate)
    state = init_state(llama.init(cfg, seed=0, device=device), opt, precision=precision)
    losses = []
    for i, batch in enumerate(batches(cfg, steps)):
        state, metrics = step(state, tree_map(lambda t: t.to(device), batch))
        losses.append(metrics["loss"])
        if i == 0 and peaks is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
    if peaks is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        peaks["mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return [float(x) for x in losses], state


def max_diff(a, b) -> float:
    """The largest absolute difference between two pytrees' float leaves (compared on the CPU, in float64)."""
    return max((float((x.detach().cpu().double() - y.detach().cpu().double()).abs().max())
                for x, y in zip(leaves_of(a), leaves_of(b)) if x.is_floating_point() and x.numel()), default=0.0)


def _compare(name: str, losses_a, losses_b, params_a, params_b, loss_tol=LOSS_TOL, param_tol=PARAM_TOL) -> dict:
    loss_diff = max(abs(a - b) for a, b in zip(losses_a, losses_b))
    param_diff = max_diff(params_a, params_b)
    out = {"max_loss_diff": loss_diff, "max_param_diff": param_diff, "losses": losses_a,
           "summary": f"loss diff {loss_diff:.2e} (tol {loss_tol:g}), param diff {param_diff:.2e} (tol {param_tol:g})"}
    assert all(map(_finite, losses_a + losses_b)), f"{name}: non-finite loss {losses_a} / {losses_b}"
    assert loss_diff <= loss_tol and param_diff <= param_tol, f"{name}: {out['summary']}"
    return out


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _cpu_vs_device(cfg, device) -> dict:
    """The same eager fp32 steps on the CPU and on the device."""
    cpu_losses, cpu_state = train(cfg, torch.device("cpu"))
    dev_losses, dev_state = train(cfg, device)
    return _compare("cpu vs " + device.type, dev_losses, cpu_losses, dev_state.params, cpu_state.params)


def _compiled_vs_eager(cfg, device, compile) -> dict:
    if not compile:
        raise Skip("compile=false")
    eager_losses, eager_state = train(cfg, device)
    comp_losses, comp_state = train(cfg, device, compile=True)
    return _compare("compiled vs eager", comp_losses, eager_losses, comp_state.params, eager_state.params)


def _muon(cfg, device, compile) -> dict:
    """``optim.muon`` (Newton-Schulz in bf16, as torch.optim.Muon) compiled on the device against eager on the CPU
    (which tests/test_muon.py holds equal to torch.optim.Muon): the weights' movement agrees to ``MUON_TOL`` of its
    size (bf16 matmuls round differently on the two devices)."""
    opt = optim.muon(lr=1e-3, aux=optim.adamw(lr=1e-3))
    start = llama.init(cfg, seed=0)
    cpu_losses, cpu_state = train(cfg, torch.device("cpu"), opt=opt)
    dev_losses, dev_state = train(cfg, device, compile=Compile(compile, cuda_options=NO_MIX_ORDER_REDUCTION), opt=opt)
    moved = max_diff(cpu_state.params, start)
    rel = max_diff(dev_state.params, cpu_state.params) / moved
    loss_diff = max(abs(a - b) for a, b in zip(dev_losses, cpu_losses))
    out = {"max_rel_update_diff": rel, "moved": moved, "max_loss_diff": loss_diff, "losses": dev_losses,
           "summary": f"update diff {rel:.2e} of its size (tol {MUON_TOL:g}; moved {moved:.2e}), "
                      f"loss diff {loss_diff:.2e}"}
    assert all(map(_finite, dev_losses)), f"muon: non-finite loss {dev_losses}"
    assert rel <= MUON_TOL, out["summary"]
    return out


def _half_vs_fp32(cfg, device, precision, compile) -> dict:
    """bf16 / fp16 autocast (fp16 with the dynamic loss scale): finite, no step skipped, each loss within
    ``HALF_TOL`` of fp32's (relative)."""
    ref, _ = train(cfg, device, compile=compile)
    losses, state = train(cfg, device, precision=precision, compile=compile)
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    out = {"losses": losses, "fp32_losses": ref, "max_rel_loss_diff": rel,
           "summary": f"max relative loss diff to fp32 {rel:.2e} (tol {HALF_TOL[precision]:g})"}
    if precision == "fp16":
        out["loss_scale"] = float(state.loss_scale["scale"])
        out["summary"] += f", loss scale {out['loss_scale']:g}"
    assert all(map(_finite, losses)), f"{precision}: non-finite loss {losses}"
    assert all(bool(torch.isfinite(p).all()) for p in leaves_of(state.params)), f"{precision}: non-finite params"
    assert rel <= HALF_TOL[precision], out["summary"]
    return out


def _donation(cfg, device, compile) -> dict:
    """The donated step (the new state written into the old buffers) gives the pure step's numbers and, after its
    first (compiling) step, peaks no higher. At full scale the model's state (params and Adam's moments of ~13M
    params) dominates the peak, so the saving of not holding two states shows: on the tiny ``MODEL`` the
    allocator's noise was larger than the state (docs/gpu.md, "Measured: one H200, 2026-11-27")."""
    pure_peak, don_peak = {}, {}
    pure_losses, pure_state = train(cfg, device, compile=compile, peaks=pure_peak)
    pure_params = tree_map(lambda t: t.cpu(), pure_state.params)   # nothing of the pure run stays on the device
    del pure_state
    don_losses, don_state = train(cfg, device, compile=compile, donate=True, peaks=don_peak)
    out = _compare("donated vs pure", don_losses, pure_losses, don_state.params, pure_params)
    if pure_peak:
        state_mib = sum(t.numel() * t.element_size() for t in leaves_of(don_state)) / 2**20
        out.update(pure_peak_mib=pure_peak["mib"], donated_peak_mib=don_peak["mib"], state_mib=state_mib)
        out["summary"] += (f"; steps 2-{STEPS} peak {don_peak['mib']:.1f} MiB donated vs {pure_peak['mib']:.1f} MiB "
                           f"pure ({state_mib:.1f} MiB of state)")
        assert don_peak["mib"] <= pure_peak["mib"], out["summary"]
    return out


def _checkpoint_roundtrip(cfg, device) -> dict:
    """A trained state on the device -> file -> CPU -> device: bitwise equal at every stage."""
    _, state = train(cfg, device, steps=2)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.msgpack"
        size = checkpoint.save(path, state, step=2)
        on_cpu = checkpoint.load(path, template=state, device="cpu")["state"]
        back = tree_map(lambda t: t.to(device), on_cpu)
    pairs = list(zip(leaves_of(state), leaves_of(on_cpu), leaves_of(back)))
    assert all(c.device.type == "cpu" for _, c, _ in pairs), "the CPU load left a tensor off the CPU"
    assert all(b.device == a.device for a, _, b in pairs), "the reload did not land on the device"
    bad = [i for i, (a, c, b) in enumerate(pairs) if not (torch.equal(a.cpu(), c) and torch.equal(a, b))]
    assert not bad, f"{len(bad)} of {len(pairs)} leaves differ after the round trip"
    return {"bytes": size, "leaves": len(pairs), "summary": f"{len(pairs)} leaves bitwise equal, {size:,} bytes"}


def _kv_cache(cfg, device, new_tokens: int = 24) -> dict:
    """Greedy generation through the KV cache (``llama.decoder``) equals recomputing the whole sequence per token."""
    params = llama.init(cfg, seed=1, device=device)
    prompt = batches(cfg, 1)[0]["x"][:2, :16].to(device)
    cached = generate(llama.decoder(params, cfg, 2, 16 + new_tokens), prompt, new_tokens, temperature=0)

    seq = [prompt]

    def full(tokens, past_len):   # no cache: the whole sequence so far, every token
        seq[0] = tokens if past_len == 0 else torch.cat([seq[0], tokens], dim=1)
        return llama.apply(params, seq[0], cfg)
    plain = generate(full, prompt, new_tokens, temperature=0)
    with torch.no_grad():
        seq = torch.cat([prompt, cached], dim=1)
        step_logits = llama.decoder(params, cfg, 2, seq.shape[1])(seq[:, :-1], 0)
        whole = llama.apply(params, seq[:, :-1], cfg)
    diff = float((step_logits - whole).abs().max())
    same = bool(torch.equal(cached, plain))
    out = {"tokens_equal": same, "max_logit_diff": diff,
           "summary": f"{new_tokens} greedy tokens x 2 rows {'equal' if same else 'DIFFER'}, logit diff {diff:.1e}"}
    assert same and diff <= 1e-4, out["summary"]
    return out


FUSED = ("flash", "fmha", "efficient", "cudnn", "attention_kernel")   # SDPA's fused kernels' names contain one


def _sdpa_kernel(device) -> dict:
    """Which kernel SDPA ran for the model's causal GQA attention in bf16 (profiler kernel names): a fused one
    (flash, memory-efficient or cuDNN), not the math fallback."""
    if device.type != "cuda":
        raise Skip(f"no CUDA kernels on {device.type}")
    cfg = llama.LlamaConfig(vocab_size=256, d_model=512, n_layers=1, n_heads=8, n_kv_heads=2)
    params = llama.init(cfg, seed=0, device=device)
    tokens = torch.randint(0, 256, (4, 256), device=device)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        llama.apply(params, tokens, cfg)
        with torch.profiler.profile(activities=activities) as prof:
            llama.apply(params, tokens, cfg)
            torch.cuda.synchronize(device)
    names = sorted({e.key for e in prof.key_averages()})
    attention = [n for n in names if any(k in n.lower() for k in FUSED + ("attention", "sdp", "softmax"))]
    fused = [n for n in attention if any(k in n.lower() for k in FUSED)]
    out = {"attention_kernels": attention[:20], "fused": fused[:10],
           "summary": ("fused: " + ", ".join(n[:60] for n in fused[:3])) if fused else "no fused kernel"}
    assert fused, f"SDPA took no fused kernel; attention-related names: {attention[:10]}"
    return out
