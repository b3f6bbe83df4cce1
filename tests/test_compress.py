"""The hidden-state compressor and ``recipe=compress``: exactness, PCA against SVD, training reaching PCA,
stages 1a -> 1b, early stopping, sweep tables, the state cache, bad input, SmolLM2 states."""
import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from purestep import optim
from purestep.core.io import checkpoint as ckpt
from purestep.recipes import main
from purestep.core.state import init_state
from purestep.core.step import make_train_step
from purestep.core.data.tokenizers import make_tokenizer
from purestep.models import compressor as C, llama
from purestep.models.loading import load_model, model_entry
from purestep.optim import schedules
from purestep.recipes.compress import states as compress_states

TEACHER_CFG = llama.LlamaConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2)
FAST = ["block_size=16", "batch_size=8", "train_tokens=1024", "val_tokens=256", "log_every=10", "warmup_steps=5"]


pytestmark = pytest.mark.usefixtures("token_cache")   # tests/conftest.py


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """A small random Llama saved as a purestep checkpoint with a byte tokenizer."""
    path = tmp_path_factory.mktemp("teacher") / "teacher.msgpack"
    ckpt.save(path, {"params": llama.init(TEACHER_CFG, seed=3)}, step=0,
              extra={"model": model_entry(TEACHER_CFG), "tokenizer": make_tokenizer("byte").to_dict()})
    return path


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> dict:
    """Two domains: English prose-like text and Python source."""
    import json as json_module
    import textwrap
    folder = tmp_path_factory.mktemp("texts")
    prose = folder / "prose.txt"
    prose.write_text(" ".join(f"the {w} of the day was {v} and quiet" for w in ("light", "end", "rest", "sound")
                              for v in ("soft", "long", "grey", "late", "near")) * 20)
    code = folder / "code.py"
    code.write_text(Path(json_module.__file__).read_text() + Path(textwrap.__file__).read_text())
    return {"1a": prose, "1b": code}


def compress(teacher, out, *extra) -> int:
    return main(["recipe=compress", f"teacher={teacher}", f"out={out}", *FAST, *extra])


