"""Upcycle's benchmark sweep, quality measurements, gates and dims defaults (issue 19), on tiny teachers:
the latency/KV sweep's artifacts and their schema, medians over timed runs, chunked prefill, strided perplexity,
passkey, behaviour cases, the gate exit code, one-line bad input, ``kv_reduction`` dims for head_dim 16/64/128,
and ``recipe=bench.kv`` on two checkpoints."""
import csv
import json
import statistics

import pytest
import torch

from purestep.core.config import EXIT_GATE
from purestep.core.data.text import prepare
from purestep.models import dba, llama, surgery
from purestep.models.loading import load_model
from purestep.recipes import main
from purestep.recipes.upcycle import passkey, quality, sweep
from purestep.recipes.upcycle.sweep import Model
from tests.test_upcycle import corpus, teacher  # noqa: F401  (module fixtures: the tiny corpus and teacher)

pytestmark = pytest.mark.usefixtures("token_cache")
SMALL = ["benchmark.prompt_tokens=16,48", "benchmark.new_tokens=3", "benchmark.batches=1,2", "benchmark.repeats=3",
         "benchmark.prefill_chunk=16", "benchmark.passkey_contexts=192,256,384", "benchmark.passkey_trials=2",
         "benchmark.ppl_contexts=16,32", "benchmark.ppl_tokens=256", "benchmark.task_limit=5"]


def upcycle(teacher, corpus, out, *extra):   # no dims: kv_reduction=2 derives them
    return main(["recipe=upcycle", "preset=ci", f"teacher={teacher}", f"data={corpus}", f"out={out}", *extra])


@pytest.fixture(scope="module")
def surgery_run(teacher, corpus, tmp_path_factory):  # noqa: F811
    """A surgery-only student benchmarked once (no dims given), for the artifact tests."""
    out = tmp_path_factory.mktemp("bench") / "up"
    assert upcycle(teacher, corpus, out, "phases=benchmark", *SMALL) == 0
    return out


