"""What ``recipe=eval`` writes: ``results.json``, ``results.md`` and TensorBoard scalars, and the paired comparison
with another run's ``results.json`` (``compare=``).

The comparison pairs the two runs' scores question by question (the ids are the rows of the split, so both runs must
have scored the same questions: the same ``limit`` and ``num_fewshot``); per task the headline metric's paired
difference (this run minus the other) with its standard error and 95% interval, and the same for the average of the
tasks both runs scored (``recipes.eval.stats``).
"""
from __future__ import annotations

import json
from pathlib import Path

from purestep.core.config import UserError
from purestep.core.io.cache import write_json
from purestep.core.io.logging import Logger
from purestep.recipes.eval import stats

METRICS = ("acc", "acc_norm", "acc_bytes")


def per_question(task: dict, metric: str) -> dict[int, float]:
    """``{id: 0/1}`` of one task's questions under ``metric``."""
    key = "pred" if metric == "acc" else f"pred_{metric[4:]}"
    return {e["id"]: float(e[key] == e["gold"]) for e in task["examples"]}


def load_results(path: str) -> tuple[Path, dict]:
    """A ``results.json`` named directly or by the run folder holding it."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "results.json"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise UserError(f"compare={path}: no such results.json (a recipe=eval run folder or its results.json)") \
            from None
    except (OSError, ValueError) as e:
        raise UserError(f"compare={path}: not a readable results.json ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("tasks"), dict):
        raise UserError(f"compare={path}: not a recipe=eval results.json (no 'tasks')")
    return p, data


def compare(mine: dict, path: str) -> dict:
    """This run's results against the run at ``path``, paired on the questions both scored."""
    where, other = load_results(path)
    k_mine, k_other = mine["settings"]["num_fewshot"], other.get("settings", {}).get("num_fewshot")
    if k_mine != k_other:
        raise UserError(f"compare={path}: that run used num_fewshot={k_other}, this one {k_mine}; pair runs that "
                        f"saw the same prompts")
    tasks = {}
    for name, task in mine["tasks"].items():
        theirs = other["tasks"].get(name)
        if theirs is None:
            continue
        metric = task["headline"]
        a, b = per_question(task, metric), per_question(theirs, metric)
        common = sorted(set(a) & set(b))
        if not common:
            raise UserError(f"compare={path}: task {name} shares no question with this run")
        tasks[name] = {"metric": metric, **stats.paired([a[i] for i in common], [b[i] for i in common])}
    if not tasks:
        raise UserError(f"compare={path}: that run scored none of this run's tasks ({', '.join(mine['tasks'])})")
    return {"against": str(where), "model": other.get("model"), "tasks": tasks,
            "average": stats.combined(list(tasks.values()))}


def plus_minus(value, se) -> str:
    """``0.3110 ± 0.0268``; the value alone where there is no standard error."""
    return f"{value:.4f}" + ("" if se is None else f" ± {se:.4f}")


def markdown(results: dict) -> str:
    """The results table (every metric of every task, the headline marked) and the comparison, if any."""
    model, s = results["model"], results["settings"]
    lines = [f"# recipe=eval: {model['source']}", "", f"{model['format']}; {s['num_fewshot']}-shot, {s['dtype']}, "
             f"limit {s['limit'] or 'none'} ({s['limit_rule']})", "",
             "| task | metric | value ± stderr | n |", "|---|---|---|---|"]
    for name, t in results["tasks"].items():
        for m in METRICS:
            if m in t:
                mark = " (headline)" if m == t["headline"] else ""
                lines.append(f"| {name} | {m}{mark} | {plus_minus(t[m], t[m + '_stderr'])} | {t['n']} |")
    avg = results["average"]
    lines.append(f"| average of {len(avg['tasks'])} | headline metrics | {plus_minus(avg['value'], avg['stderr'])} | |")
    lines += ["", "The average's standard error takes the tasks as independent: sqrt(sum of squared stderrs) / tasks."]
    c = results.get("comparison")
    if c:
        lines += ["", f"## paired against {c['against']}", "",
                  "| task | metric | this | other | difference ± stderr | 95% CI | n |",
                  "|---|---|---|---|---|---|---|"]
        rows = [(name, d["metric"], d) for name, d in c["tasks"].items()]
        rows.append((f"average of {c['average']['tasks']}", "headline", {**c["average"], "n": ""}))
        for name, metric, d in rows:
            ci = "" if d["ci95"] is None else f"[{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]"
            lines.append(f"| {name} | {metric} | {d['a']:.4f} | {d['b']:.4f} | {plus_minus(d['diff'], d['stderr'])} | {ci} "
                         f"| {d['n']} |")
    return "\n".join(lines) + "\n"


def scalars(results: dict) -> dict[str, float]:
    """``eval/<task>/<metric>`` (and ``_stderr``), ``eval/average``, ``eval/compare/<task>/diff``."""
    out = {}
    for name, t in results["tasks"].items():
        for m in METRICS:
            if m in t:
                out[f"eval/{name}/{m}"] = t[m]
                if t[m + "_stderr"] is not None:
                    out[f"eval/{name}/{m}_stderr"] = t[m + "_stderr"]
    out["eval/average"] = results["average"]["value"]
    c = results.get("comparison")
    if c:
        out.update({f"eval/compare/{name}/diff": d["diff"] for name, d in c["tasks"].items()})
        out["eval/compare/average/diff"] = c["average"]["diff"]
    return out


def write(folder: Path, results: dict) -> None:
    """``results.json``, ``results.md`` and the TensorBoard scalars (step 0) in ``folder``."""
    write_json(folder / "results.json", results)
    (folder / "results.md").write_text(markdown(results))
    with Logger(folder, jsonl=False, console=False) as logger:
        logger.scalars(0, scalars(results))
        logger.text(0, "eval", markdown(results))
