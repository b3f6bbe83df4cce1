"""A per-layer KV budget for both student forms (models/kv_budget.py, MLAConfig.kv_ranks, DBAConfig.sem_dims/v_dims,
recipe=upcycle kv_budget=): CARE's greedy against a hand greedy, the MLA surgery's padded latent (exact zeros that
training keeps, the folded norm against a model built at the live width), the DBA surgery's padded heads (against
students built layer by layer at the chosen widths, spectra recomputed by explicit SVDs, the HF export) and the key's
refusals."""
import math
import random

import pytest
import torch

from purestep import optim
from purestep.core.state import init_state
from purestep.core.step import make_train_step
from purestep.models import dba, kv_budget, llama, mla, mla_surgery as ms, surgery
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


def tiny_run(tmp_path, monkeypatch) -> list:
    """A two-layer teacher (2 KV heads x head_dim 16) trained one step on a tiny corpus; the shared arguments."""
    monkeypatch.setenv("PURESTEP_CACHE", str(tmp_path / "cache"))
    rnd = random.Random(0)
    words = [["the cat", "a dog", "my friend"], ["eats", "sees", "likes"], ["an apple", "the ball", "a red box"]]
    data = tmp_path / "text.txt"
    data.write_text("".join(" ".join(rnd.choice(w) for w in words) + ".\n" for _ in range(800)))
    common = [f"data={data}", "block_size=32", "compile=false"]
    assert main(["recipe=standard", *common, f"out={tmp_path / 'teacher'}", "model.d_model=64", "model.n_layers=2",
                 "model.n_heads=4", "model.n_kv_heads=2", "batch_size=8", "steps=1", "warmup_steps=1",
                 "eval_every=0", "sample_tokens=0"]) == 0
    return common


def upcycle_args(tmp_path, common, student: str) -> list:
    """The upcycle recipe's surgery and verify on :func:`tiny_run`'s teacher at 4x, for ``student``."""
    return ["recipe=upcycle", "preset=ci", *common, f"teacher={tmp_path / 'teacher'}", f"student={student}",
            "kv_reduction=4", "phases=verify", "calib_tokens=128", "eval_windows=2", "verify.max_ppl_ratio=1e9"]


def test_kv_budget_key_and_its_refusals(tmp_path, monkeypatch, capsys):
    common = tiny_run(tmp_path, monkeypatch)
    # teacher: 2 layers x 2 KV heads x 16 x 2 (k, v) = 128 values, 256 B; kv_reduction=4 -> qk_rope_head_dim 2
    args = upcycle_args(tmp_path, common, "mla")
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
                           (["kv_budget=64", "kv_lora_rank=8"], "bad key 'kv_lora_rank' with kv_budget=64")]:
        assert main([*args, f"out={tmp_path / 'bad'}", *extra]) == 2
        assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------
# the per-head (DBA) student

def test_pair_allocation_is_the_hand_greedy_over_both_spectra():
    key_sq = torch.tensor([[6.0, 3.0, 1.0], [2.0, 1.5, 0.0]])        # layer shares .6 .3 .1 / .571 .429 0
    value_sq = torch.tensor([[40.0, 10.0], [100.0, 50.0]])          # .8 .2 / .667 .333
    # from (key, value) = (0, 1) in each layer the next shares are k0 .6, v0 .2, k1 .571, v1 .333: the units go to
    # k0, k1, k1 (.429), v1, k0 (.3), v0, k0 (.1), k1 (0)
    want = {2: ([0, 0], [1, 1]), 3: ([1, 0], [1, 1]), 4: ([1, 1], [1, 1]), 5: ([1, 2], [1, 1]), 6: ([1, 2], [1, 2]),
            7: ([2, 2], [1, 2]), 8: ([2, 2], [2, 2]), 9: ([3, 2], [2, 2]), 10: ([3, 3], [2, 2])}
    for total, ranks in want.items():
        assert kv_budget.allocate_pair(key_sq, value_sq, total) == ranks
        # each spectrum is a share of its own layer's total: a layer's scale (or a kind's units) does not matter
        scale = torch.tensor([[1.0], [1e3]])
        assert kv_budget.allocate_pair(key_sq * scale, value_sq * 7, total) == ranks
    # raw squared singular values would give the third unit to v1 (50 > 6): the shares put the kinds on one scale
    assert kv_budget.greedy([[6, 3, 1], [40, 10], [2, 1.5, 0], [100, 50]], [0, 1, 0, 1], 3) == [0, 1, 0, 2]
    assert kv_budget.allocate_pair(key_sq, value_sq, 4, key_minimum=1) == ([1, 1], [1, 1])
    for bad in (1, 11):
        with pytest.raises(ValueError, match="key \\+ value dims over 2 layers"):
            kv_budget.allocate_pair(key_sq, value_sq, bad)