@pytest.mark.parametrize("head_dim, dims", [(16, (0, 8, 8)), (64, (0, 32, 32)), (128, (0, 64, 64))])
def test_kv_reduction_derives_dims_with_all_keys_rotary(head_dim, dims):
    """docs/upcycle.md's comparison: more RoPE pairs win; half the budget values, half keys; 2x for every head_dim."""
    assert dba.dims_for_reduction(head_dim, 2) == dims
    assert 2 * head_dim == 2 * sum(dims)
    assert dba.dims_for_reduction(head_dim, 4) == tuple(d // 2 for d in dims)
    with pytest.raises(ValueError):
        dba.dims_for_reduction(16, 40)


def test_head_dim_128_random_llama_upcycles_without_dims_to_half_the_cache(corpus, tmp_path, capsys):  # noqa: F811
    """A random Llama with head_dim 128 (and the tiny teacher below, head_dim 16): no dims given, 2x smaller."""
    t = tmp_path / "t128"
    assert main(["recipe=standard", f"data={corpus}", f"out={t}", "model.d_model=64", "model.n_layers=1",
                 "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=128", "block_size=32", "batch_size=2",
                 "steps=1", "eval_every=0", "sample_tokens=0", "compile=false"]) == 0
    capsys.readouterr()
    assert upcycle(t, corpus, tmp_path / "up", "phases=verify") == 0
    err = capsys.readouterr().err
    assert "dims sem_dim=0 geo_dim=64 v_dim=64 (teacher head_dim 128" in err and "2.00x smaller" in err
    report = json.loads((tmp_path / "up" / "surgery" / "report.json").read_text())
    assert report["kv_bytes_per_token"]["ratio"] == 2.0


def test_explicit_dims_win_over_kv_reduction(teacher, corpus, tmp_path, capsys):  # noqa: F811
    assert upcycle(teacher, corpus, tmp_path / "up", "phases=verify", "kv_reduction=4", "v_dim=6") == 0
    assert "dims sem_dim=0 geo_dim=4 v_dim=6 (teacher head_dim 16, kv_reduction=4)" in capsys.readouterr().err


def test_artifacts_schema_medians_and_kv_bytes(surgery_run, capsys):
    """Acceptance 1 (CI size), 2, 4: every cell of prompt x batch for both models, measured KV bytes = analytic,
    each timing the median of `repeats` timed runs (the warm-up is not among them), units in the CSV header,
    passkey at 3 contexts with trials and seed, tables.tex and the PNG charts."""
    b = surgery_run / "benchmark"
    results = json.loads((b / "results.json").read_text())
    cells = results["cells"]
    assert {(c["model"], c["prompt_tokens"], c["batch"]) for c in cells} == \
        {(m, t, n) for m in ("teacher", "student") for t in (16, 48) for n in (1, 2)}
    for c in cells:
        assert c["status"] == "ok" and c["new_tokens"] == 3
        assert c["kv_bytes_measured"] == c["kv_bytes_analytic"] > 0
        assert len(c["decode_ms_runs"]) == len(c["prefill_ms_runs"]) == 3 == results["repeats"]
        assert c["decode_ms_per_token"] == statistics.median(c["decode_ms_runs"]) > 0
        assert c["prefill_ms"] == statistics.median(c["prefill_ms_runs"]) > 0
        assert c["tokens_per_s"] == pytest.approx(c["batch"] * 1e3 / c["decode_ms_per_token"])
    by = {(c["model"], c["prompt_tokens"], c["batch"]): c for c in cells}
    assert by[("student", 48, 2)]["kv_bytes_measured"] * 2 == by[("teacher", 48, 2)]["kv_bytes_measured"]
    assert results["warmup_runs"] == 1 and "fp32 on CPU" in results["note"]
    with open(b / "results.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["model", "prompt_tokens [tokens]", "new_tokens [tokens]", "batch [sequences]", "status",
                       "prefill_ms [ms]", "decode_ms_per_token [ms/token]", "tokens_per_s [tokens/s]",
                       "kv_bytes_analytic [bytes]", "kv_bytes_measured [bytes]", "kv_bytes_per_token [bytes/token]",
                       "peak_mb [MiB]"]
    assert len(rows) == 1 + len(cells)
    keys = results["passkey"]
    assert sorted({p["context"] for p in keys}) == [192, 256, 384] and {p["model"] for p in keys} == {"teacher",
                                                                                                     "student"}
    assert all(p["trials"] == 2 and p["seed"] == 1337 and 0 <= p["accuracy"] <= 1 for p in keys)
    assert {q["context"] for q in results["strided_perplexity"]} == {16, 32}
    if results["tasks"]:               # the six tasks (tests/test_upcycle_tasks.py checks their numbers)
        assert [t["n"] for t in results["tasks"]["tasks"].values()] == [5] * 6
        assert set(json.loads((b / "tasks.json").read_text())) == {"teacher", "student"}
        assert "| average of 6 | headline |" in (b / "results.md").read_text()
    else:                              # no eval extra here: skipped with one line
        assert any(k["item"] == "tasks" for k in results["skipped"])
    assert {r["type"] for r in results["behaviour"]} == {"choice_logprob", "exact_match_greedy", "all"}
    md = (b / "results.md").read_text()
    assert "Passkey retrieval: 2 trials per context, seed 1337" in md and "Student decode vs teacher" in md
    tex = (b / "tables.tex").read_text()
    assert tex.count(r"\begin{tabular}") == 2 and r"decode [ms/token]" in tex
    assert list(b.glob("events.out.tfevents.*"))
    pytest.importorskip("matplotlib", reason="the PNG charts need the 'plot' extra: pip install purestep[plot]")
    for name in ("latency", "kv_bytes", "quality"):
        assert (b / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_a_missed_gate_exits_3_after_writing_the_report(surgery_run, teacher, corpus, tmp_path, capsys):  # noqa: F811
    """Acceptance 3: verify.max_ppl_ratio below what the student reaches: exit 3 (not 2), one line, reports
    written; on_fail=warn finishes; a gate that passes is recorded as passed."""
    out = tmp_path / "up"
    args = ["phases=benchmark", *SMALL, "benchmark.batches=1", "benchmark.prompt_tokens=16",
            "benchmark.passkey_trials=0", "verify.max_ppl_ratio=0.5", "verify.min_kv_reduction=1.9"]
    assert upcycle(teacher, corpus, out, *args) == EXIT_GATE == 3
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("gate failed: verify.max_ppl_ratio=0.5 missed (") and "min_kv_reduction" not in last
    gates = json.loads((out / "gates.json").read_text())
    assert not gates["passed"] and [g["passed"] for g in gates["gates"]] == [False, True]
    results = json.loads((out / "benchmark" / "results.json").read_text())
    assert results["gates"] == gates["gates"] and "verify.max_ppl_ratio" in (out / "benchmark" / "results.md").read_text()
    assert upcycle(teacher, corpus, out, *args, "verify.on_fail=warn") == 0
    assert "warning: gate failed" in capsys.readouterr().err
    assert upcycle(teacher, corpus, out, *args[:-2], "verify.max_delta_nll=5", "verify.max_accuracy_drop=1") == 0


def test_bad_benchmark_keys_are_one_line_exit_2(teacher, corpus, tmp_path, capsys):  # noqa: F811
    """Acceptance 5: a context beyond the model's maximum (2048 when not recorded), an empty list, a bad
    behaviour file: one error line each, exit 2, no run folder."""
    out = tmp_path / "up"
    bad = tmp_path / "cases.jsonl"
    bad.write_text('{"type": "choice_logprob", "prompt": "x", "choices": ["a"], "answer": 0}\n')
    garbled = tmp_path / "garbled.jsonl"
    garbled.write_text('\n{"type": "exact_match_greedy", "prompt": "x", "target": "y"}\n{"type": \n')
    for extra, words in ((["benchmark.prompt_tokens=16,4096"], "maximum context 2048"),
                         (["benchmark.passkey_contexts=3000"], "passkey_contexts=3000"),
                         (["benchmark.prompt_tokens="], "'benchmark.prompt_tokens': an empty list"),
                         (["benchmark.batches=[]"], "'benchmark.batches': an empty list"),
                         ([f"benchmark.behaviour={bad}"], "cases.jsonl:1: a case needs"),
                         ([f"benchmark.behaviour={garbled}"], "garbled.jsonl:3: not valid JSON")):
        assert upcycle(teacher, corpus, out, *extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: ") and words in err[-1], err[-1]
    assert main(["recipe=bench.kv", f"teacher={corpus}"]) == 2
    assert "needs student=PATH" in capsys.readouterr().err
    assert not out.exists()


def test_bench_kv_compares_two_checkpoints_and_records_cells_that_do_not_fit(surgery_run, teacher, corpus,  # noqa: F811
                                                                               tmp_path):
    out = tmp_path / "kv"
    cases = tmp_path / "cases.jsonl"
    cases.write_text('{"type": "exact_match_greedy", "prompt": "the cat eats", "target": " an"}\n\n'
                     '{"type": "choice_logprob", "prompt": "the", "choices": [" cat", " zzz"], "answer": 0}\n')
    assert main(["recipe=bench.kv", f"teacher={teacher}", f"student={surgery_run / 'surgery'}", f"data={corpus}",
                 f"out={out}", "block_size=32", "eval_windows=4", "benchmark.prompt_tokens=16,1024",
                 "benchmark.new_tokens=2", "benchmark.batches=1", "benchmark.repeats=1", "benchmark.memory_limit_mb=1",
                 "benchmark.passkey_trials=0", "benchmark.ppl_tokens=64", f"benchmark.behaviour={cases}",
                 "benchmark.cache_dtype=bf16"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["timing_dtype"] == "float32" and "allocated at bf16" in results["note"]
    t = load_model(str(teacher)).config
    assert results["cells"][0]["kv_bytes_measured"] == llama.kv_bytes_per_token(t, 2) * 18
    status = {(c["model"], c["prompt_tokens"]): c["status"] for c in results["cells"]}
    assert status == {("teacher", 16): "ok", ("student", 16): "ok", ("teacher", 1024): "does_not_fit",
                      ("student", 1024): "does_not_fit"}
    assert results["student_over_teacher"]["kv_bytes_per_token_analytic"] == 0.5
    assert [r["cases"] for r in results["behaviour"] if r["type"] == "all"] == [2, 2]
    assert (out / "tables.tex").exists()
    pytest.importorskip("matplotlib", reason="the PNG charts need the 'plot' extra: pip install purestep[plot]")
    assert (out / "latency.png").exists()


def test_chunked_prefill_equals_the_whole_forward_and_strided_loss_covers_every_token(teacher, corpus):  # noqa: F811
    t = load_model(str(teacher))
    data = prepare(str(corpus), t.tokenizer)
    x = torch.as_tensor(data.val[:70].astype("int64"))[None]
    student, scfg, _ = surgery.surgery(t.params, t.config, x, sem_dim=0, geo_dim=8, v_dim=8)
    for m in (Model("teacher", llama, t.params, t.config), Model("student", dba, student, scfg)):
        whole = m.module.apply(m.params, x, m.cfg)[:, -1]
        for chunk in (7, 32, 70):
            cache = m.module.new_cache(m.cfg, 1, 70, device=x.device)
            assert torch.allclose(sweep.prefill(m, x, cache, chunk), whole, atol=1e-4)
        # stride = window: disjoint windows, the plain mean loss of those windows
        loss, count = quality.strided_loss(m, data.val, 32, 32, 64, x.device)
        y = torch.as_tensor(data.val[:65].astype("int64"))
        plain = torch.stack([m.module.loss(m.params, {"x": y[i:i + 32][None], "y": y[i + 1:i + 33][None]}, m.cfg)
                             for i in (0, 32)]).mean()
        assert count == 64 and loss == pytest.approx(plain.item(), rel=1e-5)
        assert quality.strided_loss(m, data.val, 32, 8, 64, x.device)[1] == 64


def test_passkey_prompts_fit_hold_the_key_and_repeat(teacher):  # noqa: F811
    tok = load_model(str(teacher)).tokenizer
    texts, why = passkey.Texts.build(tok)
    assert why == "" and texts.note == "" and texts.alphabet == "0123456789"     # bytes spell everything
    assert passkey.trials(4, 7) == passkey.trials(4, 7) != passkey.trials(4, 8)
    for key, depth in passkey.trials(4, 7):
        ids = texts.prompt(400, key, depth)
        assert len(ids) <= 400 and str(key) in tok.decode(ids) and tok.decode(ids).endswith(passkey.QUESTION)
        assert texts.correct(f" {key}. Remember", key) and not texts.correct(f" {key + 1}", key)
    assert texts.prompt(50, 12345, 0.5) is None


def test_an_out_of_memory_cell_is_recorded_and_the_sweep_goes_on(teacher, monkeypatch):  # noqa: F811
    from purestep.recipes.upcycle.config import BenchmarkConfig
    t = load_model(str(teacher))
    calls = []

    def run(m, prompt, new, chunk, cache=None):
        calls.append(prompt.shape)
        if prompt.shape[1] > 8:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return 0.01, 0.002

    monkeypatch.setattr(sweep, "timed_run", run)
    bc = BenchmarkConfig(prompt_tokens=(8, 16, 4), new_tokens=(2,), batches=(1,), repeats=1)
    rows = sweep.run_sweep([Model("teacher", llama, t.params, t.config)], list(range(50)), bc,
                           torch.device("cpu"), lambda line: None)
    assert [r["status"] for r in rows] == ["ok", "oom", "ok"] and "simulated" in rows[1]["error"]
    assert rows[1]["kv_bytes_analytic"] == llama.kv_bytes_per_token(t.config, 4) * 18


def test_crossover_is_the_context_from_which_the_student_stays_faster():
    def row(model, context, ms, batch=1):
        return {"model": model, "prompt_tokens": context, "new_tokens": 8, "batch": batch, "status": "ok",
                "decode_ms_per_token": ms}
    rows = [row("teacher", 256, 80), row("student", 256, 76), row("teacher", 2048, 100), row("student", 2048, 110),
            row("teacher", 256, 140, 4), row("student", 256, 150, 4), row("teacher", 1024, 180, 4),
            row("student", 1024, 150, 4), row("teacher", 2048, 260, 4), row("student", 2048, 190, 4),
            {**row("student", 4096, 1, 4), "status": "does_not_fit"}]
    one, four = sweep.crossover(rows)
    assert one["faster_from_context"] is None and one["ratios"] == {256: 0.95, 2048: 1.1}
    assert four["faster_from_context"] == 1024 and set(four["ratios"]) == {256, 1024, 2048}
