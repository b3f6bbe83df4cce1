"""The pictures a user reads (issue 31), checked on their matplotlib figures: ``grid.png`` with one evaluation per
cell (a column per value with its seeds and their spread, not four dots on a step axis whose legend lines never
draw), upcycle's ``quality.png`` (passkey accuracy on a fixed [0, 1] axis, the teacher visible under the student)
and ``kv_bytes.png`` (four series listed, four visible where two hold equal bytes)."""
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("matplotlib", reason="the PNG charts need the [plot] extra (matplotlib)")

from purestep.core.cli import grid_summary  # noqa: E402
from purestep.recipes.upcycle import charts  # noqa: E402

NONE = ("None", "none", "", " ", None)


def _points(line) -> int:
    return len(line.get_xdata())


def _draws(line) -> bool:
    """A line draws something: a marker at a point, or a line style through two points."""
    return (line.get_marker() not in NONE and _points(line) >= 1) or \
        (line.get_linestyle() not in NONE and _points(line) >= 2)


def _covers(top, below) -> bool:
    """``top`` hides ``below`` entirely: the same points, drawn later, at least as wide and as large."""
    same = list(top.get_xdata()) == list(below.get_xdata()) and list(top.get_ydata()) == list(below.get_ydata())
    return same and top.get_linewidth() >= below.get_linewidth() and top.get_markersize() >= below.get_markersize()


def legend_problems(ax) -> list[str]:
    """The legend entries of ``ax`` that a reader cannot find in the plot, each with why."""
    legend, problems = ax.get_legend(), []
    assert legend is not None, "no legend"
    handles = getattr(legend, "legend_handles", None) or legend.legendHandles
    order = sorted(ax.lines, key=lambda line: (line.get_zorder(), ax.lines.index(line)))
    for handle, text in zip(handles, legend.get_texts()):
        label = text.get_text()
        container = [c for c in ax.containers if c.get_label() == label]
        if container:
            if not any(_draws(line) for line in container[0].lines[0:1]):
                problems.append(f"{label}: its error bars draw nothing")
            continue
        lines = [line for line in ax.lines if line.get_label() == label and _points(line)] or \
            [line for line in ax.lines if _points(line) and line.get_marker() == handle.get_marker()]
        if not lines or not any(_draws(line) for line in lines):
            problems.append(f"{label}: nothing drawn")
        elif handle.get_linestyle() not in NONE and not any(_points(line) >= 2 for line in lines):
            problems.append(f"{label}: the legend shows a line that never draws")
        elif all(any(_covers(top, line) for top in order[order.index(line) + 1:]) for line in lines):
            problems.append(f"{label}: hidden under another series")
    return problems


def _cells(evaluations: int):
    """Two lrs x two seeds, ``evaluations`` validation losses each (the last at step 10)."""
    cells, rows = [], []
    for lr, base in (("0.001", 3.96), ("0.003", 3.76)):
        for seed, shift in (("1", 0.0), ("2", 0.01)):
            steps = [10 * (i + 1) // evaluations for i in range(evaluations)]
            curve = [(s, base + shift + 0.1 * (steps[-1] - s)) for s in steps]
            cells.append(SimpleNamespace(name=f"seed={seed},lr={lr}", shown={"seed": seed, "lr": lr},
                                         folder=Path("unused")))
            rows.append({"val_curve": curve, "final_val_loss": curve[-1][1]})
    return cells, rows


def test_grid_with_one_evaluation_per_cell_shows_each_value_with_its_seeds_and_spread():
    cells, rows = _cells(1)
    fig = grid_summary.figure(cells, rows, ["seed", "lr"])
    (ax,) = fig.axes                                  # no step axis for single dots
    assert legend_problems(ax) == []
    assert [t.get_text() for t in ax.get_xticklabels()] == ["lr=0.001", "lr=0.003"]
    points = [line for line in ax.lines if line.get_marker() in grid_summary.MARKERS and _points(line)]
    assert len(points) == 4 and len({line.get_marker() for line in points}) == 2      # a marker per seed
    assert len({line.get_xdata()[0] for line in points}) == 4                          # side by side, not stacked
    (spread,) = ax.containers                          # mean +- std per lr
    assert [round(y, 3) for y in spread.lines[0].get_ydata()] == [3.965, 3.765]
    low, high = ax.get_ylim()
    assert low < 3.76 and high > 3.97


def test_grid_with_curves_adds_the_step_axis_and_every_cell_draws_a_line():
    cells, rows = _cells(3)
    fig = grid_summary.figure(cells, rows, ["seed", "lr"])
    finals, curves = fig.axes
    assert legend_problems(finals) == [] and legend_problems(curves) == []
    assert curves.get_xlabel() == "step" and curves.get_xlim()[0] < 3 < 10 < curves.get_xlim()[1]
    styles = {(line.get_color(), line.get_linestyle(), line.get_marker()) for line in curves.lines}
    assert len(styles) == 4                            # lr by colour, seed by line style and marker


def _results(passkey_accuracy: float) -> dict:
    cells = []
    for model, per_token, ms in (("teacher", 1024, 1.0), ("student", 512, 0.9)):
        for batch in (1, 2):
            for context in (16, 64):
                cells.append({"model": model, "batch": batch, "new_tokens": 4, "prompt_tokens": context,
                              "status": "ok", "decode_ms_per_token": ms * batch, "prefill_ms": ms * context * (1 + batch / 10),
                              "kv_bytes_measured": per_token * batch * (context + 4)})
    return {"device": "cpu", "threads": 1, "timing_dtype": "float32", "repeats": 3, "cache_dtype": "fp32",
            "cells": cells, "trained_context": 32, "skipped": [],
            "strided_perplexity": [{"model": m, "context": c, "perplexity": p + c / 100}
                                   for m, p in (("teacher", 20.8), ("student", 20.6)) for c in (16, 32)],
            "passkey": [{"model": m, "context": c, "accuracy": passkey_accuracy}
                        for m in ("teacher", "student") for c in (192, 256, 384)]}


def test_passkey_accuracy_is_on_a_fixed_axis_with_the_teacher_visible_under_the_student():
    for accuracy in (0.0, 1.0):
        figures = charts.figures(_results(accuracy))
        strided, passkey = figures["quality"].axes
        assert passkey.get_ylim() == charts.ACCURACY_LIMITS and passkey.get_ylim()[0] < 0 and \
            passkey.get_ylim()[1] > 1                     # was -0.04..0.04 when every trial failed
        assert legend_problems(passkey) == [] and legend_problems(strided) == []


def test_kv_bytes_shows_every_series_where_equal_bytes_overlap():
    """The student at batch 2 holds the teacher's bytes at batch 1: both listed, both visible."""
    ax = charts.figures(_results(0.0))["kv_bytes"].axes[0]
    assert len(ax.get_legend().get_texts()) == 4 and legend_problems(ax) == []
    for fig in charts.figures(_results(0.0))["latency"].axes:
        assert legend_problems(fig) == []


def test_a_skipped_passkey_says_so_in_its_panel():
    results = {**_results(0.0), "passkey": [],
               "skipped": [{"item": "passkey", "reason": "the char tokenizer spells no key"}]}
    passkey = charts.figures(results)["quality"].axes[1]
    assert any("skipped: the char tokenizer spells no key" in t.get_text() for t in passkey.texts)
