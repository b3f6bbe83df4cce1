"""Qwen2 teachers (q/k/v biases) through the upcycle surgery and blockwise distillation: the DBA student's bias
leaves, the surgery's augmented-input trick ([W | b] on [x; 1]) exact at full rank, the report's errors on the
augmented matrices, a transformers Qwen2 folder as the teacher, and the recipe end to end."""
import math
import random

import pytest
import torch

from purestep.core.io import checkpoint as ckpt
from purestep.core.tree import max_abs_diff
from purestep.models import dba, llama, surgery
from purestep.optim.common import decay_mask
from purestep.recipes import main

HD = 16
BIASES = ("q_bias", "k_bias", "v_bias")
STUDENT_BIASES = ("q_s_bias", "q_g_bias", "k_s_bias", "k_g_bias", "v_bias")
NO_ROPE = {"rope_type": "factors", "factors": [1e30] * (HD // 2)}   # every pair's angle ~1e-29: RoPE is the identity


def config(**kw):
    return llama.LlamaConfig(**{"vocab_size": 96, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                "ffn_dim": 96, "qkv_bias": True, **kw})


def teacher(cfg, dtype=torch.float32, seed=0):
    """A random Qwen2-style Llama: biases from N(0, 0.5) so they matter, q/k scaled up so attention is peaky."""
    params = llama.init(cfg, seed=seed, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed + 1)
    attn = params["layers"]["attn"]
    attn["wq"], attn["wk"], params["embed"] = attn["wq"] * 8, attn["wk"] * 8, params["embed"] * 10
    for name in BIASES:
        attn[name] = torch.randn(attn[name].shape, generator=g, dtype=torch.float64) * 0.5
    return _cast(params, dtype)


def _cast(tree, dtype):
    return {k: _cast(v, dtype) if isinstance(v, dict) else v.to(dtype) for k, v in tree.items()}


def tokens(b=2, t=24, seed=0):
    return torch.randint(0, 96, (b, t), generator=torch.Generator().manual_seed(seed))


CALIB = tokens(4, 32, seed=11)


def without_biases(params):
    attn = {k: torch.zeros_like(v) if k.endswith("_bias") else v for k, v in params["layers"]["attn"].items()}
    return {**params, "layers": {**params["layers"], "attn": attn}}


# ----------------------------------------------------------------------------------------------------------
# the student's bias leaves

def test_init_has_zero_bias_leaves_of_the_documented_shapes_without_weight_decay():
    scfg = dba.DBAConfig.from_teacher(config(), sem_dim=4, geo_dim=6, v_dim=8)
    attn = dba.init(scfg)["layers"]["attn"]
    H, G, L = 4, 2, 2
    want = {"q_s_bias": H * 4, "q_g_bias": H * 6, "k_s_bias": G * 4, "k_g_bias": G * 6, "v_bias": G * 8}
    assert {k: tuple(v.shape) for k, v in attn.items() if k.endswith("_bias")} == {k: (L, w) for k, w in want.items()}
    assert all(not attn[k].any() for k in want)
    decays = decay_mask(dba.init(scfg))["layers"]["attn"]        # [L, width] leaves: "bias" in the name decides
    assert not any(decays[k] for k in want) and decays["wq_s"]
    plain = dba.init(dba.DBAConfig.from_teacher(config(qkv_bias=False), sem_dim=4, geo_dim=6, v_dim=8))
    assert not [k for k in plain["layers"]["attn"] if k.endswith("bias")]


def reference_attention(a: dict, x: torch.Tensor, cfg: dba.DBAConfig, positions: torch.Tensor) -> torch.Tensor:
    """One layer of DBA written out head by head: biases added, then RoPE on the geometric part, causal softmax."""
    H, G, T = cfg.n_heads, cfg.n_kv_heads, x.shape[0]
    cos, sin = dba.rope_tables(cfg, positions, x.dtype)                    # [L, G, T, geo]
    ys = []
    for h in range(H):
        g = h // (H // G)
        part = lambda w, b, i, n: x @ a[w][i * n:(i + 1) * n].mT + a[b][i * n:(i + 1) * n]   # noqa: E731
        q_s, k_s = part("wq_s", "q_s_bias", h, cfg.sem_dim), part("wk_s", "k_s_bias", g, cfg.sem_dim)
        q_g = llama.apply_rope(part("wq_g", "q_g_bias", h, cfg.geo_dim), cos[0, g], sin[0, g])
        k_g = llama.apply_rope(part("wk_g", "k_g_bias", g, cfg.geo_dim), cos[0, g], sin[0, g])
        v = part("wv", "v_bias", g, cfg.v_dim)
        score = q_s @ k_s.mT + q_g @ k_g.mT
        probs = score.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -torch.inf).softmax(-1)
        ys.append(probs @ v)
    return torch.cat(ys, -1) @ a["wo"].mT


def test_attention_adds_the_biases_before_rope_as_a_hand_written_reference():
    scfg = dba.DBAConfig.from_teacher(config(), sem_dim=4, geo_dim=6, v_dim=8)
    params = _cast(dba.init(scfg, seed=3), torch.float64)
    g = torch.Generator().manual_seed(4)
    a = {k: v[0] + (torch.randn(v[0].shape, generator=g, dtype=torch.float64) * 0.5 if k.endswith("_bias") else 0)
         for k, v in params["layers"]["attn"].items()}
    a = {k: v * 8 if k.startswith("wq") or k.startswith("wk") else v for k, v in a.items()}
    x = torch.randn(1, 12, 64, generator=g, dtype=torch.float64)
    cos, sin = dba.rope_tables(scfg, torch.arange(12), torch.float64)
    got = dba.attention(a, x, cos[0], sin[0], scfg)[0]
    assert max_abs_diff(got, reference_attention(a, x[0], scfg, torch.arange(12))) < 1e-10
    assert max_abs_diff(got, dba.attention(without_biases({"layers": {"attn": a}})["layers"]["attn"], x, cos[0],
                                           sin[0], scfg)[0]) > 1e-2


# ----------------------------------------------------------------------------------------------------------
# the surgery: exact at full rank, errors on the augmented matrices

@pytest.mark.parametrize("method", surgery.METHODS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float64, 1e-10)])
def test_all_geometric_full_rank_student_of_a_biased_teacher_has_its_logits(method, dtype, tol):
    """geo_dim = head_dim keeps every rotary pair: with the q/k/v biases folded in the student is the teacher
    (RoPE really rotates here); without them it is not."""
    cfg, tok = config(), tokens()
    params = teacher(cfg, dtype)
    student, scfg, report = surgery.surgery(params, cfg, CALIB, sem_dim=0, geo_dim=HD, v_dim=HD, method=method)
    want = llama.apply(params, tok, cfg)
    assert max_abs_diff(dba.apply(student, tok, scfg), want) < tol
    assert max_abs_diff(dba.apply(without_biases(student), tok, scfg), want) > 1e-3
    assert all(student["layers"]["attn"][k].dtype == dtype for k in STUDENT_BIASES)
    assert max(report["v_err"] + report["v_err_act"]) < 1e-6


