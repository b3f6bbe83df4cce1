"""A per-layer KV budget for the MLA student (models/kv_budget.py, MLAConfig.kv_ranks, recipe=upcycle kv_budget=):
CARE's greedy against a hand greedy, the surgery's padded latent (exact zeros that training keeps, the folded norm
against a model built at the live width) and the key's refusals."""
import math
import random

import torch

from purestep import optim
from purestep.core.state import init_state
from purestep.core.step import make_train_step
from purestep.models import kv_budget, llama, mla, mla_surgery as ms
from purestep.models.loading import load_model
from purestep.recipes import main

TOKENS = torch.randint(0, 61, (4, 24), generator=torch.Generator().manual_seed(1))


def teacher(L=3, seed=0):
    cfg = llama.LlamaConfig(vocab_size=61, d_model=32, n_layers=L, n_heads=4, n_kv_heads=2, head_dim=16)
    return llama.init(cfg, seed, torch.float64), cfg


def test_allocation_is_the_hand_greedy():
    sq = torch.tensor([[9.0, 5.0, 1.0, 0.5], [8.0, 7.0, 6.0, 0.1], [3.0, 2.0, 2.0, 2.0]])
    # from 1 each, the next values are 5 / 7 / 2: units go to layer 1 (7), layer 1 (6), layer 0 (5), then layer 2's
    # 2, 2, 2 (layer 1's next is 0.1, layer 0's 1), then layer 0's 1
    assert kv_budget.allocate(sq, 3) == [1, 1, 1]
    assert kv_budget.allocate(sq, 5) == [1, 3, 1]
    assert kv_budget.allocate(sq, 6) == [2, 3, 1]
    assert kv_budget.allocate(sq, 9) == [2, 3, 4]
    assert kv_budget.allocate(sq, 10) == [3, 3, 4]
    assert kv_budget.allocate(torch.ones(2, 3), 3) == [2, 1]        # ties go to the lower layer
    assert kv_budget.allocate(sq, 6, minimum=2) == [2, 2, 2]
    for bad in (2, 13):
        try:
            kv_budget.allocate(sq, bad)
            raise AssertionError(bad)
        except ValueError as e:
            assert "latent dims over 3 layers" in str(e)


def budget_student(total=20, L=3):
    params, cfg = teacher(L)
    student, dims, report = ms.surgery(params, cfg, TOKENS, latent_total=total, qk_rope_head_dim=4)
    return student, mla.MLAConfig.from_teacher(cfg, **dims), report


