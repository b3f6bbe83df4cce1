"""``recipe=bench.upcycle``: every arm starts from the one surgery, trains on its token budget, and a rerun of the
same command trains nothing again (on the session's tiny char teacher: seconds)."""
import json

import pytest

from purestep.models import mla
from purestep.models.loading import module_of
from purestep.recipes import main
from purestep.recipes.bench import upcycle as bench
from purestep.recipes.upcycle.phases import FINAL, load_student

pytestmark = pytest.mark.usefixtures("token_cache")   # tests/conftest.py


def args(tiny_teacher, out, *extra):
    teacher, data = tiny_teacher
    return ["recipe=bench.upcycle", f"teacher={teacher}", f"data={data}", f"out={out}", "block_size=16",
            "eval_windows=2", "calib_tokens=64", "budgets=640,1280", "blockwise.batch_size=4",
            "fine_tune.batch_size=4", "passkey_trials=0", *extra]


def test_every_arm_starts_from_one_surgery_and_trains_its_budget(tiny_teacher, tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(args(tiny_teacher, out)) == 0
    results = json.loads((out / "results.json").read_text())
    rows = {(r["arm"], r["budget"]): r for r in results["rows"]}
    assert set(rows) == {("surgery", 0)} | {(a, b) for a in bench.ARMS for b in (640, 1280)}
    surgery = (out / "surgery" / "surgery" / FINAL).stat()
    for (arm, budget), row in rows.items():
        if arm == "surgery":
            continue
        assert (out / f"{arm}-{budget}" / "surgery" / FINAL).stat().st_ino == surgery.st_ino   # the one surgery
        assert sum(row["tokens"].values()) == pytest.approx(budget, abs=4 * 16)     # whole steps of 4 x 16
        assert ("blockwise" in row["tokens"]) == (arm == "ours")
        assert row["ratio"] == pytest.approx(row["perplexity"] / results["teacher"]["perplexity"])
        config = json.loads((out / f"{arm}-{budget}" / "global" / "heldout.json").read_text())
        assert config["loss"] == row["loss"]
    assert rows[("ours", 1280)]["tokens"] == {"blockwise": 1152, "global": 128}      # 0.9 of the budget blockwise
    table = capsys.readouterr().out
    assert "| 1,280 | global, CE only (end-to-end, MHA2MLA's) | 0 + 1,280 |" in table
    assert (out / "results.md").read_text() in table
    assert "Multiple-choice tasks skipped: " in table          # a char teacher cannot write them, or no eval data

    assert main(args(tiny_teacher, out)) == 0                 # the same command again: nothing trains
    again = capsys.readouterr().err
    assert "blockwise: done" in again and "global: done" in again and "step 1/" not in again
    rerun = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["loss"], r["tokens"]) for r in rerun] == \
        [(r["loss"], r["tokens"]) for r in results["rows"]]


def test_bad_arms_are_one_line_and_exit_2(capsys):
    assert main(["recipe=bench.upcycle", "teacher=x", "arms=ours,sgd"]) == 2
    assert capsys.readouterr().err == ("error: bad value for 'arms': ours,sgd; a list without repeats of ours, e2e, "
                                       "kd\n")


def test_an_arm_stopped_cleanly_stops_the_bench_with_exit_0_for_the_same_command(tiny_teacher, tmp_path, capsys,
                                                                                 monkeypatch):
    real = bench.upcycle.run
    monkeypatch.setattr(bench.upcycle, "run", lambda cfg: real(cfg) if not cfg.phases else None)   # preempted
    assert main(args(tiny_teacher, tmp_path / "bench")) == 0
    assert "the ours run in" in capsys.readouterr().err and not (tmp_path / "bench" / "results.json").exists()


def test_the_student_form_and_kv_budget_reach_the_surgery_and_every_arm(tiny_teacher, tmp_path):
    """student=mla kv_budget=B: the bench's one surgery, and so each arm, is an MLA student of B bytes a token."""
    out = tmp_path / "bench"
    assert main(args(tiny_teacher, out, "student=mla", "kv_budget=48", "arms=e2e", "budgets=640")) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["kv_bytes_per_token"]["student"] == 48
    for folder in ("surgery/surgery", "e2e-640/global"):
        params, scfg = load_student(out / folder / FINAL, "cpu")
        assert module_of(scfg) is mla


def test_the_plot_shows_the_task_average_per_arm_against_tokens_beside_the_perplexity_ratio():
    pytest.importorskip("matplotlib")
    rows = [{"arm": "surgery", "budget": 0, "tokens": {}, "ratio": 9.0},
            *[{"arm": arm, "budget": b, "tokens": {"global": b}, "ratio": 2.0 / b} for arm in ("e2e", "kd")
              for b in (1, 2)]]

    def average(value):
        return {"average": {"student": value, "teacher": 0.5, "tasks": 6, "diff": {"stderr": 0.01}}}
    tasks = {"teacher": average(0.5), "surgery": average(0.3),
             **{f"{r['arm']}-{r['budget']}": average(0.4 + r["budget"] / 100) for r in rows[1:]}}
    results = {"rows": rows, "tasks": tasks, "kv_bytes_per_token": {"ratio": 2.0}, "config": {"teacher": "t"}}
    ratio, accuracy = bench.plot(results).axes
    assert accuracy.get_ylabel() == "average of 6 tasks (%)"
    arms = {c.get_label(): c.lines[0].get_ydata() for c in accuracy.containers}
    assert list(arms[bench.ARM_LABELS["kd"]]) == pytest.approx([41.0, 42.0])
    lines = {line.get_label(): line.get_ydata() for line in accuracy.get_lines()}
    assert list(lines["surgery only"]) == pytest.approx([30.0, 30.0]) and list(lines["teacher"]) == [50.0, 50.0]
    assert len(bench.plot({**results, "tasks": {"skipped": "no data"}}).axes) == 1
