"""Knowledge distillation: the loss math on hand-made cases, the learnable temperature, the distill and
distill_cache recipes end to end (frozen teacher, students, caches, bad input), and the acceptance claim
that a distilled student beats the same student trained on CE alone."""
import json
import math
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from purestep.core.io import checkpoint as ckpt
from purestep.recipes import main
from purestep.core.tree import tree_leaves
from purestep.models import losses
from purestep.core.cli.command import merge_args  # noqa: E402 (bin/run refuses a repeated key)

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------- loss math

def direct_kl(p_logits, q_logits, T):
    """KL(p || q) per token, the textbook way: sum over the vocabulary of p * (log p - log q)."""
    p, q = torch.softmax(p_logits.double() / T, -1), torch.softmax(q_logits.double() / T, -1)
    return torch.sum(p * (p.log() - q.log()), -1)


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 7, generator=g) * 2, torch.randn(2, 3, 7, generator=g) * 2


@pytest.mark.parametrize("T", [1.0, 2.5])
def test_kl_directions_match_the_formula(logits, T):
    s, t = logits
    fkl, rkl = direct_kl(t, s, T).mean(), direct_kl(s, t, T).mean()
    torch.testing.assert_close(losses.kd_loss(s, t, temperature=T).double(), fkl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses.kd_loss(s, t, temperature=T, direction="reverse").double(), rkl,
                               rtol=1e-5, atol=1e-6)
    sym = losses.kd_loss(s, t, temperature=torch.tensor(T), direction="symmetric", symmetric_lambda=0.9)
    torch.testing.assert_close(sym.double(), 0.1 * fkl + 0.9 * rkl, rtol=1e-5, atol=1e-6)
    assert fkl > 0 and not torch.isclose(fkl, rkl)


def test_reduction_sums_the_vocabulary_and_averages_tokens():
    """Hand-made: p = (.5, .5, 0+, 0+), q = (.9, .1, ...): KL = .5 ln(.5/.9) + .5 ln(.5/.1) = 0.5108 per token.
    ``reduction='mean'`` (divide by V too) would give a quarter of that; a masked garbage token must not count."""
    big = 30.0
    t = torch.tensor([[0.0, 0.0, -big, -big]] * 2 + [[5.0, -5.0, 3.0, 1.0]])
    s = torch.tensor([[math.log(0.9), math.log(0.1), -big, -big]] * 2 + [[-5.0, 5.0, 0.0, 0.0]])
    mask = torch.tensor([True, True, False])
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    got = losses.kd_loss(s, t, temperature=1.0, mask=mask).item()
    assert got == pytest.approx(expected, abs=1e-5)
    by_mean = F.kl_div(F.log_softmax(s[:2], -1), F.log_softmax(t[:2], -1), log_target=True, reduction="sum") / 8
    assert by_mean.item() == pytest.approx(expected / 4, abs=1e-5) and got != pytest.approx(by_mean.item(), abs=1e-3)


def test_objective_is_alpha_t_squared_kl_plus_ce(logits):
    s, t = logits
    y = torch.tensor([[1, 2, -1], [0, 6, 3]])                       # one ignored target
    T, alpha = 3.0, 0.7
    loss, aux = losses.distill_objective(s, y, t, alpha=alpha, temperature=T)
    mask = y >= 0
    kl = direct_kl(t, s, T)[mask].mean()
    ce = F.cross_entropy(s[mask], y[mask])
    torch.testing.assert_close(aux["kl"].double(), kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux["ce"], ce)
    torch.testing.assert_close(loss.double(), alpha * T * T * kl + (1 - alpha) * ce.double(), rtol=1e-5, atol=1e-6)
    assert aux["temperature"].item() == T
    # T**2 keeps the soft-target gradient scale: at large T, T^2 * KL tends to logit matching
    big = [losses.kd_loss(s, t, temperature=T) * T * T for T in (50.0, 100.0)]
    assert big[0].item() == pytest.approx(big[1].item(), rel=5e-3)


