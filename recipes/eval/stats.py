"""Standard errors of ``recipe=eval``'s accuracies and the paired comparison of two models on the same questions.

- A task's standard error is lm-evaluation-harness's for a mean (``lm_eval/api/metrics.py: mean_stderr``): the
  sample standard deviation of the per-question 0/1 scores over sqrt(n), which for an accuracy p is
  ``sqrt(p (1 - p) / (n - 1))``.
- Two models on the same questions: the per-question differences ``d_i = a_i - b_i``, their mean and its standard
  error ``sd(d) / sqrt(n)`` (the paired-difference analysis of Miller 2024, "Adding Error Bars to Evals",
  which is smaller than the unpaired one by the covariance of the two models' scores), the 95% interval
  ``mean +- 1.96 se`` (normal approximation).
- The average over tasks is the plain average of the per-task metrics; its standard error assumes the tasks are
  independent: ``sqrt(sum se_t^2) / T`` (the same for the paired difference of two averages).
"""
from __future__ import annotations

import math
from typing import Sequence

Z95 = 1.959963984540054       # the standard normal's 97.5% quantile


def mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs)


def stderr(xs: Sequence[float]) -> float | None:
    """The harness's ``mean_stderr``: sample standard deviation / sqrt(n); None below two values."""
    n = len(xs)
    if n < 2:
        return None
    mu = mean(xs)
    return math.sqrt(math.fsum((x - mu) ** 2 for x in xs) / (n - 1) / n)


def paired(a: Sequence[float], b: Sequence[float]) -> dict:
    """Mean of ``a - b`` over paired scores, its standard error and 95% interval."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired scores need two equal, non-empty lists (got {len(a)} and {len(b)})")
    d = [x - y for x, y in zip(a, b)]
    diff, se = mean(d), stderr(d)
    ci = None if se is None else [diff - Z95 * se, diff + Z95 * se]
    return {"n": len(d), "a": mean(a), "b": mean(b), "diff": diff, "stderr": se, "ci95": ci}


def average(values: Sequence[float], errors: Sequence[float | None]) -> tuple[float, float | None]:
    """The average of per-task values and its standard error, the tasks taken as independent."""
    avg = mean(values)
    if any(e is None for e in errors):
        return avg, None
    return avg, math.sqrt(math.fsum(e * e for e in errors)) / len(errors)


def combined(diffs: Sequence[dict]) -> dict:
    """The paired difference of two task averages from the per-task :func:`paired` results."""
    diff, se = average([d["diff"] for d in diffs], [d["stderr"] for d in diffs])
    ci = None if se is None else [diff - Z95 * se, diff + Z95 * se]
    return {"tasks": len(diffs), "a": mean([d["a"] for d in diffs]), "b": mean([d["b"] for d in diffs]),
            "diff": diff, "stderr": se, "ci95": ci}