@pytest.mark.parametrize("method", surgery.METHODS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float64, 1e-10)])
@pytest.mark.parametrize("geo_dim", [0, 6])
def test_semantic_path_with_biases_is_exact_at_full_rank(method, dtype, tol, geo_dim):
    """sem_dim = head_dim - geo_dim: the factorization of [W_q | b_q]^T [W_k | b_k] is exact, so on a teacher whose
    RoPE is the identity (the surgery drops RoPE from the dropped pairs, which is exact only then) the student's
    logits are the teacher's, biases and all; zeroing the student's biases is not."""
    cfg, tok = config(rope_scaling=NO_ROPE), tokens()
    params = teacher(cfg, dtype)
    student, scfg, report = surgery.surgery(params, cfg, CALIB, sem_dim=HD - geo_dim, geo_dim=geo_dim, v_dim=HD,
                                            method=method)
    want = llama.apply(params, tok, cfg)
    assert max_abs_diff(dba.apply(student, tok, scfg), want) < tol
    assert max_abs_diff(dba.apply(without_biases(student), tok, scfg), want) > 1e-3
    assert max(report["score_err"] + report["score_err_act"]) < 1e-6


def augmented_rows(w, b, rows):
    return torch.cat([w[rows], b[rows, None]], dim=-1).double()


