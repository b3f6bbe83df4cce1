"""The upcycle benchmark's multiple-choice item: teacher and student scored by ``recipe=eval`` on the same questions
(ARC-E/C, HellaSwag, PIQA, OpenBookQA, WinoGrande by default), and the paired comparison student - teacher.

Scoring is ``recipes.eval.run.evaluate`` (lm-evaluation-harness's log-likelihood scoring, docs/eval.md) on the
in-memory params, wrapped in a ``models.loading.LoadedModel``; the per-task and average paired differences are
``recipes.eval.stats.paired`` / ``combined`` over the questions both models answered (Miller 2024, "Adding Error
Bars to Evals"). :func:`unrunnable` says why the item cannot run here (the ``eval`` extra or its data missing, a
tokenizer that cannot write the tasks' text: a char tokenizer of tiny shakespeare has no digit), so the benchmark
skips it with one line instead of failing.
"""
from __future__ import annotations

from typing import Callable, Sequence

from purestep.core.config import UserError
from purestep.models.loading import LoadedModel, arch_of
from purestep.recipes.eval import stats
from purestep.recipes.eval.report import per_question
from purestep.recipes.eval.run import evaluate, task_texts
from purestep.recipes.eval.scoring import harness_encoder
from purestep.recipes.eval.tasks import data_root, resolve_tasks, split_files


def unrunnable(tokenizer, names: Sequence[str], limit: int, fewshot: int, seed: int, data: str = "") -> str:
    """Why the tasks cannot be scored with ``tokenizer`` (data or its reader missing, text it cannot encode), or
    "" when they can. Only the questions ``limit`` keeps are encoded; the first failure is the answer."""
    if tokenizer is None:
        return "no tokenizer to write the questions with"
    try:
        root, tasks = data_root(data), resolve_tasks(names)
        for task in tasks:
            split_files(task, root)
    except UserError as e:
        return str(e)
    encode = harness_encoder(tokenizer)
    for task in tasks:
        _, texts = task_texts(task, root, limit, fewshot, seed)
        try:
            for doc in texts:
                for context, continuation in doc:
                    encode(context + continuation)
        except UserError as e:                    # core.data.tokenizers.DataError: a char outside a char vocabulary
            return f"the {tokenizer.name} tokenizer cannot write {task.name}'s questions ({e})"
    return ""


def score(model, tokenizer, names: Sequence[str], limit: int, fewshot: int, seed: int, data: str = "",
          emit: Callable[[str], None] = print) -> dict:
    """``recipes.eval.run.evaluate`` of one in-memory model (a ``recipes.upcycle.sweep.Model``)."""
    loaded = LoadedModel(model.params, model.cfg, tokenizer, "in memory (upcycle benchmark)", model.name,
                         arch_of(model.cfg))
    return evaluate(loaded, names, limit, num_fewshot=fewshot, seed=seed, data=data, emit=emit)


def compare(teacher: dict, student: dict) -> dict:
    """Per task (headline metric) and for the average: both models' value and standard error, and the paired
    difference student - teacher (``diff``: ``stats.paired``'s dict, ``a`` the student, ``b`` the teacher); every
    question's choices under ``examples`` (kept out of results.json by the report)."""
    rows = {}
    for name, t in teacher["tasks"].items():
        s, metric = student["tasks"][name], t["headline"]
        a, b = per_question(s, metric), per_question(t, metric)
        ids = sorted(a)
        rows[name] = {"metric": metric, "n": t["n"], "teacher": t[metric], "teacher_stderr": t[metric + "_stderr"],
                      "student": s[metric], "student_stderr": s[metric + "_stderr"],
                      "diff": stats.paired([a[i] for i in ids], [b[i] for i in ids])}
    ta, sa = teacher["average"], student["average"]
    average = {"tasks": len(rows), "metrics": ta["metrics"], "teacher": ta["value"], "teacher_stderr": ta["stderr"],
               "student": sa["value"], "student_stderr": sa["stderr"],
               "diff": stats.combined([r["diff"] for r in rows.values()])}
    return {"tasks": rows, "average": average, "settings": teacher["settings"],
            "examples": {who: {n: r["examples"] for n, r in res["tasks"].items()}
                         for who, res in (("teacher", teacher), ("student", student))}}


def run_tasks(models: list, tokenizer, names: Sequence[str], limit: int, fewshot: int, seed: int, data: str = "",
              say: Callable[[str], None] = print) -> tuple[dict | None, str]:
    """``(compare(teacher, student), "")`` for ``models`` (teacher first, then student), or ``(None, why)`` when
    :func:`unrunnable` says they cannot be scored here."""
    why = unrunnable(tokenizer, names, limit, fewshot, seed, data)
    if why:
        return None, why
    say(f"benchmark: {len(names)} multiple-choice tasks ({', '.join(names)}), first {limit or 'all'} questions "
        f"each, {fewshot}-shot, teacher and student")
    teacher, student = (score(m, tokenizer, names, limit, fewshot, seed, data, say) for m in models)
    return compare(teacher, student), ""


def line(tasks: dict) -> str:
    """``6-task average teacher 0.4012, student 0.3850 (-0.0162 +- 0.0101)`` for the console summary."""
    a = tasks["average"]
    se = a["diff"]["stderr"]
    return (f"{a['tasks']}-task average teacher {a['teacher']:.4f}, student {a['student']:.4f} "
            f"({a['diff']['diff']:+.4f}" + ("" if se is None else f" +- {se:.4f}") + ")")
