"""Latency and KV-cache sweep: prompt length x generated length x batch, teacher and student in one process.

Per cell and model (``run_sweep``): a fresh KV cache of exactly ``prompt + new`` positions; a **chunked
prefill** (``prefill``: chunks of ``prefill_chunk`` tokens written into the cache, so each chunk's attention mask
is ``chunk x context``, never ``context x context``, and only the last position goes through the head); then
``new`` greedy decode steps. One untimed warm-up run per cell, then ``repeats`` timed runs alternating the models
(machine drift hits both); reported: the **median** prefill time and the median of the runs' mean per-token
decode time, with every run's numbers kept (``prefill_ms_runs``, ``decode_ms_runs``). KV bytes: analytic
(``kv_bytes_per_token`` x batch x positions at the cache dtype) and measured (the bytes of the cache tensors
allocated at that dtype). Peak memory: ``torch.cuda.max_memory_allocated`` over the cell on CUDA, the process's
peak resident set (``ru_maxrss``, monotonic over the process) on CPU.

A cell whose estimated memory exceeds the budget (``memory_limit_mb``, else 80% of what the device has free) is
recorded with ``status=does_not_fit``; an out-of-memory error during the cell as ``status=oom``; neither stops
the sweep. On CPU the models run in fp32 whatever ``cache_dtype`` says (no native bf16 matmul here); the cache
bytes are still measured from tensors allocated at ``cache_dtype``.
"""
from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from purestep.core.device import synchronize
from purestep.models import llama
from purestep.models.sampling import generate

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (column, unit): the schema of results.csv and of every cell row in results.json
COLUMNS = [("model", ""), ("prompt_tokens", "tokens"), ("new_tokens", "tokens"), ("batch", "sequences"),
           ("status", ""), ("prefill_ms", "ms"), ("decode_ms_per_token", "ms/token"), ("tokens_per_s", "tokens/s"),
           ("kv_bytes_analytic", "bytes"), ("kv_bytes_measured", "bytes"), ("kv_bytes_per_token", "bytes/token"),
           ("peak_mb", "MiB")]


@dataclass
class Model:
    name: str
    module: object          # models.llama or models.dba
    params: dict
    cfg: object


def cache_bytes(cache: list) -> int:
    return sum(t.numel() * t.element_size() for layer in cache for t in layer.values())


@torch.no_grad()
def prefill(m: Model, prompt: torch.Tensor, cache: list, chunk: int) -> torch.Tensor:
    """Write ``prompt`` [B, T] into ``cache`` chunk by chunk; the last position's logits [B, V]."""
    hidden = None
    for start in range(0, prompt.shape[1], chunk):
        hidden = m.module.apply(m.params, prompt[:, start:start + chunk], m.cfg, cache=cache, past_len=start,
                                return_hidden="only")
    x = llama.rms_norm(hidden[-1][:, -1], m.params["norm"], m.cfg.norm_eps)
    return F.linear(x, llama.lm_head(m.params))


@torch.no_grad()
def greedy(m: Model, prompt: torch.Tensor, n: int, chunk: int = 512) -> torch.Tensor:
    """``n`` greedy tokens [B, n] after ``prompt`` [B, T]: ``models.sampling.generate`` at temperature 0 over the
    model's KV cache, the prompt prefilled ``chunk`` positions at a time (:func:`prefill`: no [T, V] logits)."""
    cache = m.module.new_cache(m.cfg, prompt.shape[0], prompt.shape[1] + n, dtype=m.params["embed"].dtype,
                               device=prompt.device)

    def forward(tokens, past_len):
        if past_len == 0:
            return prefill(m, tokens, cache, chunk)[:, None]
        return m.module.apply(m.params, tokens, m.cfg, cache=cache, past_len=past_len)

    return generate(forward, prompt, n, temperature=0)


@torch.no_grad()
def timed_run(m: Model, prompt: torch.Tensor, new: int, chunk: int, cache=None) -> tuple[float, float]:
    """One prefill + ``new`` decode steps over ``cache`` (default: a fresh one of ``prompt + new`` positions):
    (prefill seconds, mean seconds per decode step)."""
    device = prompt.device
    if cache is None:
        cache = m.module.new_cache(m.cfg, prompt.shape[0], prompt.shape[1] + new, dtype=m.params["embed"].dtype,
                                   device=device)
    synchronize(device)
    t0 = time.perf_counter()
    logits = prefill(m, prompt, cache, chunk)
    synchronize(device)
    first = time.perf_counter() - t0
    past, steps = prompt.shape[1], []
    for _ in range(new):
        token = logits.argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        logits = m.module.apply(m.params, token, m.cfg, cache=cache, past_len=past)[:, -1]
        synchronize(device)
        steps.append(time.perf_counter() - t0)
        past += 1
    return first, sum(steps) / len(steps)


def estimate_bytes(m: Model, batch: int, tokens: int, chunk: int) -> int:
    """What a cell needs beyond the weights: the cache, the per-chunk activations (hidden states of every
    layer, the MLP, attention scores if materialized) and the last logits; fp32."""
    c, cfg = min(chunk, tokens), m.cfg
    kv = m.module.kv_bytes_per_token(cfg, 4) * batch * tokens
    act = batch * c * (cfg.d_model * (cfg.n_layers + 4) + 3 * cfg.ffn_dim) * 4
    scores = batch * cfg.n_heads * c * tokens * 4
    return kv + act + scores + batch * cfg.vocab_size * 4


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024       # KiB on Linux


