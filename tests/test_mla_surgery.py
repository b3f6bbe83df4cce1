"""models/mla_surgery.py: a Llama teacher -> an MLA-form student (DeepSeek-V2's layout), checked numerically against
the teacher through a written-out MLA forward (tests/mla_reference.py) and against hand-built baselines."""
import dataclasses
import json
import random

import pytest
import torch

from purestep.core.io import checkpoint as ckpt
from purestep.models import llama, mla, mla_surgery as ms
from purestep.models.loading import load_model
from purestep.recipes import main
from tests.mla_reference import RefConfig, apply as mla_apply


def teacher(G=2, H=4, hd=16, d=32, L=2, seed=0):
    cfg = llama.LlamaConfig(vocab_size=61, d_model=d, n_layers=L, n_heads=H, n_kv_heads=G, head_dim=hd)
    return llama.init(cfg, seed, torch.float64), cfg


TOKENS = torch.randint(0, 61, (4, 24), generator=torch.Generator().manual_seed(1))


def student_logits(student, cfg, dims, norm=True):
    return mla_apply(student, TOKENS, RefConfig.from_teacher(cfg, latent_norm=norm, **dims))


def test_layout_matches_the_mla_format():
    params, cfg = teacher()
    student, dims, report = ms.surgery(params, cfg, TOKENS, kv_lora_rank=10, qk_rope_head_dim=4)
    assert dims == {"kv_lora_rank": 10, "qk_rope_head_dim": 4, "qk_nope_head_dim": 12, "v_head_dim": 16}
    a = student["layers"]["attn"]
    assert {k: tuple(v.shape) for k, v in a.items()} == {
        "wq": (2, 4 * 16, 32), "wkv_a": (2, 10 + 4, 32), "kv_norm": (2, 10), "wkv_b": (2, 4 * (12 + 16), 10),
        "wo": (2, 32, 4 * 16)}
    assert report["kept_pairs"] == [0, 4]              # every s-th teacher pair, s = (16/2) / (4/2)
    for k in ("embed", "norm"):
        assert torch.equal(student[k], params[k])
    assert torch.equal(student["layers"]["mlp"]["w_gate"], params["layers"]["mlp"]["w_gate"])
    # query heads of one KV group share their up-projection rows
    b = a["wkv_b"].view(2, 2, 2, 28, 10)
    assert torch.equal(b[:, :, 0], b[:, :, 1])


@pytest.mark.parametrize("method", ["svd", "asvd"])
def test_full_rank_linear_part_is_exact(method):
    """G = 1, d_r = head_dim, r = the latent's full rank: without the latent's RMSNorm the student is the teacher
    (the norm's per-token 1/rms(c) is not linear, so with it only rms-steady latents are exact: next test)."""
    params, cfg = teacher(G=1, H=2)
    student, dims, report = ms.surgery(params, cfg, TOKENS, kv_lora_rank=16, qk_rope_head_dim=16, method=method)
    torch.testing.assert_close(student_logits(student, cfg, dims, norm=False), llama.apply(params, TOKENS, cfg),
                               rtol=0, atol=1e-8)
    assert max(report["k_err_act"] + report["v_err_act"] + report["latent_err"]) < 1e-9
    assert report["rope_kept"] == pytest.approx([1.0, 1.0], abs=1e-12)
    # GQA with partial RoPE: the latent still reproduces keys and values exactly at r = G (m + hd)
    params, cfg = teacher(G=2, H=4, d=64)
    _, _, report = ms.surgery(params, cfg, TOKENS, kv_lora_rank=2 * (12 + 16), qk_rope_head_dim=4, method=method)
    assert max(report["k_err_act"] + report["v_err_act"]) < 1e-8


def test_norm_is_exact_for_a_steady_latent_and_rho_is_least_squares():
    """With every calibration latent of one rms the norm is a constant factor that kv_norm = rho undoes. A teacher
    with attention-norm weight one (so |x| = sqrt(d), eps ~ 0) and r = d: the latent is an invertible map of x, the
    steady basis finds the quadratic form that makes rms(c) constant (up to its ridge, 1e-3 of the kernel's
    diagonal: steady_basis alone is exact to 1e-6 without it, next test), and the student with the norm is the
    teacher to 1e-4; with unit channel mean squares instead (steady=False) it is off by more than 1e-3."""
    params, cfg = teacher(G=1, H=1, hd=16, d=16)
    cfg = dataclasses.replace(cfg, norm_eps=1e-30)
    params["layers"]["attn_norm"] = torch.ones_like(params["layers"]["attn_norm"])
    t = llama.apply(params, TOKENS, cfg)
    student, dims, _ = ms.surgery(params, cfg, TOKENS, kv_lora_rank=16, qk_rope_head_dim=16)
    torch.testing.assert_close(student_logits(student, cfg, dims), t, rtol=0, atol=1e-4)
    student, dims, _ = ms.surgery(params, cfg, TOKENS, kv_lora_rank=16, qk_rope_head_dim=16, steady=False)
    assert (student_logits(student, cfg, dims) - t).abs().max() > 1e-3
    # below: rho minimises sum_t w_t (1 - rho / rms_t)^2, so nudging it either way costs
    c = torch.randn(2, 50, 6, dtype=torch.float64) * torch.rand(2, 50, 1, dtype=torch.float64)
    LB = torch.randn(2, 9, 6, dtype=torch.float64)
    rho, inv = ms.norm_scale(LB, c, 1e-6)
    w = (c @ LB.mT).square().sum(-1)
    cost = lambda r: (w * (1 - r[:, None] * inv).square()).sum(1)   # noqa: E731
    assert (cost(rho * 1.01) > cost(rho)).all() and (cost(rho * 0.99) > cost(rho)).all()


