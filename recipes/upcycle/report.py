"""The benchmark's artifacts, from one results dict (``recipes/upcycle/benchmark.py``):

- ``results.json``: everything, every timed run included;
- ``results.csv``: one row per model and sweep cell, the columns of ``sweep.COLUMNS`` with their units in the
  header (``prefill_ms``, ``kv_bytes_measured`` ...: ``name [unit]``);
- ``results.md``: the summary, the sweep, the crossover, perplexity vs context, passkey, behaviour, gates and the
  held-out perplexity after each phase, with the timing conditions (device, threads, dtype, repeats);
- ``tables.tex``: the sweep and the quality tables as LaTeX ``tabular``s;
- ``latency.png`` (decode ms/token and prefill vs context), ``kv_bytes.png`` (KV cache bytes vs context),
  ``quality.png`` (strided perplexity and passkey accuracy vs context): teacher and student on one plot,
  one line per batch size; written when matplotlib is importable;
- TensorBoard scalars (context as the step) and the Markdown as text.

The multiple-choice tasks' table (teacher, student, paired difference) is in ``results.md``; their numbers in
``results.json``, every question's choices and log-likelihoods per model in ``tasks.json``; TensorBoard scalars
``benchmark/tasks/<model>/<task>`` and ``benchmark/tasks/diff/<task>``.

``results.md`` lists the items skipped on this tokenizer and those that failed (``recipes/upcycle/benchmark.py``).
"""
from __future__ import annotations

import importlib.util
import traceback

from purestep.core.io.cache import write_csv, write_json, write_text
from purestep.core.io.logging import Logger, progress
from purestep.recipes.eval.report import plus_minus
from purestep.recipes.upcycle.phases import ppl
from purestep.recipes.upcycle.sweep import COLUMNS

SUMMARY = [("perplexity", "held-out perplexity", "{:.3f}"), ("loss", "held-out loss (nats/token)", "{:.4f}"),
           ("prefill_ms", "prefill, ms (first cell)", "{:.2f}"),
           ("decode_ms_per_token", "decode, ms/token (first cell)", "{:.2f}"),
           ("kv_bytes_per_token_analytic", "KV cache, bytes/token (analytic, cache dtype)", "{:,.0f}"),
           ("kv_bytes_per_token_measured", "KV cache, bytes/token (measured)", "{:,.0f}"),
           ("kv_bytes_per_token_bf16", "KV cache, bytes/token at bf16", "{:,.0f}"),
           ("params", "parameters", "{:,}"), ("attention_params", "attention parameters", "{:,}")]


def header() -> list[str]:
    return [f"{name} [{unit}]" if unit else name for name, unit in COLUMNS]


def fmt(value, spec: str = "{:.2f}") -> str:
    if value is None:
        return "-"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}" if value >= 10000 else str(value)
    return spec.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def crossover_line(results: dict) -> str:
    parts = []
    for c in results["crossover"]:
        worst = ", ".join(f"{t}: {r:.2f}x" for t, r in c["ratios"].items())
        parts.append(f"batch {c['batch']}: student decode faster from context {c['faster_from_context']}"
                     if c["faster_from_context"] else f"batch {c['batch']}: student decode not faster ({worst})")
    return "; ".join(parts) or "no cell measured for both models"


