"""The upcycle recipe's benchmark phase: teacher against student, measured in the same process.

- **Perplexity** of both models on the same held-out windows (the test half of the validation split), computed
  once: no best-of-repeats (the lowest of several runs flatters) and never on training windows.
  The held-out perplexity after each earlier phase (surgery, blockwise, global) comes from that phase's
  ``heldout.json``, computed on the same windows.
- **Latency** with a KV cache: the same held-out prompt tokens for both models, prefill timed apart from the
  per-token decode steps (greedy), one untimed warm-up, then ``repeats`` runs alternating teacher and student
  (machine drift hits both), the **median** of each. The decode ratio is the number to read.
- **KV bytes per token**: the analytic formula (``kv_bytes_per_token`` at the cache's element size) and the
  bytes of the actual cache tensors the decode wrote into, divided by their token capacity.
- Parameter counts (all, attention only).

Written as ``benchmark/results.json``, ``results.csv``, ``results.md`` (Markdown tables), TensorBoard scalars in
``benchmark/`` and, when matplotlib is importable, ``benchmark/results.png``.
"""
from __future__ import annotations

import csv
import importlib.util
import statistics
import time

import torch

from core.device import synchronize
from core.logging import Logger
from core.tree import cast, size
from models import dba, llama
from recipes.upcycle.phases import Context, ppl, write_json


def cache_bytes(cache: list) -> int:
    return sum(t.numel() * t.element_size() for layer in cache for t in layer.values())


@torch.no_grad()
def latency(module, params: dict, cfg, prompt: torch.Tensor, new_tokens: int) -> dict:
    """One prefill + ``new_tokens`` greedy decode steps over a fresh cache: seconds, and the cache's bytes."""
    device = prompt.device
    max_len = prompt.shape[1] + new_tokens
    cache = module.new_cache(cfg, 1, max_len, dtype=params["embed"].dtype, device=device)
    synchronize(device)
    t0 = time.perf_counter()
    logits = module.apply(params, prompt, cfg, cache=cache, past_len=0)[:, -1]
    synchronize(device)
    prefill = time.perf_counter() - t0
    past, steps = prompt.shape[1], []
    for _ in range(new_tokens):
        token = logits.argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        logits = module.apply(params, token, cfg, cache=cache, past_len=past)[:, -1]
        synchronize(device)
        steps.append(time.perf_counter() - t0)
        past += 1
    return {"prefill": prefill, "decode": sum(steps) / len(steps), "cache_bytes": cache_bytes(cache),
            "capacity": max_len, "element_size": cache[0]["k"].element_size()}


def run_benchmark(ctx: Context, student: dict, scfg: dba.DBAConfig, stages: dict) -> dict:
    bc, t, folder = ctx.cfg.benchmark, ctx.teacher, ctx.folder / "benchmark"
    # held-out losses on ctx.heldout were computed once, by the phases (the student is the last of them)
    losses = {"teacher": stages["teacher"], "student": list(stages.values())[-1]}
    prompt = torch.as_tensor(ctx.heldout.tokens[:bc.prompt_tokens].astype("int64"), device=ctx.device)[None]
    teacher = cast(t.params, student["embed"].dtype)    # timed in the student's dtype, whatever it is held in
    models = {"teacher": (llama, teacher, t.config), "student": (dba, student, scfg)}
    runs = {name: [] for name in models}
    ctx.say(f"benchmark: latency, {bc.prompt_tokens}-token prompt + {bc.new_tokens} decoded tokens, "
            f"median of {bc.repeats}")
    for name, (module, params, cfg) in models.items():
        latency(module, params, cfg, prompt, min(bc.new_tokens, 4))                     # warm-up, untimed
    for _ in range(bc.repeats):
        for name, (module, params, cfg) in models.items():
            runs[name].append(latency(module, params, cfg, prompt, bc.new_tokens))
    row = {}
    for name, (module, params, cfg) in models.items():
        r = runs[name][-1]
        row[name] = {
            "loss": losses[name], "perplexity": ppl(losses[name]),
            "prefill_ms": 1e3 * statistics.median(x["prefill"] for x in runs[name]),
            "decode_ms_per_token": 1e3 * statistics.median(x["decode"] for x in runs[name]),
            "kv_bytes_per_token_analytic": module.kv_bytes_per_token(cfg, dtype_bytes=r["element_size"]),
            "kv_bytes_per_token_measured": r["cache_bytes"] / r["capacity"],
            "kv_bytes_per_token_bf16": module.kv_bytes_per_token(cfg),
            "params": size(params), "attention_params": size(params["layers"]["attn"]),
        }
    ratio = {k: row["student"][k] / row["teacher"][k] for k in row["teacher"] if row["teacher"][k]}
    results = {"teacher": row["teacher"], "student": row["student"], "student_over_teacher": ratio,
               "stages": stages, "prompt_tokens": bc.prompt_tokens, "new_tokens": bc.new_tokens,
               "repeats": bc.repeats, "device": str(ctx.device), "threads": torch.get_num_threads(),
               "cache_dtype": str(student["embed"].dtype).replace("torch.", "")}
    _write(folder, results)
    s, q = row["student"], ratio
    ctx.say(f"benchmark: perplexity teacher {row['teacher']['perplexity']:.3f}, student {s['perplexity']:.3f} "
            f"({q['perplexity']:.3f}x); decode {s['decode_ms_per_token']:.2f} ms/token "
            f"({q['decode_ms_per_token']:.2f}x the teacher's); KV {s['kv_bytes_per_token_measured']:.0f} B/token measured = "
            f"{s['kv_bytes_per_token_analytic']} analytic ({1 / q['kv_bytes_per_token_measured']:.2f}x smaller); "
            f"{folder / 'results.md'}")
    return results