def read_rows(folder: Path) -> list[dict]:
    with open(folder / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def params_of(path: Path) -> dict:
    top = ckpt.load(path)
    return {**top["state"]["params"], **top.get("frozen", {})}


# ------------------------------------------------------------------------------------------------ the model

@pytest.mark.parametrize("center", C.CENTERS)
def test_full_width_orthogonal_is_exact(center):
    cfg = C.CompressorConfig(48, 48, center=center)
    x = torch.randn(3, 7, 48, dtype=torch.float64) * 5 + 40          # far from zero, like real residual streams
    params = C.init(cfg, seed=1, mean=x.mean((0, 1)), dtype=torch.float64)
    x_hat, z = C.apply(params, x)
    assert z.shape == (3, 7, 48) and x_hat.shape == x.shape
    assert torch.allclose(x_hat, x, rtol=0, atol=1e-12 * x.abs().max())
    metrics = C.evaluate(params, [x])
    assert metrics["cosine"] == pytest.approx(1.0, abs=1e-12) and metrics["rel_error"] < 1e-12
    single = C.apply(C.init(cfg, seed=1, mean=x.mean((0, 1))), x.float())[0]    # float32, the default
    assert torch.allclose(single.double(), x, rtol=0, atol=1e-5 * x.abs().max())


def test_narrow_init_shapes_and_orthonormal_columns():
    cfg = C.CompressorConfig(40, 12)
    params = C.init(cfg, seed=0)
    w = params["w"].double()
    assert w.shape == (40, 12) and torch.allclose(w.T @ w, torch.eye(12, dtype=torch.float64), atol=1e-6)
    assert not torch.allclose(C.init(cfg, seed=1)["w"], params["w"])          # the seed matters
    x = torch.randn(2, 5, 40)
    x_hat, z = C.apply(params, x)
    assert z.shape == (2, 5, 12) and x_hat.shape == (2, 5, 40)
    assert set(C.init(C.CompressorConfig(40, 12, center="none"), 0)) == {"w"}
    normal = C.init(C.CompressorConfig(400, 300, init="normal"), 0)["w"]
    assert normal.std().item() == pytest.approx(400 ** -0.5, rel=0.02)
    assert C.count_params(cfg) == 40 * 12 + 40


def low_rank(n: int, d: int, rank: int, seed: int, noise: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.normal(size=(d, rank)))[0]
    scales = 10.0 * 0.7 ** np.arange(rank)
    x = 3.0 + (rng.normal(size=(n, rank)) * scales) @ basis.T
    return x + noise * rng.normal(size=(n, d))


def test_pca_matches_svd_and_eckart_young():
    d, rank = 24, 5
    x = low_rank(600, d, rank, seed=0)
    mean = x.mean(0)
    _, s, vt = np.linalg.svd(x - mean, full_matrices=False)
    moments = C.Moments(d)
    for part in np.array_split(x, 7):                                  # chunked accumulation
        moments.add(torch.from_numpy(part))
    pca = C.PCA(moments)
    assert np.allclose(pca.values.numpy()[:rank], s[:rank] ** 2 / len(x), rtol=1e-8)
    for k in (1, 3, rank):
        w = pca.params(k, dtype=torch.float64)["w"].numpy()
        assert np.allclose(w @ w.T, vt[:k].T @ vt[:k], atol=1e-8)          # the same subspace as the SVD's
        params = pca.params(k, dtype=torch.float64)
        err = ((C.apply(params, torch.from_numpy(x))[0].numpy() - x) ** 2).sum()
        assert err == pytest.approx((s[k:] ** 2).sum(), rel=1e-8, abs=1e-6)  # Eckart-Young: the tail of the spectrum
    assert pca.explained(rank) == pytest.approx(1.0)
    held_out = torch.from_numpy(low_rank(200, d, rank, seed=0)[::2] + 0.0)  # same subspace and mean, new rows
    exact = C.evaluate(pca.params(rank, dtype=torch.float64), [held_out])
    assert exact["rel_error"] < 1e-10 and exact["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert exact["explained_variance"] == pytest.approx(1.0, abs=1e-12)


def test_uncentered_pca_needs_one_more_direction_for_the_mean():
    """center=none: the reference is the top of the second-moment matrix; a nonzero mean costs one direction."""
    x = torch.from_numpy(low_rank(400, 16, 3, seed=2))                 # rank 3 around a mean of 3.0
    pca = C.PCA(C.Moments(16).add(x), center=False)
    assert "mu" not in pca.params(3)
    assert C.evaluate(pca.params(3, dtype=torch.float64), [x])["rel_error"] > 1e-3
    assert C.evaluate(pca.params(4, dtype=torch.float64), [x])["rel_error"] < 1e-10


def test_metrics_match_their_formulas():
    x, x_hat = torch.randn(50, 6, dtype=torch.float64) + 1, torch.randn(50, 6, dtype=torch.float64)
    m = C.Metrics(scale=2.0).add(x[:20], x_hat[:20]).add(x[20:], x_hat[20:]).result()
    xn, hn = x.numpy(), x_hat.numpy()
    cos = (xn * hn).sum(1) / np.linalg.norm(xn, axis=1) / np.linalg.norm(hn, axis=1)
    assert m["mse"] == pytest.approx(((hn - xn) ** 2).mean())
    assert m["cosine"] == pytest.approx(cos.mean())
    assert m["rel_error"] == pytest.approx(np.linalg.norm(hn - xn) / np.linalg.norm(xn))
    assert m["explained_variance"] == pytest.approx(1 - ((hn - xn) ** 2).sum() / ((xn - xn.mean(0)) ** 2).sum())
    assert m["unexplained"] == pytest.approx(((hn - xn) ** 2).sum(1).mean() / 2.0)


def test_training_reaches_pca_on_a_low_rank_problem():
    """A tied compressor trained from a random orthogonal init by the pure step reaches PCA (Baldi & Hornik)."""
    d, k = 32, 6
    train = torch.from_numpy(low_rank(4096, d, 10, seed=1, noise=0.05)).float()
    held_out = torch.from_numpy(low_rank(1024, d, 10, seed=1, noise=0.05)[::-1].copy()).float()
    moments = C.Moments(d).add(train)
    pca, scale = C.PCA(moments), moments.total_variance()
    cfg = C.CompressorConfig(d, k)
    params = C.init(cfg, seed=0, mean=moments.mean)
    steps = 400
    opt = optim.adamw(lr=2e-2, b1=0.9, b2=0.99, weight_decay=0.0, schedule=schedules.cosine(20, steps, 0.02))
    step = make_train_step(lambda p, batch: C.loss(p, batch, scale), opt)
    state = init_state(params, opt, seed=0)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        state, _ = step(state, train[torch.randint(0, len(train), (256,), generator=g)])
    ours, ref = C.evaluate(state.params, [held_out], scale), C.evaluate(pca.params(k), [held_out], scale)
    start = C.evaluate(params, [held_out], scale)
    assert start["cosine"] < ref["cosine"] - 0.05                       # the init is far from the answer
    assert ours["cosine"] > ref["cosine"] - 0.002
    assert ours["unexplained"] < 1.05 * ref["unexplained"]
    on_train = C.evaluate(state.params, [train], scale)["unexplained"]
    assert on_train >= C.evaluate(pca.params(k), [train], scale)["unexplained"] * (1 - 1e-4)  # PCA is optimal


# ------------------------------------------------------------------------------------------------ the recipe

def test_teacher_states_are_the_models_hidden_states(teacher):
    tokens = torch.randint(0, 256, (2, 16))
    full = load_model(str(teacher))
    _, hidden = llama.apply(full.params, tokens, full.config, return_hidden=True)
    for layer, index in ((0, 0), (1, 1), (-1, 2), (2, 2), (-3, 0)):
        t = compress_states.Teacher(str(teacher), layer, "cpu")
        assert t.layer == index
        assert torch.equal(t.states(tokens), hidden[index])


def test_sweep_writes_the_table_and_shares_the_cached_states(teacher, texts, tmp_path, tmp_path_factory):
    out = tmp_path / "sweep"
    states_root = tmp_path_factory.getbasetemp() / "cache" / "states"
    before = set(states_root.glob("*")) if states_root.exists() else set()
    assert compress(teacher, out, f"data={texts['1a']}", "sweep=4,8,32", "steps=150", "eval_every=50") == 0
    rows = read_rows(out)
    assert [(r["stage"], int(r["d_compressed"])) for r in rows] == [("1a", 4), ("1a", 8), ("1a", 32)]
    for r in rows:
        d = int(r["d_compressed"])
        assert float(r["ratio"]) == pytest.approx(32 / d) and int(r["params"]) == 32 * d + 32
        assert float(r["cosine_gap"]) < 0.01, r                         # within 0.01 cosine of PCA
        assert float(r["pca_explained_variance"]) >= float(r["explained_variance"]) - 0.01
        assert (out / f"d{d}" / "stage1a_best.msgpack").exists()
        assert not list((out / f"d{d}" / "stage1a").glob("*.msgpack"))   # only the best is kept
    assert float(rows[-1]["pca_cosine"]) == pytest.approx(1.0, abs=1e-6)
    table = (out / "summary.md").read_text().splitlines()
    assert table[0].startswith("| stage | d_compressed | ratio | params |") and len(table) == 2 + 3
    pytest.importorskip("matplotlib")
    assert (out / "summary.png").stat().st_size > 1000
    assert len(set(states_root.glob("*")) - before) == 2              # one train and one held-out set for all widths

    first = (out / "summary.csv").read_text()
    assert compress(teacher, out, f"data={texts['1a']}", "sweep=4,8,32", "steps=150", "eval_every=50") == 0
    assert (out / "summary.csv").read_text() == first                  # finished stages are skipped, not retrained


def test_cache_and_on_the_fly_give_the_same_run(teacher, texts, tmp_path):
    common = [f"data={texts['1a']}", "d_compressed=8", "steps=20", "eval_every=10"]
    assert compress(teacher, tmp_path / "cached", *common, "cache=true") == 0
    assert compress(teacher, tmp_path / "fly", *common, "cache=false") == 0
    a, b = read_rows(tmp_path / "cached")[0], read_rows(tmp_path / "fly")[0]
    for key in ("cosine", "pca_cosine", "mse", "pca_mse", "explained_variance"):
        assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5), key


def test_early_stopping_stops_a_run_that_stopped_improving(teacher, texts, tmp_path):
    """lr=0: the held-out loss never improves after the first evaluation, so patience=3 stops at the 4th."""
    out = tmp_path / "flat"
    assert compress(teacher, out, f"data={texts['1a']}", "d_compressed=8", "lr=0", "min_lr=0", "steps=100",
                    "eval_every=2", "patience=3") == 0
    row = read_rows(out)[0]
    assert (int(row["steps"]), int(row["best_step"])) == (8, 2)
    events = [json.loads(line) for line in (out / "stage1a" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "early_stop"] == [8]


def test_stage_1b_starts_from_stage_1a_best(teacher, texts, tmp_path):
    """Stage 1a with a strong weight decay only gets worse after its first evaluation (best step 1, stopped at 3);
    stage 1b at lr=0 must then hold exactly that best checkpoint's weights, on the second domain's data."""
    out = tmp_path / "stages"
    assert compress(teacher, out, f"data={texts['1a']}", "d_compressed=32", "lr=1e-2", "warmup_steps=0",
                    "lr_schedule=constant", "weight_decay=20", "eval_every=1", "patience=2", "steps=50") == 0
    first = read_rows(out)[0]
    assert (int(first["best_step"]), int(first["steps"])) == (1, 3)
    assert compress(teacher, out, f"data={texts['1a']}", f"data_1b={texts['1b']}", "stage=1b", "d_compressed=32",
                    "lr=0", "min_lr=0", "steps=2", "eval_every=1") == 0
    a, b = params_of(out / "stage1a_best.msgpack"), params_of(out / "stage1b_best.msgpack")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    top = ckpt.read_meta(out / "stage1b_best.msgpack")
    assert top["init"].startswith(str(out / "stage1a_best.msgpack")) and "(step 1)" in top["init"]
    assert top["signature"]["data"] != ckpt.read_meta(out / "stage1a_best.msgpack")["signature"]["data"]
    assert sorted(p.name for p in out.glob("*.msgpack")) == ["stage1a_best.msgpack", "stage1b_best.msgpack"]


def test_a_stage_resumes_through_the_shared_run_setup(teacher, texts, tmp_path, capsys):
    """A stage's checkpoint in its folder is resumed (``recipes.train.setup.start``: the loop goes on from its step);
    one written at another width is refused with one line before anything is loaded."""
    done = tmp_path / "done"
    assert compress(teacher, done, f"data={texts['1a']}", "d_compressed=8", "steps=6", "eval_every=3") == 0
    for out in (tmp_path / "resumed", tmp_path / "wider"):
        (out / "stage1a").mkdir(parents=True)
        shutil.copy(done / "stage1a_best.msgpack", out / "stage1a" / "step_000000006.msgpack")
    capsys.readouterr()
    assert compress(teacher, tmp_path / "resumed", f"data={texts['1a']}", "d_compressed=8", "steps=9",
                    "eval_every=3") == 0
    printed = capsys.readouterr()
    assert "at step 6" in printed.out + printed.err and int(read_rows(tmp_path / "resumed")[0]["steps"]) == 9
    assert compress(teacher, tmp_path / "wider", f"data={texts['1a']}", "d_compressed=16", "steps=9") == 2
    assert "holds a run with other settings" in capsys.readouterr().err


def test_stages_1a_1b_in_one_run_with_fixed_centering(teacher, texts, tmp_path):
    out = tmp_path / "both"
    assert compress(teacher, out, f"data={texts['1a']}", f"data_1b={texts['1b']}", "stage=1a,1b", "d_compressed=8",
                    "center=fixed", "steps=30", "eval_every=10") == 0
    assert [r["stage"] for r in read_rows(out)] == ["1a", "1b"]
    a, b = params_of(out / "stage1a_best.msgpack"), params_of(out / "stage1b_best.msgpack")
    assert torch.equal(a["mu"], b["mu"]) and not torch.equal(a["w"], b["w"])   # fixed mu kept, W fine-tuned


@pytest.mark.parametrize("args, message", [
    (["layer=7", "d_compressed=8"], "layer=7: the teacher has 2 blocks"),
    (["layer=-4", "d_compressed=8"], "layer=-4"),
    (["d_compressed=64"], "D'=64 is wider than the teacher's hidden states (D=32)"),
    (["d_compressed=8", "sweep=4,8"], "not both"),
    (["sweep=4,4"], "must be distinct"),
    ([], "set d_compressed=D' (one run) or sweep="),
    (["d_compressed=8", "stage=1b", "data_1b=stdlib"], "run stage=1a (same out=) first"),
    (["d_compressed=8", "stage=1a,1b"], "stage 1b needs data_1b="),
    (["d_compressed=8", "stage=1b,1a", "data_1b=stdlib"], "bad value for 'stage'"),
])
def test_bad_input_is_one_line(teacher, texts, tmp_path, capsys, args, message):
    out = tmp_path / "bad"
    assert compress(teacher, out, f"data={texts['1a']}", *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and message in err[-1], err
    assert not out.exists()


@pytest.mark.parametrize("teacher_arg, message", [
    ("teacher=", "recipe=compress needs teacher=PATH"),
    ("teacher=/no/such/model", "/no/such/model: no such file or folder"),
])
def test_missing_teacher_is_one_line(tmp_path, capsys, teacher_arg, message):
    assert main(["recipe=compress", teacher_arg, "d_compressed=8", f"out={tmp_path / 'x'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err


def test_help_lists_the_keys(capsys):
    assert main(["recipe=compress", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(key in out for key in ("d_compressed", "sweep", "stage", "data_1b", "layer", "cache", "patience"))


# ------------------------------------------------------------------------------------------------ SmolLM2

def test_smollm2_states_and_exact_full_width():
    from purestep.models import smollm2
    if smollm2.find_gguf() is None:
        pytest.skip(f"SmolLM2 is not installed ({smollm2.INSTALL})")
    full = load_model("smollm2")
    tokens = torch.tensor([full.tokenizer.encode("To be, or not to be, that is the question:")])
    _, hidden = llama.apply(full.params, tokens, full.config, return_hidden=True)
    last = compress_states.Teacher("smollm2", -1, "cpu")
    assert (last.layer, last.d_model) == (30, 576)
    x = last.states(tokens)
    assert torch.allclose(x, hidden[30], rtol=1e-5, atol=1e-4 * hidden[30].abs().max())
    params = C.init(C.CompressorConfig(576, 576), 0, mean=x[0].mean(0), dtype=torch.float64)
    m = C.evaluate(params, [x.double()])
    assert m["rel_error"] < 1e-10 and m["cosine"] == pytest.approx(1.0, abs=1e-12)