def _table(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def markdown(results: dict) -> str:
    t, s, r = results["teacher"], results["student"], results["student_over_teacher"]
    out = _table(["metric", "teacher", "student", "student / teacher"],
                 [[label, fmt(t[k], f), fmt(s[k], f), fmt(r.get(k), "{:.3f}")] for k, label, f in SUMMARY])
    out += ["", f"Sweep: {results['device']}, {results['threads']} thread(s), load average "
            f"{results.get('load_average', float('nan')):.1f} at the end, torch {results['torch']}, "
            f"{results['note']}; every time is the median of {results['repeats']} runs after "
            f"{results['warmup_runs']} untimed warm-up; prefill in chunks of {results['prefill_chunk']} tokens; "
            f"peak memory: {results['peak_memory']}.", ""]
    out += _table(header(), [[fmt(c.get(k), "{:,.2f}") for k, _ in COLUMNS]
                             for c in results["cells"]])
    out += ["", "Student decode vs teacher: " + crossover_line(results) + ".", ""]
    out += _table(["model", "window [tokens]", "stride [tokens]", "scored tokens", "loss [nats/token]",
                   "perplexity"], [[q["model"], str(q["context"]), str(q["stride"]), str(q["tokens"]),
                                    f"{q['loss']:.4f}", f"{q['perplexity']:.3f}"] for q in results["strided_perplexity"]])
    if results["passkey"]:
        p0 = results["passkey"][0]
        out += ["", f"Passkey retrieval: {p0['trials']} trials per context, seed {p0['seed']}, greedy; the student "
                f"was trained on {results['trained_context']}-token windows.", ""]
        out += _table(["model", "context [tokens]", "prompt [tokens]", "correct", "accuracy",
                       "within student training"],
                      [[p["model"], str(p["context"]), str(p["prompt_tokens"]), f"{p['correct']}/{p['trials']}",
                        fmt(p["accuracy"], "{:.2f}"), str(p["within_student_training"])] for p in results["passkey"]])
    if results["behaviour"]:
        out += [""] + _table(["model", "case type", "cases", "correct", "accuracy"],
                             [[b["model"], b["type"], str(b["cases"]), str(b["correct"]), f"{b['accuracy']:.2f}"]
                              for b in results["behaviour"]])
    if results.get("tasks"):
        out += [""] + tasks_table(results["tasks"])
    if results.get("gates"):
        out += [""] + _table(["gate", "limit", "value", "passed"],
                             [[f"verify.{g['gate']}", f"{g['limit']:g}", fmt(g["value"], "{:.4g}"), str(g["passed"])]
                              for g in results["gates"]])
    if results.get("skipped"):
        out += ["", "Skipped on this tokenizer:", ""] + [f"- {k['item']}: {k['reason']}" for k in results["skipped"]]
    if results.get("failed"):
        out += ["", "Failed (tracebacks in results.json):", ""] + [f"- {f['item']}: {f['error']}"
                                                                   for f in results["failed"]]
    stages = results.get("stages") or {}
    if stages:
        out += [""] + _table(["after phase", "held-out loss", "perplexity", "ratio to teacher"],
                             [[k, f"{v:.4f}", f"{ppl(v):.3f}", f"{ppl(v) / ppl(stages['teacher']):.3f}"]
                              for k, v in stages.items()])
    return "\n".join(out) + "\n"


def tasks_table(tasks: dict) -> list[str]:
    """The multiple-choice table: per task and the average, teacher and student ± stderr and the paired
    difference student - teacher ± stderr [95% CI] (``recipes/upcycle/six_tasks.py``)."""
    s = tasks["settings"]
    rows = [(name, r["metric"], r, str(r["n"])) for name, r in tasks["tasks"].items()]
    a = tasks["average"]
    rows.append((f"average of {a['tasks']}", "headline", a, ""))
    body = []
    for name, metric, r, n in rows:
        d = r["diff"]
        ci = "" if d["ci95"] is None else f" [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]"
        body.append([name, metric, plus_minus(r["teacher"], r["teacher_stderr"]), plus_minus(r["student"], r["student_stderr"]),
                     plus_minus(d["diff"], d["stderr"]) + ci, n])
    return [f"Multiple-choice tasks (recipe=eval's scoring, docs/eval.md): {s['num_fewshot']}-shot, limit "
            f"{s['limit'] or 'none'} ({s['limit_rule']}); the difference is student - teacher, paired on the same "
            f"questions, with its 95% interval; the average's standard errors take the tasks as independent.", ""] \
        + _table(["task", "metric", "teacher ± se", "student ± se", "student - teacher ± se [95% CI]", "n"], body)


def latex(results: dict) -> str:
    def tex(text: str) -> str:
        return str(text).replace("_", r"\_").replace("%", r"\%")

    cols = ["model", "context", "new", "batch", "status", "prefill [ms]", "decode [ms/token]", "tokens/s",
            "KV [bytes]", "KV measured [bytes]"]
    keys = ["model", "prompt_tokens", "new_tokens", "batch", "status", "prefill_ms", "decode_ms_per_token",
            "tokens_per_s", "kv_bytes_analytic", "kv_bytes_measured"]
    lines = [r"% purestep upcycle benchmark: " + tex(results["note"]),
             r"\begin{tabular}{llrrlrrrrr}", r"\hline", " & ".join(cols) + r" \\", r"\hline"]
    lines += [" & ".join(tex(fmt(c.get(k), "{:.2f}" if "ms" in k or "per_s" in k else "{}")) for k in keys) + r" \\"
              for c in results["cells"]]
    lines += [r"\hline", r"\end{tabular}", "", r"\begin{tabular}{llrrr}", r"\hline",
              r"measure & model & context & value & trials \\", r"\hline"]
    lines += [f"strided perplexity & {q['model']} & {q['context']} & {q['perplexity']:.3f} & - \\\\"
              for q in results["strided_perplexity"]]
    lines += [f"passkey accuracy & {p['model']} & {p['context']} & {fmt(p['accuracy'])} & {p['trials']} \\\\"
              for p in results["passkey"]]
    lines += [f"behaviour ({tex(b['type'])}) & {b['model']} & - & {b['accuracy']:.2f} & {b['cases']} \\\\"
              for b in results["behaviour"]]
    return "\n".join(lines + [r"\hline", r"\end{tabular}", ""])


def write(folder, results: dict, say=progress) -> None:
    """Every artifact above; a chart that fails to draw is reported (``say``, ``results["failed"]``), not raised:
    the measurements are written all the same."""
    folder.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("matplotlib") is not None:
        from purestep.recipes.upcycle import charts
        failed = [f for f in results.get("failed") or [] if f["item"] != "charts"]
        try:
            charts.draw(folder, results)
        except Exception as e:  # noqa: BLE001 - a picture never ends a run that trained; the exit code says so
            error = f"{type(e).__name__}: {e}".splitlines()[0]
            say(f"benchmark: charts failed ({error}); the measurements are written")
            failed.append({"item": "charts", "error": error, "traceback": traceback.format_exc()})
        results["failed"] = failed
    tasks = results.get("tasks")
    if tasks and "examples" in tasks:     # every question's choices apart: tasks.json, not results.json (a
        write_json(folder / "tasks.json", tasks["examples"])    # results dict read back from it has none)
    write_json(folder / "results.json", {**results, "tasks": tasks and {k: v for k, v in tasks.items()
                                                                         if k != "examples"}})
    write_csv(folder / "results.csv", [header(), *(["" if c.get(k) is None else c[k] for k, _ in COLUMNS]
                                                   for c in results["cells"])])
    write_text(folder / "results.md", markdown(results))
    write_text(folder / "tables.tex", latex(results))
    _board(folder, results)


def tasks_scalars(tasks: dict) -> dict[str, float]:
    """``benchmark/tasks/<model>/<task>`` (headline metric; ``average`` too) and ``benchmark/tasks/diff/<task>``."""
    rows = {**tasks["tasks"], "average": tasks["average"]}
    out = {f"benchmark/tasks/{who}/{name}": r[who] for name, r in rows.items() for who in ("teacher", "student")}
    return {**out, **{f"benchmark/tasks/diff/{name}": r["diff"]["diff"] for name, r in rows.items()}}


def _board(folder, results: dict) -> None:
    with Logger(folder, jsonl=False, console=False) as logger:
        for who in ("teacher", "student"):
            logger.scalars(0, {f"benchmark/{who}/{k}": results[who][k] for k, _, _ in SUMMARY
                               if results[who][k] is not None})
        logger.scalars(0, {f"benchmark/ratio/{k}": v for k, v in results["student_over_teacher"].items()})
        for c in results["cells"]:
            if c["status"] == "ok":
                tag = f"{c['model']}/batch{c['batch']}_new{c['new_tokens']}"
                logger.scalars(c["prompt_tokens"], {f"benchmark/decode_ms/{tag}": c["decode_ms_per_token"],
                                                    f"benchmark/prefill_ms/{tag}": c["prefill_ms"],
                                                    f"benchmark/kv_bytes/{tag}": c["kv_bytes_measured"]})
        for q in results["strided_perplexity"]:
            logger.scalars(q["context"], {f"benchmark/strided_perplexity/{q['model']}": q["perplexity"]})
        for p in results["passkey"]:
            if p["accuracy"] is not None:
                logger.scalars(p["context"], {f"benchmark/passkey_accuracy/{p['model']}": p["accuracy"]})
        if results.get("tasks"):
            logger.scalars(0, tasks_scalars(results["tasks"]))
        for i, (stage, loss) in enumerate((results.get("stages") or {}).items()):
            logger.scalars(i, {"benchmark/stage_perplexity": ppl(loss)})
        logger.text(0, "benchmark", markdown(results))