def test_steady_basis_steadies_the_rms():
    """steady_basis: latents c = M q with |q| constant (an invertible M) get a T with |T c| constant (T^2 ~ the
    inverse of M M^T, up to scale); for noisy ones |T c| varies less than |c|. The surgery's linear part does not
    change with it (wkv_b takes T^-1)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 200, 6, generator=g, dtype=torch.float64)
    q = q / q.norm(dim=-1, keepdim=True)
    c = q @ torch.randn(2, 6, 6, generator=g, dtype=torch.float64)
    spread = lambda c: c.square().sum(-1).std(1) / c.square().sum(-1).mean(1)   # noqa: E731
    assert spread(c @ ms.steady_basis(c, ridge=1e-12)).max() < 1e-6 < spread(c).min()
    noisy = torch.randn(2, 300, 6, generator=g, dtype=torch.float64) * torch.tensor([3.0, 1, 1, 0.5, 0.2, 2])
    assert (spread(noisy @ ms.steady_basis(noisy)) < spread(noisy)).all()
    params, cfg = teacher()
    plain = ms.surgery(params, cfg, TOKENS, kv_lora_rank=12, qk_rope_head_dim=4, steady=False)[2]
    steady = ms.surgery(params, cfg, TOKENS, kv_lora_rank=12, qk_rope_head_dim=4)[2]
    assert steady["k_err_act"] == pytest.approx(plain["k_err_act"], abs=1e-9)
    assert steady["v_err_act"] == pytest.approx(plain["v_err_act"], abs=1e-9)
    assert sum(steady["v_err_act_norm"]) < sum(plain["v_err_act_norm"])


def test_below_full_rank_no_worse_than_plain_svd():
    """At rank r the whitened joint factorization's calibration error on [K_nope; V] (equal weights, the reported
    latent_err) is at most that of plain weight-SVD's latent on the same calibration inputs (Eckart-Young in the
    whitened metric), and the plain SVD's own latent_err is its weight-metric optimum."""
    params, cfg = teacher()
    for rank in (6, 12, 30):
        asvd = ms.surgery(params, cfg, TOKENS, kv_lora_rank=rank, qk_rope_head_dim=4, latent_weight="equal")[2]
        plain = _act_error(params, cfg, rank)
        assert all(a <= b + 1e-6 for a, b in zip(asvd["latent_err"], plain))


def _act_error(params, cfg, rank):
    """The relative calibration error of the stacked [K_nope; V] for plain weight-SVD's rank-``rank`` latent."""
    from purestep.models.surgery import calibration_inputs, teacher_weights
    x = calibration_inputs(params, cfg, TOKENS).double()
    _, Wk, Wv = teacher_weights(params["layers"]["attn"], cfg, torch.device("cpu"))
    nope = torch.tensor([1, 2, 3, 5, 6, 7]); nope = torch.cat([nope, nope + 8])
    Y = torch.cat([Wk[:, :, nope].flatten(1, 2), Wv.flatten(1, 2)], dim=1)
    B, A, _ = ms.factorize_latent(Y, rank, None, None, x)
    Yx = x @ Y.mT
    return ms.reconstruction_error(Yx, x @ A.mT @ B.mT).tolist()