def dba_budget_student(total, L=3, geo_dim=8):
    params, cfg = teacher(L)
    student, scfg, report = surgery.surgery(params, cfg, TOKENS, geo_dim=geo_dim, dims_total=total)
    return params, cfg, student, scfg, report


def padded_layer(attn: dict, l: int, cfg, width: dict) -> dict:
    """Layer ``l``'s attention leaves of a uniform surgery, each head's slice zero-padded to ``width``."""
    H, G, d = cfg.n_heads, cfg.n_kv_heads, cfg.d_model
    heads = {"wq_s": (H, "sem"), "wk_s": (G, "sem"), "wq_g": (H, "geo"), "wk_g": (G, "geo"), "wv": (G, "v")}
    out = {}
    for name, (n, kind) in heads.items():
        w = attn[name][l].view(n, -1, d)
        out[name] = torch.nn.functional.pad(w, (0, 0, 0, width[kind] - w.shape[1])).reshape(-1, d)
    wo = attn["wo"][l].view(d, H, -1)
    out["wo"] = torch.nn.functional.pad(wo, (0, width["v"] - wo.shape[2])).reshape(d, -1)
    return out


def test_dba_budget_is_the_students_built_at_those_widths():
    """Each layer of the budgeted student is the layer a uniform surgery at its (sem_dim, v_dim) builds, zero-padded
    to the stacked widths: the same logits, dead rows/columns exactly zero, bytes per token = the budget."""
    params, cfg, student, scfg, report = dba_budget_student(30)
    sems, vs = list(scfg.sem_dims), list(scfg.v_dims)
    assert sum(sems) + sum(vs) == 30 and len(set(zip(sems, vs))) > 1
    assert (scfg.sem_dim, scfg.v_dim) == (max(sems), max(vs)) and report["sem_dims"] == tuple(sems)
    kv = 2 * cfg.n_kv_heads * (30 + 3 * 8)
    assert dba.kv_bytes_per_token(scfg) == kv and kv_budget.budget_dba_total(kv, 3, 2, 8) == 30
    width, by_hand = {"sem": scfg.sem_dim, "geo": 8, "v": scfg.v_dim}, []
    for l, (s, v) in enumerate(zip(sems, vs)):
        layer, lcfg, _ = surgery.surgery(params, cfg, TOKENS, sem_dim=s, geo_dim=8, v_dim=v)
        assert lcfg.rope_pairs == scfg.rope_pairs
        by_hand.append(padded_layer(layer["layers"]["attn"], l, cfg, width))
    attn = student["layers"]["attn"]
    for name, leaf in attn.items():
        torch.testing.assert_close(leaf, torch.stack([b[name] for b in by_hand]), rtol=1e-9, atol=1e-12)
    for l, (s, v) in enumerate(zip(sems, vs)):
        assert torch.all(attn["wk_s"][l].view(2, scfg.sem_dim, -1)[:, s:] == 0)
        assert torch.all(attn["wq_s"][l].view(4, scfg.sem_dim, -1)[:, s:] == 0)
        assert torch.all(attn["wv"][l].view(2, scfg.v_dim, -1)[:, v:] == 0)
        assert torch.all(attn["wo"][l].view(32, 4, scfg.v_dim)[..., v:] == 0)
    hand = {**student, "layers": {**student["layers"], "attn": {k: torch.stack([b[k] for b in by_hand])
                                                              for k in attn}}}
    torch.testing.assert_close(dba.apply(student, TOKENS, scfg), dba.apply(hand, TOKENS, scfg), rtol=0, atol=1e-12)


def test_dba_budget_spectra_are_the_explicit_svds():
    """The widths are allocate_pair over spectra recomputed here by explicit SVDs: per layer, the whitened stacked
    no-RoPE scores [W^T Q_h^T K W]_h of each KV head and W_v W, squared singular values summed over the KV heads."""
    params, cfg, _, scfg, _ = dba_budget_student(30)
    x = surgery.calibration_inputs(params, cfg, TOKENS).double()
    W = surgery.whitening(x.mT @ x)
    Wq, Wk, Wv = surgery.teacher_weights(params["layers"]["attn"], cfg, torch.device("cpu"))
    keys, values = [], []
    for l in range(3):
        key_l, value_l = 0, 0
        for g in range(2):
            kept = set(scfg.rope_pairs[l][g])
            drop = [f for f in range(8) if f not in kept]
            dims = drop + [f + 8 for f in drop]
            S = torch.cat([W[l].mT @ Wq[l, g, h][dims].mT @ Wk[l, g][dims] @ W[l] for h in range(2)])
            key_l = key_l + torch.linalg.svdvals(S)[:8].square()
            value_l = value_l + torch.linalg.svdvals(Wv[l, g] @ W[l]).square()
        keys.append(key_l)
        values.append(value_l)
    want = kv_budget.allocate_pair(torch.stack(keys), torch.stack(values), 30)
    assert (list(scfg.sem_dims), list(scfg.v_dims)) == want