def test_topk_with_all_ids_is_exact_kl_and_buckets_the_rest(logits):
    s, t = logits
    V = t.shape[-1]
    ids, logprobs, missing = losses.teacher_topk(t, V, temperature=2.0)
    torch.testing.assert_close(missing, torch.zeros_like(missing), atol=1e-6, rtol=0)
    exact = losses.kd_loss(s, t, temperature=2.0)
    torch.testing.assert_close(losses.topk_kd_loss(s, ids, logprobs, torch.zeros_like(missing), 2.0), exact)
    st = s.clone().requires_grad_()
    losses.topk_kd_loss(st, ids, logprobs, torch.zeros_like(missing), 2.0).backward()
    assert torch.isfinite(st.grad).all()

    k = 3                                                              # against the "other" bucket by hand
    ids, logprobs, missing = losses.teacher_topk(t, k)
    p, q = torch.softmax(t.double(), -1), torch.softmax(s.double(), -1)
    want = torch.zeros(t.shape[:-1], dtype=torch.float64)
    for idx in torch.cartesian_prod(torch.arange(2), torch.arange(3)):
        i, j = idx.tolist()
        top = ids[i, j].tolist()
        rest_p, rest_q = 1 - p[i, j, top].sum(), 1 - q[i, j, top].sum()
        want[i, j] = (p[i, j, top] * (p[i, j, top] / q[i, j, top]).log()).sum() + rest_p * (rest_p / rest_q).log()
    torch.testing.assert_close(losses.topk_kd_loss(s, ids, logprobs, missing).double(), want.mean(),
                               rtol=1e-4, atol=1e-6)


def test_sampled_kd_is_unbiased():
    """E[counts / n] = p, so the mean gradient of the sampled loss is the full forward-KL gradient q - p."""
    g = torch.Generator().manual_seed(1)
    P, V, n, trials = 3, 10, 8, 4000
    t, s = torch.randn(P, V, generator=g) * 1.5, torch.randn(P, V, generator=g)
    ids, counts = losses.sample_teacher(t.expand(trials, P, V), n, generator=torch.Generator().manual_seed(2))
    assert (counts.sum(-1) == n).all()
    assert all(len(set(r[c > 0].tolist())) == int((c > 0).sum()) for r, c in zip(ids.view(-1, n), counts.view(-1, n)))
    st = s.expand(trials, P, V).clone().requires_grad_()
    losses.sampled_kd_loss(st, ids, counts / n).backward()
    estimate = st.grad.mean(0) * P * trials                            # per-token gradient, averaged over trials
    sf = s.clone().requires_grad_()
    losses.kd_loss(sf, t).backward()
    full = sf.grad * P
    p = torch.softmax(t, -1)
    stderr = (p * (1 - p) / (n * trials)).sqrt()
    assert ((estimate - full).abs() <= 5 * stderr + 1e-6).all(), (estimate - full).abs().max()
    assert (estimate - full).abs().max() > 0                           # a real estimate, not the formula
    # the loss itself is CE with the sparse soft targets: its mean over trials is H(p, q) to sampling error
    ce = -(p * torch.log_softmax(s, -1)).sum(-1).mean()
    assert losses.sampled_kd_loss(s.expand(trials, P, V), ids, counts / n).item() == pytest.approx(ce.item(), rel=0.02)


# ------------------------------------------------------------------------------------------- temperature