def test_rope_pca_exact_for_one_head_and_better_than_head_zero():
    params, cfg = teacher(G=1, H=2)
    assert ms.surgery(params, cfg, TOKENS, kv_lora_rank=8, qk_rope_head_dim=4)[2]["rope_kept"] == \
        pytest.approx([1.0, 1.0], abs=1e-12)
    params, cfg = teacher(G=4, H=4, d=32)
    from purestep.models.surgery import calibration_inputs, teacher_weights
    x = calibration_inputs(params, cfg, TOKENS).double()
    gram = x.mT @ x
    Wq, Wk, _ = teacher_weights(params["layers"]["attn"], cfg, torch.device("cpu"))
    rope_dims = torch.tensor([0, 4, 8, 12])
    Qp, Kp = ms.pair_view(Wq, rope_dims), ms.pair_view(Wk, rope_dims)
    U0 = ms.rope_mixing(Kp, gram)
    pca = ms.rope_energy_kept(Qp, Kp, U0, torch.einsum("lpg,lgpcd->lpcd", U0, Kp), gram)
    head0 = ms.rope_energy_kept(Qp, Kp, torch.ones_like(U0), Kp[:, 0], gram)
    assert (pca > head0).all() and (pca < 1).all()
    # the mixing commutes with RoPE: a rotated pair's energy is kept alike (the score's rotation-averaged form)
    assert torch.allclose(U0.square().sum(-1), torch.ones_like(U0[..., 0]))


def test_dims_for_reduction_and_bad_input():
    assert [ms.dims_for_reduction(3, 64, r) for r in (2, 4, 8)] == [(32, 160), (16, 80), (8, 40)]   # SmolLM2
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        ms.kept_pairs(16, 6)
    params, cfg = teacher()
    with pytest.raises(ValueError, match="kv_lora_rank"):
        ms.surgery(params, cfg, TOKENS, kv_lora_rank=57, qk_rope_head_dim=4)
    with pytest.raises(ValueError, match="latent_weight"):
        ms.surgery(params, cfg, TOKENS, kv_lora_rank=8, qk_rope_head_dim=4, latent_weight="x")


def test_reference_forward_is_models_mla():
    """The written-out forward these tests judge the surgery by is models.mla's (the student the recipe runs)."""
    params, cfg = teacher()
    student, dims, _ = ms.surgery(params, cfg, TOKENS, kv_lora_rank=10, qk_rope_head_dim=4)
    torch.testing.assert_close(mla.apply(student, TOKENS, mla.MLAConfig.from_teacher(cfg, **dims)),
                               student_logits(student, cfg, dims), rtol=0, atol=1e-10)


# ----------------------------------------------------------------------------------------------------------
# recipe=upcycle student=mla

def test_upcycle_student_mla_runs_surgery_blockwise_global_verify(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PURESTEP_CACHE", str(tmp_path / "cache"))
    rnd = random.Random(0)
    words = [["the cat", "a dog", "my friend", "the teacher"], ["eats", "sees", "likes", "finds"],
             ["an apple", "the ball", "a red box", "some bread"], ["today", "slowly", "at night", "again"]]
    data = tmp_path / "text.txt"
    data.write_text("".join(" ".join(rnd.choice(w) for w in words) + ".\n" for _ in range(1500)))
    common = [f"data={data}", "block_size=32", "compile=false"]
    assert main(["recipe=standard", *common, f"out={tmp_path / 'teacher'}", "model.d_model=64", "model.n_layers=2",
                 "model.n_heads=4", "model.n_kv_heads=2", "batch_size=8", "steps=3", "lr=3e-3", "warmup_steps=1",
                 "eval_every=0", "sample_tokens=0"]) == 0
    out = tmp_path / "up"
    args = ["recipe=upcycle", "preset=ci", *common, f"teacher={tmp_path / 'teacher'}", f"out={out}", "student=mla",
            "kv_reduction=4", "phases=blockwise,global,verify", "calib_tokens=128", "eval_windows=2",
            "blockwise.steps=4", "blockwise.warmup_steps=1", "blockwise.log_every=2", "global.steps=2",
            "global.warmup_steps=1", "global.eval_every=0", "global.log_every=1"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "kv_lora_rank=" in err and "4.00x smaller" in err                     # 2 KV heads x 16: 64 -> 16
    attn = {phase: ckpt.load(out / phase / "final.msgpack")["state"]["params"]["layers"]["attn"]
            for phase in ("surgery", "blockwise", "global")}
    assert set(attn["surgery"]) == {"wq", "wkv_a", "kv_norm", "wkv_b", "wo"}
    assert not torch.equal(attn["surgery"]["wkv_a"], attn["blockwise"]["wkv_a"])   # blockwise trained it
    loaded = load_model(str(out / "global"))
    assert loaded.arch == "mla" and loaded.module is mla
    assert loaded.config.kv_lora_rank + loaded.config.qk_rope_head_dim == 16
    report = json.loads((out / "surgery" / "report.json").read_text())
    assert report["kv_bytes_per_token"]["ratio"] == 4 and len(report["rope_kept"]) == 2
    assert json.loads((out / "verify" / "report.json").read_text())["passed"]
    # keys of the other student are refused by name
    assert main([*args, "geo_dim=4"]) == 2 and "'geo_dim' for student=mla" in capsys.readouterr().err
    assert main([*args[:-12], "student=dba", "qk_rope_head_dim=4"]) == 2