def test_dba_full_budget_is_the_teacher():
    """geo_dim = head_dim and the teacher's own bytes: every layer keeps all of its value dims, the logits are the
    teacher's."""
    params, cfg, student, scfg, _ = dba_budget_student(3 * 16, geo_dim=16)
    assert scfg.sem_dims == (0, 0, 0) and scfg.v_dims == (16, 16, 16)
    assert dba.kv_bytes_per_token(scfg) == llama.kv_bytes_per_token(cfg)
    torch.testing.assert_close(dba.apply(student, TOKENS, scfg), llama.apply(params, TOKENS, cfg), rtol=0, atol=1e-9)


def test_dba_padded_dims_stay_zero_under_adamw():
    _, _, student, scfg, _ = dba_budget_student(30)
    params = {"embed": student["embed"], "norm": student["norm"], "layers": student["layers"]}
    batch = {"x": TOKENS[:, :-1], "y": TOKENS[:, 1:]}
    grads = torch.func.grad(lambda p: dba.loss(p, batch, scfg))(params)["layers"]["attn"]
    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    state = init_state(params, opt)
    step = make_train_step(lambda p, b: dba.loss(p, b, scfg), opt)
    for _ in range(3):
        state, _ = step(state, batch)
    a = state.params["layers"]["attn"]
    for l, (s, v) in enumerate(zip(scfg.sem_dims, scfg.v_dims)):
        for tree in (grads, a):
            assert torch.all(tree["wq_s"][l].view(4, scfg.sem_dim, -1)[:, s:] == 0)
            assert torch.all(tree["wk_s"][l].view(2, scfg.sem_dim, -1)[:, s:] == 0)
            assert torch.all(tree["wv"][l].view(2, scfg.v_dim, -1)[:, v:] == 0)
            assert torch.all(tree["wo"][l].view(32, 4, scfg.v_dim)[..., v:] == 0)
        assert not torch.equal(a["wv"][l], student["layers"]["attn"]["wv"][l])


def test_dba_budget_student_exports_to_hf(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the reference implementation: pip install "
                                       "purestep[reference]")
    pytest.importorskip("safetensors.torch", reason="needs the 'hf' extra: pip install purestep[hf]")
    from purestep.models.dba_hf import export_dba_hf
    _, _, student, scfg, _ = dba_budget_student(30)
    student = {k: v.float() if torch.is_tensor(v) else {kk: (vv.float() if torch.is_tensor(vv) else
               {n: t.float() for n, t in vv.items()}) for kk, vv in v.items()} for k, v in student.items()}
    export_dba_hf(student, scfg, tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    with torch.no_grad():
        theirs, ours = model(TOKENS).logits, dba.apply(student, TOKENS, scfg)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)


def test_dba_kv_budget_through_the_recipe(tmp_path, monkeypatch, capsys):
    common = tiny_run(tmp_path, monkeypatch)
    # teacher 256 B; kv_reduction=4 -> geo_dim 4: 64 B leave 64 / 2 / 2 - 2 * 4 = 8 sem_dim + v_dim over 2 layers
    args = upcycle_args(tmp_path, common, "dba")
    assert main([*args, f"out={tmp_path / 'up'}", "kv_budget=64"]) == 0
    err = capsys.readouterr().err
    assert "kv_budget=64 B: 8 sem_dim + v_dim per KV head over 2 layers" in err and "4.00x smaller" in err
    assert "per-layer sem_dim (CARE's greedy)" in err and "student 64 B: 4.00x smaller" in err
    loaded = load_model(str(tmp_path / "up" / "surgery"))
    assert isinstance(loaded.config, dba.DBAConfig) and dba.kv_bytes_per_token(loaded.config) == 64
    assert sum(loaded.config.sem_dims) + sum(loaded.config.v_dims) == 8 and loaded.config.geo_dim == 4
    assert main([*args, f"out={tmp_path / 'up'}", "kv_budget=72"]) == 2       # a rerun may not change the student
    assert "kv_budget=64 -> 72" in capsys.readouterr().err
    for extra, message in [(["kv_budget=36"], "kv_budget=36 does not fit this teacher: need 40 <= kv_budget <= 256"),
                           (["kv_budget=260"], "kv_budget=260 does not fit"),
                           (["kv_budget=62"], "kv_budget=62 is not a whole number of a layer's dims"),
                           (["kv_budget=64", "sem_dim=2"], "bad key 'sem_dim' with kv_budget=64"),
                           (["kv_budget=64", "rope_pairs_shared=true"], "bad key 'rope_pairs_shared' with")]:
        assert main([*args, f"out={tmp_path / 'bad'}", *extra]) == 2
        assert message in capsys.readouterr().err