METRICS = [("perplexity", "held-out perplexity", "{:.3f}"), ("loss", "held-out loss (nats/token)", "{:.4f}"),
           ("prefill_ms", "prefill, ms", "{:.2f}"), ("decode_ms_per_token", "decode, ms/token", "{:.2f}"),
           ("kv_bytes_per_token_analytic", "KV cache, bytes/token (analytic)", "{:,.0f}"),
           ("kv_bytes_per_token_measured", "KV cache, bytes/token (measured)", "{:,.0f}"),
           ("kv_bytes_per_token_bf16", "KV cache, bytes/token at bf16", "{:,.0f}"),
           ("params", "parameters", "{:,}"), ("attention_params", "attention parameters", "{:,}")]


def markdown(results: dict) -> str:
    t, s, r = results["teacher"], results["student"], results["student_over_teacher"]
    lines = ["| metric | teacher | student | student / teacher |", "|---|---|---|---|"]
    for key, label, fmt in METRICS:
        lines.append(f"| {label} | {fmt.format(t[key])} | {fmt.format(s[key])} | {r.get(key, float('nan')):.3f} |")
    lines += ["", f"Prompt {results['prompt_tokens']} tokens, {results['new_tokens']} decoded, median of "
              f"{results['repeats']} runs, {results['device']}, {results['threads']} thread(s), cache dtype "
              f"{results['cache_dtype']}.", "", "| after phase | held-out loss | perplexity | ratio to teacher |",
              "|---|---|---|---|"]
    teacher = results["stages"].get("teacher")
    for stage, loss in results["stages"].items():
        ratio = f"{ppl_ratio(loss, teacher):.3f}" if teacher is not None else ""
        lines.append(f"| {stage} | {loss:.4f} | {ppl(loss):.3f} | {ratio} |")
    return "\n".join(lines) + "\n"


def ppl_ratio(loss: float, teacher: float) -> float:
    return ppl(loss) / ppl(teacher)


def _write(folder, results: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "results.json", results)
    with open(folder / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["metric", "teacher", "student", "student_over_teacher"])
        for key, _, _ in METRICS:
            w.writerow([key, results["teacher"][key], results["student"][key],
                        results["student_over_teacher"].get(key, "")])
        for stage, loss in results["stages"].items():
            w.writerow([f"heldout_loss_after_{stage}", loss, "", ""])
    (folder / "results.md").write_text(markdown(results))
    with Logger(folder, jsonl=False, console=False) as logger:
        for who in ("teacher", "student"):
            logger.scalars(0, {f"benchmark/{who}/{k}": results[who][k] for k, _, _ in METRICS})
        logger.scalars(0, {f"benchmark/ratio/{k}": v for k, v in results["student_over_teacher"].items()})
        for i, (stage, loss) in enumerate(results["stages"].items()):
            logger.scalars(i, {"benchmark/stage_perplexity": ppl(loss)})
        logger.text(0, "benchmark", markdown(results))
    if importlib.util.find_spec("matplotlib") is not None:
        _chart(folder / "results.png", results)


def _chart(path, results: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    stages = results["stages"]
    axes[0].bar(list(stages), [ppl(v) for v in stages.values()], color="tab:blue")
    axes[0].set_title("held-out perplexity after each phase")
    t, s = results["teacher"], results["student"]
    axes[1].bar(["teacher", "student"], [t["decode_ms_per_token"], s["decode_ms_per_token"]], color="tab:orange")
    axes[1].set_title("decode, ms/token (median)")
    axes[2].bar(["teacher", "student"], [t["kv_bytes_per_token_measured"], s["kv_bytes_per_token_measured"]],
                color="tab:green")
    axes[2].set_title("KV cache, bytes/token (measured)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