def prompt_batch(tokens: np.ndarray, length: int, batch: int, device) -> torch.Tensor:
    """``length`` held-out tokens (tiled when the text is shorter), the same prompt in every row."""
    row = torch.as_tensor(np.resize(np.asarray(tokens[:length], dtype=np.int64), length), device=device)
    return row[None].expand(batch, length).contiguous()


def _row(m: Model, T: int, new: int, B: int, status: str, dtype_bytes: int) -> dict:
    per_token = m.module.kv_bytes_per_token(m.cfg, dtype_bytes)
    return {"model": m.name, "prompt_tokens": T, "new_tokens": new, "batch": B, "status": status,
            "prefill_ms": None, "decode_ms_per_token": None, "tokens_per_s": None,
            "kv_bytes_analytic": per_token * B * (T + new), "kv_bytes_measured": None, "kv_bytes_per_token": None,
            "peak_mb": None}


def _cell(models: list, tokens, T: int, new: int, B: int, bc, device, budget: int) -> list[dict]:
    """Every model's row for one cell: warm-up, then ``bc.repeats`` alternating timed runs."""
    dtype = DTYPES[bc.cache_dtype]
    rows = {m.name: _row(m, T, new, B, "ok", dtype.itemsize) for m in models}
    fits = [m for m in models if estimate_bytes(m, B, T + new, bc.prefill_chunk) <= budget]
    for m in models:
        if m not in fits:
            rows[m.name]["status"] = "does_not_fit"
    prompt = prompt_batch(tokens, T, B, device)
    runs = {m.name: [] for m in fits}
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for r in range(bc.repeats + 1):                 # run 0 is the untimed warm-up
            for m in fits:
                out = timed_run(m, prompt, new, bc.prefill_chunk)
                if r:
                    runs[m.name].append(out)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:  # out of memory: recorded, not fatal
        if isinstance(e, RuntimeError) and not isinstance(e, torch.OutOfMemoryError) \
                and "can't allocate memory" not in str(e):
            raise
        for m in fits:
            rows[m.name].update(status="oom", error=" ".join(str(e).split())[:200])
        return list(rows.values())
    for m in fits:
        row, prefills, decodes = rows[m.name], [p for p, _ in runs[m.name]], [d for _, d in runs[m.name]]
        cache = m.module.new_cache(m.cfg, B, T + new, dtype=dtype, device=device)   # measured at cache_dtype
        measured = cache_bytes(cache)
        del cache
        decode = statistics.median(decodes)
        row.update(prefill_ms=1e3 * statistics.median(prefills), decode_ms_per_token=1e3 * decode,
                   tokens_per_s=B / decode, kv_bytes_measured=measured, kv_bytes_per_token=measured / (B * (T + new)),
                   peak_mb=peak_mb(device), prefill_ms_runs=[1e3 * p for p in prefills],
                   decode_ms_runs=[1e3 * d for d in decodes])
    return list(rows.values())


def run_sweep(models: list, tokens, bc, device, say) -> list[dict]:
    """Rows (``COLUMNS``, plus each timed run) for every model at every cell of prompt x new x batch."""
    budget = int(bc.memory_limit_mb * 2**20) if bc.memory_limit_mb else int(0.8 * free_bytes(device))
    rows, cells = [], [(T, n, B) for B in bc.batches for n in bc.new_tokens for T in bc.prompt_tokens]
    for i, (T, new, B) in enumerate(cells):
        start = time.perf_counter()
        cell = _cell(models, tokens, T, new, B, bc, device, budget)
        rows += cell
        say(f"benchmark: cell {i + 1}/{len(cells)} context {T} + {new}, batch {B}: " + ", ".join(
            f"{r['model']} " + (f"decode {r['decode_ms_per_token']:.2f} ms/token, prefill {r['prefill_ms']:.0f} ms"
                                if r["status"] == "ok" else r["status"]) for r in cell)
            + f" ({time.perf_counter() - start:.1f}s)")
    return rows


def crossover(rows: list) -> list[dict]:
    """Per (batch, new tokens): the shortest measured context from which the student decodes faster than the
    teacher at that and every longer measured context (None: not at the longest), and the decode ratio
    (student / teacher ms per token) at every context measured for both."""
    ok = {(r["model"], r["prompt_tokens"], r["new_tokens"], r["batch"]): r for r in rows if r["status"] == "ok"}
    ratios = {}
    for (model, T, new, B), r in ok.items():
        if model == "student" and ("teacher", T, new, B) in ok:
            ratios.setdefault((B, new), {})[T] = r["decode_ms_per_token"] / ok[("teacher", T, new, B)][
                "decode_ms_per_token"]
    out = []
    for (B, new), by_context in sorted(ratios.items()):
        faster = None
        for T in sorted(by_context, reverse=True):
            if by_context[T] >= 1:
                break
            faster = T
        out.append({"batch": B, "new_tokens": new, "faster_from_context": faster,
                    "ratios": dict(sorted(by_context.items()))})
    return out