def test_gradient_reversal_flips_the_temperature_gradient(logits):
    s, t = logits
    theta = torch.tensor(0.3)

    def kd(T):
        return losses.kd_loss(s, t, temperature=T) * T * T

    a = theta.clone().requires_grad_()
    kd(losses.learnable_temperature(a, torch.tensor(10**6), ramp_steps=0)).backward()
    b = theta.clone().requires_grad_()
    kd(1 + 20 * torch.sigmoid(b)).backward()                          # the same T, minimized like the student
    assert a.grad.abs() > 1e-4
    torch.testing.assert_close(a.grad, -b.grad)
    value = losses.learnable_temperature(theta, torch.tensor(0), ramp_steps=10)
    assert value.item() == pytest.approx(1 + 20 * torch.sigmoid(theta).item())
    ramp = [losses.cosine_ramp(torch.tensor(i), 10).item() for i in range(12)]
    assert 0 < ramp[0] < 0.03 and ramp[9] == ramp[11] == 1.0 and ramp == sorted(ramp)
    assert losses.temperature_logit(4.0) == pytest.approx(math.log(3 / 17))
    sched = [losses.scheduled_temperature(torch.tensor(i), 5, 4.0, 2.0).item() for i in (0, 2, 4, 9)]
    assert sched == [4.0, 3.0, 2.0, 2.0]


def test_learnable_temperature_under_func_grad_and_compile():
    """The GRL inside ``torch.func.grad_and_value`` (what the train step does), eager and compiled, agree;
    the teacher runs under ``no_grad`` inside the differentiated function."""
    g = torch.Generator().manual_seed(3)
    w_t, x = torch.randn(8, 5, generator=g), torch.randn(4, 8, generator=g)

    def loss(params, step, teacher):
        with torch.no_grad():
            t_logits = x @ teacher
        T = losses.learnable_temperature(params["theta"], step, ramp_steps=4)
        return losses.kd_loss(x @ params["w"], t_logits, temperature=T) * T * T

    params = {"theta": torch.tensor(0.1), "w": torch.randn(8, 5, generator=g)}
    step = torch.tensor(1)
    eager = torch.func.grad_and_value(loss)(params, step, w_t)
    compiled = torch.compile(torch.func.grad_and_value(loss), fullgraph=True)(params, step, w_t)
    for a, b in zip(tree_leaves(eager), tree_leaves(compiled)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # the sign: a student-side (un-reversed) temperature would get the opposite gradient
    plain = torch.func.grad(lambda th: losses.kd_loss(x @ params["w"], x @ w_t, temperature=1 + 20 * torch.sigmoid(th))
                            * (1 + 20 * torch.sigmoid(th)) ** 2)(params["theta"])
    scale = losses.cosine_ramp(step, 4)
    torch.testing.assert_close(eager[0]["theta"], -scale * plain)


# ------------------------------------------------------------------------------------------- the recipes

COMMON = ["block_size=32", "batch_size=16", "compile=false", "sample_tokens=0", "save_every=0", "eval_batches=8",
          "log_every=10"]
TEACHER = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "steps=400", "warmup_steps=40", "lr=3e-3",
           "min_lr=3e-4", "eval_every=0", "health=false"]
STUDENT = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "lr=3e-3", "min_lr=3e-4"]