def test_surgery_spends_the_budget_with_exact_zero_padding():
    student, scfg, report = budget_student()
    ranks = list(scfg.kv_ranks)
    assert sum(ranks) == 20 and len(set(ranks)) > 1 and scfg.kv_lora_rank == max(ranks)
    assert report["kv_ranks"] == tuple(ranks)
    assert mla.kv_bytes_per_token(scfg) == 2 * (20 + 3 * 4) and kv_budget.budget_latent_total(64, 3, 4) == 20
    a = student["layers"]["attn"]
    for l, r in enumerate(ranks):
        assert torch.all(a["wkv_a"][l, r:scfg.kv_lora_rank] == 0) and torch.all(a["kv_norm"][l, r:] == 0)
        assert torch.all(a["wkv_b"][l, :, r:] == 0) and a["wkv_a"][l, :r].abs().amin(-1).gt(0).all()
    # the forward's RMSNorm over the padded width is rho times RMSNorm over the live dims (sqrt(r/R) folded in)
    x = 100 * torch.randn(7, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for l, r in enumerate(ranks):
        c = x @ a["wkv_a"][l, :scfg.kv_lora_rank].T
        padded = llama.rms_norm(c, a["kv_norm"][l], mla.KV_NORM_EPS)
        live = c[:, :r] * torch.rsqrt(c[:, :r].square().mean(-1, keepdim=True)) * report["kv_norm"][l]
        torch.testing.assert_close(padded[:, :r], live, rtol=1e-9, atol=1e-12)
        assert torch.all(padded[:, r:] == 0)
    # the greedy on the surgery's own spectrum: a larger budget never takes a rank away from a layer
    more = budget_student(26)[1].kv_ranks
    assert all(b >= a_ for a_, b in zip(ranks, more)) and sum(more) == 26


def test_padded_latent_stays_zero_under_adamw_with_the_real_loss():
    student, scfg, _ = budget_student()
    params = {k: v.float() if not isinstance(v, dict) else {kk: (vv.float() if not isinstance(vv, dict) else
              {n: t.float() for n, t in vv.items()}) for kk, vv in v.items()} for k, v in student.items()}
    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    step = make_train_step(lambda p, b: mla.loss(p, b, scfg), opt)
    grads = torch.func.grad(lambda p: mla.loss(p, {"x": TOKENS[:, :-1], "y": TOKENS[:, 1:]}, scfg))(params)
    state = init_state(params, opt)
    for i in range(3):
        state, _ = step(state, {"x": TOKENS[:, :-1], "y": TOKENS[:, 1:]})
    a, g, before = state.params["layers"]["attn"], grads["layers"]["attn"], params["layers"]["attn"]
    for l, r in enumerate(scfg.kv_ranks):
        assert torch.all(g["wkv_a"][l, r:scfg.kv_lora_rank] == 0) and torch.all(g["wkv_b"][l, :, r:] == 0)
        assert torch.all(g["kv_norm"][l, r:] == 0)
        assert torch.all(a["wkv_a"][l, r:scfg.kv_lora_rank] == 0) and torch.all(a["wkv_b"][l, :, r:] == 0)
        assert torch.all(a["kv_norm"][l, r:] == 0)
        assert not torch.equal(a["wkv_a"][l, :r], before["wkv_a"][l, :r])        # the live rows did train


def test_padded_model_equals_the_model_at_the_live_width():
    """Every layer at live width r = 5, stored at R = 8 with sqrt(r/R) folded into kv_norm: the same logits as the
    kv_lora_rank = 5 model in fp32 (the eps term moves by e (R/r - 1) / mean(c^2): latents of mean square ~ 10^2
    keep that under 1e-8)."""
    L, r, R = 2, 5, 8
    live_cfg = mla.MLAConfig(vocab_size=61, d_model=32, n_layers=L, n_heads=4, n_kv_heads=2, head_dim=8,
                             kv_lora_rank=r, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)
    live = mla.init(live_cfg, seed=3)
    live["layers"]["attn"]["wkv_a"][:, :r] *= 500
    live["layers"]["attn"]["kv_norm"] = torch.rand(L, r, generator=torch.Generator().manual_seed(4)) + 0.5
    pad_cfg = mla.MLAConfig(**{**live_cfg.__dict__, "kv_lora_rank": R, "kv_ranks": (r,) * L})
    a = live["layers"]["attn"]
    wkv_a = torch.cat([a["wkv_a"][:, :r], torch.zeros(L, R - r, 32), a["wkv_a"][:, r:]], dim=1)
    kv_norm = torch.cat([a["kv_norm"] * math.sqrt(r / R), torch.zeros(L, R - r)], dim=1)
    wkv_b = torch.cat([a["wkv_b"], torch.zeros(L, a["wkv_b"].shape[1], R - r)], dim=2)
    padded = {**live, "layers": {**live["layers"], "attn": {**a, "wkv_a": wkv_a, "kv_norm": kv_norm, "wkv_b": wkv_b}}}
    want = mla.apply(live, TOKENS, live_cfg)
    torch.testing.assert_close(mla.apply(padded, TOKENS, pad_cfg), want, atol=1e-6, rtol=1e-6)
    assert mla.kv_bytes_per_token(pad_cfg) == mla.kv_bytes_per_token(live_cfg) == 2 * L * (r + 4)
    try:
        mla.MLAConfig(**{**live_cfg.__dict__, "kv_ranks": (6, 5)})
        raise AssertionError("a live rank above kv_lora_rank")
    except ValueError as e:
        assert "kv_ranks=(6, 5)" in str(e)


def test_kv_budget_key_and_its_refusals(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PURESTEP_CACHE", str(tmp_path / "cache"))
    rnd = random.Random(0)
    words = [["the cat", "a dog", "my friend"], ["eats", "sees", "likes"], ["an apple", "the ball", "a red box"]]
    data = tmp_path / "text.txt"
    data.write_text("".join(" ".join(rnd.choice(w) for w in words) + ".\n" for _ in range(800)))
    common = [f"data={data}", "block_size=32", "compile=false"]
    assert main(["recipe=standard", *common, f"out={tmp_path / 'teacher'}", "model.d_model=64", "model.n_layers=2",
                 "model.n_heads=4", "model.n_kv_heads=2", "batch_size=8", "steps=1", "warmup_steps=1",
                 "eval_every=0", "sample_tokens=0"]) == 0
    # teacher: 2 layers x 2 KV heads x 16 x 2 (k, v) = 128 values, 256 B; kv_reduction=4 -> qk_rope_head_dim 2
    args = ["recipe=upcycle", "preset=ci", *common, f"teacher={tmp_path / 'teacher'}", "student=mla",
            "kv_reduction=4", "phases=verify", "calib_tokens=128", "eval_windows=2", "verify.max_ppl_ratio=1e9"]
    assert main([*args, f"out={tmp_path / 'up'}", "kv_budget=64"]) == 0
    err = capsys.readouterr().err
    assert "kv_budget=64 B: 28 latent dims over 2 layers" in err and "4.00x smaller" in err
    assert "per-layer latent ranks (CARE's greedy)" in err
    loaded = load_model(str(tmp_path / "up" / "surgery"))       # the student's config, kv_ranks too, read back
    assert isinstance(loaded.config, mla.MLAConfig) and sum(loaded.config.kv_ranks) == 28
    assert mla.kv_bytes_per_token(loaded.config) == 64
    for extra, message in [(["kv_budget=4"], "kv_budget=4 does not fit this teacher: need 12 <= kv_budget <= 248"),
                           (["kv_budget=250"], "kv_budget=250 does not fit"),
                           (["kv_budget=63"], "'kv_budget': 63 bytes is not a whole number"),
                           (["kv_budget=64", "kv_lora_rank=8"], "bad key 'kv_lora_rank' with kv_budget=64"),
                           (["kv_budget=64", "student=dba"], "bad key 'kv_budget' for student=dba")]:
        assert main([*args, f"out={tmp_path / 'bad'}", *extra]) == 2
        assert message in capsys.readouterr().err