@pytest.mark.parametrize("method", surgery.METHODS)
def test_reduced_rank_is_finite_and_its_score_error_is_of_the_augmented_matrices(method):
    """Below full rank the student is not exact but finite; the report's weight-metric score error is
    ||M' - A'^T B'|| / ||M'|| with M'_h = [Q_h | b_q,h]^T [K | b_k] over the dropped pairs, written out here."""
    cfg, tok = config(), tokens()
    params = teacher(cfg)
    student, scfg, report = surgery.surgery(params, cfg, CALIB, sem_dim=3, geo_dim=6, v_dim=8, method=method)
    logits = dba.apply(student, tok, scfg)
    assert torch.isfinite(logits).all() and max_abs_diff(logits, llama.apply(params, tok, cfg)) > 1e-3
    assert min(report["score_err"]) > 0 and min(report["score_err_act"]) > 0 and min(report["v_err"]) > 0
    t, s = params["layers"]["attn"], student["layers"]["attn"]
    for layer in range(cfg.n_layers):
        num = den = 0.0
        for h in range(cfg.n_heads):
            g = h // 2
            drop = [f for f in range(HD // 2) if f not in scfg.rope_pairs[layer][g]]
            dims = drop + [f + HD // 2 for f in drop]
            Q = augmented_rows(t["wq"][layer], t["q_bias"][layer], [h * HD + i for i in dims]) / math.sqrt(HD)
            K = augmented_rows(t["wk"][layer], t["k_bias"][layer], [g * HD + i for i in dims])
            A = augmented_rows(s["wq_s"][layer], s["q_s_bias"][layer], list(range(h * 3, h * 3 + 3)))
            B = augmented_rows(s["wk_s"][layer], s["k_s_bias"][layer], list(range(g * 3, g * 3 + 3)))
            num, den = num + (Q.mT @ K - A.mT @ B).square().sum(), den + (Q.mT @ K).square().sum()
        assert math.isclose(report["score_err"][layer], (num / den).sqrt().item(), rel_tol=1e-4)


def test_pair_scores_include_the_biases():
    cfg = config()
    params = teacher(cfg, torch.float64)
    x = surgery.calibration_inputs(params, cfg, CALIB)
    a = params["layers"]["attn"]
    q = (x @ a["wq"].mT + a["q_bias"][:, None]).unflatten(-1, (2, 2, 2, HD // 2))
    k = (x @ a["wk"].mT + a["k_bias"][:, None]).unflatten(-1, (2, 2, HD // 2))
    want = q.norm(dim=-2).mean(1).sum(2) * k.norm(dim=-2).mean(1)
    assert torch.allclose(surgery.pair_scores(params, cfg, x), want, rtol=1e-10)
    assert not torch.allclose(surgery.pair_scores(without_biases(params), cfg, x), want, rtol=1e-3)


def test_a_transformers_qwen2_folder_is_a_teacher(tmp_path):
    pytest.importorskip("transformers", reason="the reference implementation: pip install "
                                                              "purestep[reference]")
    pytest.importorskip("safetensors", reason="needs the 'hf' extra: pip install purestep[hf]")
    from purestep.models.loading import load_model
    from tests.hf_reference import random_qwen2
    model = random_qwen2()
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.config.qkv_bias
    tok = tokens()
    with torch.no_grad():
        want = model(tok).logits
    for method in surgery.METHODS:
        student, scfg, _ = surgery.surgery(loaded.params, loaded.config, CALIB, sem_dim=0, geo_dim=HD, v_dim=HD,
                                           method=method)
        assert max_abs_diff(dba.apply(student, tok, scfg), want) < 1e-4
        assert max_abs_diff(dba.apply(without_biases(student), tok, scfg), want) > 1e-3


# ----------------------------------------------------------------------------------------------------------
# the recipe end to end

def test_upcycle_a_biased_teacher_trains_the_student_biases(tmp_path, monkeypatch):
    """recipe=standard trains a tiny Qwen2-style teacher (model.qkv_bias=true); recipe=upcycle takes it through
    surgery, blockwise and global; the student checkpoints carry the bias leaves and blockwise moved them."""
    monkeypatch.setenv("PURESTEP_CACHE", str(tmp_path / "cache"))
    rnd = random.Random(0)
    words = [["the cat", "a dog", "my friend", "the teacher"], ["eats", "sees", "likes", "finds"],
             ["an apple", "the ball", "a red box", "some bread"], ["today", "slowly", "at night", "again"]]
    data = tmp_path / "text.txt"
    data.write_text("".join(" ".join(rnd.choice(w) for w in words) + ".\n" for _ in range(1500)))
    common = [f"data={data}", "block_size=32", "compile=false"]
    assert main(["recipe=standard", *common, f"out={tmp_path / 'teacher'}", "model.d_model=64", "model.n_layers=2",
                 "model.n_heads=4", "model.n_kv_heads=2", "model.qkv_bias=true", "batch_size=8", "steps=3",
                 "lr=3e-3", "warmup_steps=1", "eval_every=0", "sample_tokens=0"]) == 0
    out = tmp_path / "up"
    assert main(["recipe=upcycle", "preset=ci", *common, f"teacher={tmp_path / 'teacher'}", f"out={out}",
                 "sem_dim=2", "geo_dim=6", "v_dim=8", "phases=blockwise,global", "calib_tokens=128",
                 "eval_windows=2", "blockwise.steps=4", "blockwise.warmup_steps=1", "blockwise.log_every=2",
                 "global.steps=2", "global.warmup_steps=1", "global.eval_every=0", "global.log_every=1"]) == 0
    attn = {phase: ckpt.load(out / phase / "final.msgpack")["state"]["params"]["layers"]["attn"]
            for phase in ("surgery", "blockwise", "global")}
    for phase, leaves in attn.items():
        assert set(STUDENT_BIASES) <= set(leaves), phase
    assert attn["surgery"]["v_bias"].abs().max() > 0                 # the teacher's (trained) biases came along
    for name in STUDENT_BIASES:
        if attn["surgery"][name].numel():
            assert not torch.equal(attn["surgery"][name], attn["blockwise"][name]), name


# ----------------------------------------------------------------------------------------------------------
# blockwise: the teacher's block I/O has its biases, the student's blocks theirs

@pytest.mark.parametrize("match", ["block", "attention"])
def test_blockwise_targets_of_a_biased_teacher_line_up_with_an_exact_student(match):
    """teacher_io runs the teacher with its biases and the student's blocks run with theirs: an exact student has
    ~0 loss on every block (teacher-forced and sequential); with its biases zeroed it does not."""
    from purestep.models import blockwise
    cfg, tok = config(), tokens()
    params = teacher(cfg)
    student, scfg, _ = surgery.surgery(params, cfg, CALIB, sem_dim=0, geo_dim=HD, v_dim=HD)
    inputs, targets = blockwise.teacher_io(params, cfg, tok, match)
    for who, small in ((student, True), (without_biases(student), False)):
        per = blockwise.block_losses(inputs, blockwise.student_outputs(who, scfg, inputs, match), inputs, targets,
                                     "l1", match)
        s_in, s_out = blockwise.student_stream(who, scfg, tok, match)
        seq = blockwise.block_losses(s_in, s_out, inputs, targets, "l1", match)
        assert ((per < 1e-5) & (seq < 1e-5) if small else (per > 1e-3)).all(), (small, per, seq)