@pytest.fixture(scope="module", autouse=True)
def token_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("PURESTEP_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """About 390 KB of real text: a few of this Python's own standard-library modules."""
    import argparse, difflib, inspect, json as json_module, pathlib, textwrap  # noqa: E401
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("".join(Path(m.__file__).read_text() for m in
                            (json_module, textwrap, argparse, difflib, inspect, pathlib)))
    return path


@pytest.fixture(scope="module")
def teacher(corpus, tmp_path_factory):
    """A byte-level Llama (d=64, 2 layers) trained 400 steps on the corpus: val loss about 2.04."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    assert main(["recipe=standard", f"data={corpus}", f"out={out}", *COMMON, *TEACHER]) == 0
    return out


def distill(corpus, teacher, out, *extra, recipe="distill"):
    """Run ``recipe`` (distill, or distill_cache with the same batches) into ``out``."""
    args = [*COMMON, *STUDENT] if recipe == "distill" else COMMON[:2]
    assert main([f"recipe={recipe}", f"data={corpus}", f"teacher={teacher}", f"out={out}", *args, *extra]) == 0
    return out


def final_val(out) -> float:
    return ckpt.load(Path(out) / "final.msgpack")["loop"]["best_val"]


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def config(corpus, teacher, *extra):
    from purestep.core.config import resolve
    from purestep.recipes.distill import recipe
    overrides = dict(a.split("=", 1) for a in [f"data={corpus}", f"teacher={teacher}", *COMMON, *STUDENT, *extra])
    return resolve(recipe.Config, overrides=overrides)


def test_teacher_is_frozen_and_an_input_of_the_step(corpus, teacher):
    from purestep.core.tree import clone, tree_map
    from purestep.recipes.distill.recipe import prepare_run, train_steps
    p = prepare_run(config(corpus, teacher, "steps=3"))
    frozen, steps = p.teacher.frozen, train_steps(p, p.run.optimizer)
    before, start = clone(frozen["teacher"]), clone(p.run.state.params)   # the step donates the state: copy first
    state = p.run.state
    for cursor in range(3):
        state, m = steps.train(state, steps.batches.get(cursor), frozen)
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(before), tree_leaves(frozen["teacher"])))
    assert not any(t.requires_grad for t in tree_leaves(frozen["teacher"]))
    assert not any(torch.equal(a, b) for a, b in zip(tree_leaves(start), tree_leaves(state.params)))
    # a graph input, not a constant: another teacher through the same step gives another KL
    other = {"teacher": tree_map(lambda t: t * 0.5, frozen["teacher"])}
    batch = steps.batches.get(3)
    assert steps.train(state, batch, frozen)[1]["kl"] != steps.train(state, batch, other)[1]["kl"]


def test_learnable_temperature_run_and_its_checkpoint(corpus, teacher, tmp_path, capsys):
    from purestep.optim.common import decay_mask
    out = distill(corpus, teacher, tmp_path / "run", "steps=40", "warmup_steps=4", "lr=1e-2", "log_every=2",
                  "temperature_mode=learnable", "temperature=2", "temperature_ramp_steps=10", "eval_every=0",
                  "temperature_min=1.5", "temperature_max=11")
    rows = metrics(out)
    temps = [r["temperature"] for r in rows if "temperature" in r]
    assert len(temps) == 20 and all(1.5 < t < 11.0 for t in temps)
    assert all(r["health/grad_norm/kd_temperature"] > 0 for r in rows if "health/grad_norm/kd_temperature" in r)
    assert any("val/teacher_loss" in r for r in rows)
    top = ckpt.load(out / "final.msgpack")
    theta = top["state"]["params"]["kd_temperature"]
    assert theta.dim() == 0 and not decay_mask(top["state"]["params"])["kd_temperature"]
    assert abs(theta.item() - losses.temperature_logit(2.0, 1.5, 11)) > 0.01      # theta was trained ...
    assert temps[-1] == pytest.approx(1.5 + 9.5 * torch.sigmoid(theta).item(), abs=1e-3)   # ... and is the T used
    assert top["recipe"] == "distill" and top["model"]["config"]["d_model"] == 32
    # the student checkpoint is a plain Llama to the other recipes
    assert main(["recipe=generate", f"init={out}", "prompt=def ", "max_new_tokens=8", "temperature=0"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["recipe=standard", f"data={corpus}", f"init={out}", f"out={tmp_path / 'tuned'}", *COMMON,
                 "steps=2", "eval_every=0"]) == 0


def test_scheduled_temperature_symmetric_kl_grad_accum_and_remat(corpus, teacher, tmp_path):
    out = distill(corpus, teacher, tmp_path / "run", "steps=5", "warmup_steps=1", "log_every=1", "grad_accum=2",
                  "temperature_mode=scheduled", "temperature=3", "temperature_end=1", "kl=symmetric",
                  "symmetric_lambda=0.5", "alpha=0.9", "remat=true", "eval_every=0")
    rows = [r for r in metrics(out) if "temperature" in r]
    assert [r["temperature"] for r in rows] == pytest.approx([3.0, 2.5, 2.0, 1.5, 1.0])
    assert all(r["kl"] > 0 and math.isfinite(r["train/loss"]) for r in rows)


def test_resume_is_exact(corpus, teacher, tmp_path):
    common = ("decay_steps=8", "eval_every=0", "warmup_steps=2", "temperature_mode=learnable", "temperature=3",
              "temperature_ramp_steps=4")
    distill(corpus, teacher, tmp_path / "a", "steps=4", *common)
    distill(corpus, teacher, tmp_path / "a", "steps=8", *common)
    distill(corpus, teacher, tmp_path / "b", "steps=8", *common)
    a, b = (ckpt.load(tmp_path / x / "final.msgpack") for x in "ab")
    assert a["step"] == b["step"] == 8
    assert all(torch.equal(x, y) for x, y in zip(tree_leaves(a["state"]), tree_leaves(b["state"])))


@pytest.mark.parametrize("source", ["online", "cache"])
def test_orchestrated_distillation_branches_on_the_same_batches_and_resumes_exactly(source, corpus, teacher, caches,
                                                                                     tmp_path):
    """``orchestrator.enabled=true`` in recipe=distill: decisions (every 4 steps, backing off) train each candidate student
    against the same teacher outputs (online, or the cache's) on the same batches; a run stopped at step 8
    and resumed ends bitwise where a straight run ends, with the same strategy and bandit."""
    extra = ["decay_steps=20", "eval_every=0", "log_every=1", "orchestrator.enabled=true",
             "orchestrator.decision_interval=4", "orchestrator.eval_horizon=2", "orchestrator.candidates=2",
             "orchestrator.initial=aggressive_adamw"]
    extra += [f"cache={caches / 'topk'}"] if source == "cache" else ["temperature_mode=learnable", "temperature=2"]
    distill(corpus, teacher, tmp_path / "a", *extra, "steps=8")
    distill(corpus, teacher, tmp_path / "a", *extra, "steps=20")
    distill(corpus, teacher, tmp_path / "b", *extra, "steps=20")
    records = [json.loads(line) for line in (tmp_path / "b" / "orchestrator.jsonl").read_text().splitlines()]
    decisions = [r for r in records if r["kind"] == "decision"]
    assert len(decisions) >= 2 and all(r["same_batches"] and len(r["candidates"]) == 2 for r in decisions)
    assert all(math.isfinite(v) for r in decisions for v in r["scores"].values())
    a, b = (ckpt.load(tmp_path / x / "final.msgpack") for x in "ab")
    assert a["step"] == b["step"] == 20 and a["orchestrator"] == b["orchestrator"]
    assert all(torch.equal(x, y) for x, y in zip(tree_leaves(a["state"]), tree_leaves(b["state"])))


def test_torchrun_two_ranks_equal_one_process(corpus, teacher, tmp_path):
    """Data-parallel distillation: each rank runs the teacher on its rows; 2 x 8 rows == 1 x 16 rows."""
    from purestep.core.tree import max_abs_diff
    common = [f"data={corpus}", f"teacher={teacher}", *COMMON, *STUDENT, "steps=4", "eval_every=4", "warmup_steps=1",
              "temperature_mode=learnable", "temperature=2"]
    assert main(["recipe=distill", *common, f"out={tmp_path / 'one'}"]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", str(REPO / "bin" / "run"),
                          *merge_args("recipe=distill", *common, "batch_size=8", f"out={tmp_path / 'two'}")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (ckpt.load(tmp_path / name / "final.msgpack") for name in ("one", "two"))
    assert max_abs_diff(one["state"]["params"], two["state"]["params"]) < 1e-5
    assert abs(one["val_loss"] - two["val_loss"]) < 1e-5


def test_students(corpus, teacher, tmp_path):
    from dataclasses import asdict
    from purestep.models import llama
    from purestep.models.loading import load_model, model_entry
    from purestep.recipes.distill.recipe import build_student
    tcfg = llama.LlamaConfig(vocab_size=256, d_model=48, n_layers=5, n_heads=6, n_kv_heads=2, rope_theta=5e4)
    tparams = llama.init(tcfg, seed=7)
    path = tmp_path / "five.msgpack"
    ckpt.save(path, {"params": tparams}, step=0, extra={"model": model_entry(tcfg), "tokenizer": {"type": "byte"}})
    five = load_model(str(path))
    unset = [f"model.{k}=none" for k in ("d_model", "n_layers", "n_heads")]      # undo STUDENT's shape

    scfg, params, _ = build_student(config(corpus, path, "student=drop_layers", *unset), five, "cpu")
    assert scfg == llama.LlamaConfig(**{**asdict(tcfg), "n_layers": 3})
    for name in ("wq", "wo"):
        assert torch.equal(params["layers"]["attn"][name], tparams["layers"]["attn"][name][[0, 2, 4]])
    assert torch.equal(params["embed"], tparams["embed"])

    scfg, params, _ = build_student(config(corpus, path, "student=shrink", *unset, "model.n_heads=3"), five, "cpu")
    assert (scfg.d_model, scfg.n_layers, scfg.n_heads, scfg.n_kv_heads, scfg.head_dim, scfg.rope_theta) == \
        (48, 5, 3, 1, 16, 5e4)
    scfg, params, _ = build_student(config(corpus, path, "student=shrink", *unset, "model.d_model=36"), five, "cpu")
    assert (scfg.d_model, scfg.n_layers, scfg.n_heads, scfg.n_kv_heads, scfg.head_dim, scfg.ffn_dim) == \
        (36, 5, 6, 2, 6, 128)
    assert params["layers"]["attn"]["wk"].shape == (5, 12, 36)
    scfg, params, _ = build_student(config(corpus, path, f"init={path}", *unset), five, "cpu")
    assert scfg == tcfg and torch.equal(params["layers"]["mlp"]["w_up"], tparams["layers"]["mlp"]["w_up"])
    scfg, params, _ = build_student(config(corpus, path), five, "cpu")
    assert scfg == llama.LlamaConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2)
    assert params["embed"].shape == (256, 32)


# ------------------------------------------------------------------------------------------- offline cache

CACHE_STEPS = ["steps=60", "warmup_steps=6", "eval_every=0", "eval_batches=16"]


@pytest.fixture(scope="module")
def caches(corpus, teacher, tmp_path_factory):
    folder = tmp_path_factory.mktemp("caches")
    distill(corpus, teacher, folder / "topk", "mode=topk", "k=8", "steps=60", recipe="distill_cache")
    distill(corpus, teacher, folder / "sample", "mode=sample", "samples=16", "steps=60", recipe="distill_cache")
    distill(corpus, teacher, folder / "topk_packed", "k=8", "steps=60", recipe="distill_cache")   # the default mode
    return folder


def test_cache_layout_and_atomic_build(corpus, teacher, caches, capsys):
    meta = json.loads((caches / "topk" / "meta.json").read_text())
    assert (meta["mode"], meta["width"], meta["batch_size"], meta["block_size"], meta["steps"]) == \
        ("topk", 8, 16, 32, 60)
    assert meta["teacher"]["fingerprint"] and meta["data"]["train_tokens"] > 300_000
    positions = 60 * 16 * 32
    sizes = {f.name: f.stat().st_size for f in (caches / "topk").glob("*.bin")}
    assert sizes == {"ids.bin": positions * 8 * 2, "logprobs.bin": positions * 8 * 2, "missing.bin": positions * 4}
    sizes = {f.name: f.stat().st_size for f in (caches / "sample").glob("*.bin")}
    assert sizes == {"ids.bin": positions * 16 * 2, "counts.bin": positions * 16 * 2}
    sizes = {f.name: f.stat().st_size for f in (caches / "topk_packed").glob("*.bin")}
    assert sizes == {"ids.bin": positions * 8, "codes.bin": positions * 8, "scale.bin": positions * 4}
    assert sorted(p.name for p in caches.iterdir()) == ["sample", "topk", "topk_packed"]   # no temporary folder
    capsys.readouterr()
    distill(corpus, teacher, caches / "topk", "mode=topk", "k=8", "steps=60", recipe="distill_cache")
    assert "nothing to do" in capsys.readouterr().err       # progress goes to stderr
    # the cached targets are the teacher's: top-k log-probs sorted, counts summing to the draws
    from purestep.recipes.distill.cache import TeacherCache
    t = TeacherCache.open(caches / "topk").targets(3)
    assert t["topk_ids"].shape == (16, 32, 8) and (t["topk_logprobs"].diff(dim=-1) <= 0).all()
    assert ((t["topk_logprobs"].float().exp().sum(-1) + t["topk_missing"] - 1).abs() < 5e-3).all()
    s = TeacherCache.open(caches / "sample").targets(0)
    assert (s["sample_counts"].sum(-1) == 16).all()
    # the packed cache holds the same ids, and log-probs within its 8-bit step; it loses a little more KL
    packed = TeacherCache.open(caches / "topk_packed")
    p = packed.targets(3)
    assert torch.equal(p["topk_ids"], t["topk_ids"])
    assert (p["topk_logprobs"] - t["topk_logprobs"].float()).abs().max() < 0.05
    assert (p["topk_missing"] - t["topk_missing"]).abs().max() < 5e-3
    plain = json.loads((caches / "topk" / "meta.json").read_text())
    assert 0 <= plain["kl_rounding"] < packed.meta["kl_rounding"] < 0.01
    assert packed.meta["kl_truncation"] == pytest.approx(plain["kl_truncation"], rel=1e-6)


def test_cache_with_grad_accum_and_bf16(corpus, teacher, tmp_path):
    """Micro-batched caches ([steps, grad_accum, B, T, k]) feed a grad_accum run, teacher captured in bf16."""
    settings = ["grad_accum=2", "batch_size=4", "steps=3"]
    distill(corpus, teacher, tmp_path / "cache", *settings, "mode=sample", "samples=4", "dtype=bf16",
            recipe="distill_cache")
    meta = json.loads((tmp_path / "cache" / "meta.json").read_text())
    assert meta["x_shape"] == [2, 4, 32] and meta["dtype"] == "bf16"
    out = distill(corpus, teacher, tmp_path / "run", *settings, "eval_every=0", f"cache={tmp_path / 'cache'}")
    assert math.isfinite(final_val(out))                                   # trained and validated
    assert all(r["kl"] > 0 for r in metrics(out) if "kl" in r)


def test_training_from_a_cache_matches_online(corpus, teacher, caches, tmp_path, capsys):
    """Top-k (k=8 of 256, "other" bucket) and 16-sample caches reach the online run's val loss within 2%."""
    online = final_val(distill(corpus, teacher, tmp_path / "online", *CACHE_STEPS))
    for mode in ("topk", "topk_packed", "sample"):
        cached = final_val(distill(corpus, teacher, tmp_path / mode, *CACHE_STEPS, f"cache={caches / mode}"))
        print(f"{mode} cache: val {cached:.4f} against online {online:.4f}")
        assert abs(cached - online) <= 0.02 * online, (mode, cached, online)
    from purestep.recipes.bench.distill import step_time_ratio
    ratio = step_time_ratio(config(corpus, teacher, *CACHE_STEPS), config(corpus, teacher, *CACHE_STEPS,
                                                                           f"cache={caches / 'topk'}"), steps=10)
    print(capsys.readouterr().out)
    assert 0 < ratio["ratio"] < 1.0          # no teacher forward: cheaper per step (ratio, same process)



def test_the_cache_benchmark_command(corpus, teacher, capsys):
    """``bin/run recipe=recipes.bench.distill``: builds its own cache, prints the ratio, leaves nothing."""
    before = set(Path(tempfile.gettempdir()).glob("distill_bench-*"))
    assert main(["recipe=recipes.bench.distill", f"teacher={teacher}", f"data={corpus}", "steps=2", "warmup=1"]) == 0
    assert "cached/online = " in capsys.readouterr().out
    assert set(Path(tempfile.gettempdir()).glob("distill_bench-*")) == before


BAD = {
    "no teacher": (["teacher="], "teacher=PATH"),
    "missing teacher": (["teacher=/nonexistent/teacher"], "/nonexistent/teacher"),
    "learnable at the bound": (["temperature_mode=learnable", "temperature=1"], "strictly between"),
    "drop_layers with a shape": (["student=drop_layers"], "model.*"),
    "not a cache": (["cache={tmp}"], "not a teacher cache"),
    "another tokenizer": (["tokenizer=char"], "teacher's own tokenizer"),
    "init with a student shape": (["init={teacher}"], "leave student= and model.* unset"),
    "fill-in-the-middle": (["fim_rate=0.5"], "sentinel ids the teacher never saw"),
    "orchestrator without spike": (["orchestrator.enabled=true", "spike.enabled=false"], "spike.enabled=true"),
    "cache of other batches": (["cache={topk}", "batch_size=8", "steps=60"], "batch_size: cache 16, run 8"),
    "cache too short": (["cache={topk}", "steps=61"], "steps: cache covers 60"),
    "cache with a schedule": (["cache={sample}", "steps=60", "temperature_mode=scheduled"], "temperature_mode=fixed"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_touches_nothing(case, corpus, teacher, caches, tmp_path, capsys):
    args, needle = BAD[case]
    args = [a.format(tmp=tmp_path, topk=caches / "topk", sample=caches / "sample", teacher=teacher) for a in args]
    out = tmp_path / "run"
    capsys.readouterr()
    code = main(["recipe=distill", f"data={corpus}", f"teacher={teacher}", f"out={out}", *COMMON, *STUDENT, *args])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and needle in err[0], err
    assert not out.exists()


def test_a_nan_fault_is_skipped_with_an_online_teacher(corpus, teacher, tmp_path):
    out = tmp_path / "nan"
    assert main(["recipe=distill", f"data={corpus}", f"teacher={teacher}", f"out={out}", *COMMON, *STUDENT,
                 "steps=6", "eval_every=0", "log_every=3", "spike.enabled=false", "fault.inject_nan_at=2"]) == 0
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    skipped = {r["step"]: r["skipped"] for r in rows if "skipped" in r}
    assert skipped[3] == pytest.approx(1 / 3) and skipped[6] == 0.0


def test_distill_cache_refuses_to_overwrite(corpus, teacher, caches, capsys):
    code = main(["recipe=distill_cache", f"data={corpus}", f"teacher={teacher}", f"out={caches / 'topk'}",
                 *COMMON[:2], "mode=topk", "k=4", "steps=60"])
    assert code == 2 and "already exists" in capsys.readouterr().err
    assert json.loads((caches / "topk" / "meta.json").read_text())["width"] == 8


# ------------------------------------------------------------------------------------------- acceptance

# Measured gaps (CE-only minus distilled val loss) with this setup and student seeds 1..6: 0.111, 0.139, 0.093,
# 0.142, 0.055, 0.131; with fewer steps (teacher 300, students 150) they shrank to 0.003-0.09, too close to noise.
MARGIN = 0.03

def test_distillation_beats_ce_alone(corpus, teacher, tmp_path):
    """The issue's acceptance claim, small: a d=32 student distilled from the trained d=64 teacher beats the
    same student (same init, same batches) trained on CE alone for the same steps, on validation CE."""
    common = ["steps=200", "warmup_steps=20", "eval_every=0", "eval_batches=16", "health=false"]
    kd = final_val(distill(corpus, teacher, tmp_path / "kd", *common, "alpha=0.9"))
    ce = final_val(distill(corpus, teacher, tmp_path / "ce", *common, "alpha=0"))
    teacher_val = ckpt.load(teacher / "final.msgpack")["loop"]["best_val"]
    print(f"teacher {teacher_val:.4f}; student distilled {kd:.4f}, CE alone {ce:.4f}: gap {ce - kd:.4f}")
    assert ce - kd > MARGIN, (kd, ce)
