"""DBA attention and Llama -> DBA surgery: exactness at full rank, GQA, partial RoPE, error vs rank, KV cache."""
import importlib.util
import math

import pytest
import torch

from purestep.core.config import from_dict, to_dict
from purestep.core.tree import max_abs_diff, names, tree_leaves
from purestep.models import dba, llama, surgery
from purestep.models.sampling import generate

CFG = llama.LlamaConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16)
METHODS = surgery.METHODS


def teacher(seed=1, cfg=CFG):
    """A random GQA Llama with weights scaled up: peaky attention (a wrong head mapping shows) and O(1) logits."""
    params = llama.init(cfg, seed=seed)
    attn = params["layers"]["attn"]
    attn["wq"], attn["wk"], attn["wv"] = attn["wq"] * 10, attn["wk"] * 10, attn["wv"] * 3
    params["embed"] = params["embed"] * 20
    return params


def tokens(b=2, t=24, seed=0, vocab=CFG.vocab_size):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


CALIB = tokens(4, 32, seed=11)


def test_teacher_attention_is_peaky():
    """The test teacher's attention is far from uniform, so the exactness tests below can fail."""
    params = teacher()
    x = surgery.calibration_inputs(params, CFG, tokens(1, 24))[0]           # layer 0 [T, d]
    q = (x @ params["layers"]["attn"]["wq"][0].mT).view(24, 4, 16).transpose(0, 1)
    k = (x @ params["layers"]["attn"]["wk"][0].mT).view(24, 2, 16).transpose(0, 1).repeat_interleave(2, 0)
    probs = ((q @ k.mT) / 4).masked_fill(torch.ones(24, 24).triu(1).bool(), -torch.inf).softmax(-1)
    assert probs[:, 8:].amax(-1).mean() > 0.5
    assert llama.apply(params, tokens(), CFG).std() > 1.0


# ----------------------------------------------------------------------------------------------------------
# exactness

@pytest.mark.parametrize("method", METHODS)
def test_all_geometric_full_rank_student_equals_teacher(method):
    params, tok = teacher(), tokens()
    student, scfg, report = surgery.surgery(params, CFG, CALIB, sem_dim=0, geo_dim=16, v_dim=16, method=method)
    assert max_abs_diff(dba.apply(student, tok, scfg), llama.apply(params, tok, CFG)) < 1e-4
    assert scfg.rope_pairs == [[list(range(8))] * 2] * 2
    assert max(report["v_err"] + report["v_err_act"] + report["score_err"]) < 1e-6
    # everything outside the attention is the teacher's, under the teacher's names
    assert set(names(student)) - set(names(params)) == {f"layers.attn.{w}" for w in
                                                        ("wq_s", "wq_g", "wk_s", "wk_g")}
    assert torch.equal(student["layers"]["mlp"]["w_up"], params["layers"]["mlp"]["w_up"])


def test_query_heads_must_read_their_own_kv_head():
    """Moving a query head to another KV group (what a GQA-blind surgery does) breaks exactness; moving it
    inside its group does not (heads are summed), so the exactness test does see the group mapping."""
    params, tok = teacher(), tokens()
    student, scfg, _ = surgery.surgery(params, CFG, CALIB, sem_dim=0, geo_dim=16, v_dim=16)
    want = llama.apply(params, tok, CFG)

    def permuted(order):
        attn = dict(student["layers"]["attn"])
        for w, axis, width in (("wq_g", 1, scfg.geo_dim), ("wq_s", 1, scfg.sem_dim), ("wo", 2, scfg.v_dim)):
            attn[w] = attn[w].unflatten(axis, (CFG.n_heads, width))[(slice(None),) * axis + (order,)].flatten(
                axis, axis + 1)
        return dict(student, layers=dict(student["layers"], attn=attn))

    assert max_abs_diff(dba.apply(permuted([1, 0, 3, 2]), tok, scfg), want) < 1e-4     # within groups
    assert max_abs_diff(dba.apply(permuted([0, 2, 1, 3]), tok, scfg), want) > 0.1      # h -> h % n_kv
    assert max_abs_diff(dba.apply(permuted([2, 3, 0, 1]), tok, scfg), want) > 0.1      # groups swapped


def explicit_scores(params, cfg, layer, x, positions, keep):
    """Teacher reference, head by head: q.k / sqrt(hd) with RoPE on the ``keep`` pairs only [H, T, T]."""
    attn, hd, n = params["layers"]["attn"], cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    cos, sin = llama.rope_tables(llama.rope_frequencies(cfg), positions, torch.float64)
    out = []
    for h in range(cfg.n_heads):
        g = h // n
        q = x @ attn["wq"][layer].double()[h * hd:(h + 1) * hd].mT / math.sqrt(hd)
        k = x @ attn["wk"][layer].double()[g * hd:(g + 1) * hd].mT
        rotated = torch.zeros(hd, dtype=torch.bool)
        rotated[keep[layer][g]] = True
        rotated[[f + hd // 2 for f in keep[layer][g]]] = True
        q = torch.where(rotated, llama.apply_rope(q, cos, sin), q)
        k = torch.where(rotated, llama.apply_rope(k, cos, sin), k)
        out.append(q @ k.mT)
    return torch.stack(out)


def student_scores(student, scfg, layer, x, positions):
    """The DBA score q_s.k_s + R q_g . R k_g per head [H, T, T], computed from the student's weights."""
    a = {k: v[layer].double() for k, v in student["layers"]["attn"].items()}
    H, G, T = scfg.n_heads, scfg.n_kv_heads, x.shape[0]
    cos, sin = dba.rope_tables(scfg, positions, torch.float64)
    cos, sin = cos[layer].repeat_interleave(H // G, 0), sin[layer].repeat_interleave(H // G, 0)

    def heads(w, n, width):
        return (x @ w.mT).view(T, n, width).transpose(0, 1)

    q_g = llama.apply_rope(heads(a["wq_g"], H, scfg.geo_dim), cos, sin)
    k_g = llama.apply_rope(heads(a["wk_g"], G, scfg.geo_dim).repeat_interleave(H // G, 0), cos, sin)
    q_s, k_s = heads(a["wq_s"], H, scfg.sem_dim), heads(a["wk_s"], G, scfg.sem_dim).repeat_interleave(H // G, 0)
    return q_s @ k_s.mT + q_g @ k_g.mT


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("geo_dim", [0, 6, 10])
def test_semantic_path_is_exact_at_full_rank_for_the_no_rope_score(method, geo_dim):
    """At sem_dim = head_dim - geo_dim the student's score equals the teacher's score with RoPE removed from
    the dropped pairs (all pairs when geo_dim = 0): per head, per position pair, every layer, kept pairs at the
    teacher's own frequencies."""
    params = teacher()
    student, scfg, report = surgery.surgery(params, CFG, CALIB, sem_dim=16 - geo_dim, geo_dim=geo_dim, v_dim=16,
                                            method=method)
    x = surgery.calibration_inputs(params, CFG, tokens(1, 20, seed=3)).double()
    positions = torch.arange(5, 25)                       # not starting at 0: RoPE really rotates
    for layer in range(CFG.n_layers):
        want = explicit_scores(params, CFG, layer, x[layer], positions, scfg.rope_pairs)
        got = student_scores(student, scfg, layer, x[layer], positions)
        assert (got - want).abs().max() < 1e-4 * want.abs().max()
    assert max(report["score_err"] + report["score_err_act"]) < 1e-6
    if geo_dim:   # the pairs really differ between heads and layers, so per-head frequencies are exercised
        assert len({tuple(p) for layer in scfg.rope_pairs for p in layer}) > 1


def test_score_error_formula_matches_explicit_products():
    """The report's Gram-trace error equals ||M - A^T B|| computed with explicit d x d products."""
    params = teacher()
    student, scfg, report = surgery.surgery(params, CFG, CALIB, sem_dim=3, geo_dim=8, v_dim=5)
    x = surgery.calibration_inputs(params, CFG, CALIB).double()
    hd, n = CFG.head_dim, CFG.n_heads // CFG.n_kv_heads
    for layer in range(CFG.n_layers):
        a = {k: v[layer].double() for k, v in student["layers"]["attn"].items()}
        num = den = num_act = den_act = 0.0
        for h in range(CFG.n_heads):
            g = h // n
            drop = [f for f in range(hd // 2) if f not in scfg.rope_pairs[layer][g]]
            dims = drop + [f + hd // 2 for f in drop]
            Q = params["layers"]["attn"]["wq"][layer].double()[h * hd:(h + 1) * hd][dims] / math.sqrt(hd)
            K = params["layers"]["attn"]["wk"][layer].double()[g * hd:(g + 1) * hd][dims]
            M = Q.mT @ K
            E = M - a["wq_s"][h * 3:(h + 1) * 3].mT @ a["wk_s"][g * 3:(g + 1) * 3]
            num, den = num + E.square().sum(), den + M.square().sum()
            num_act += (x[layer] @ E @ x[layer].mT).square().sum()
            den_act += (x[layer] @ M @ x[layer].mT).square().sum()
        assert math.isclose(report["score_err"][layer], (num / den).sqrt().item(), rel_tol=1e-6)
        assert math.isclose(report["score_err_act"][layer], (num_act / den_act).sqrt().item(), rel_tol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_factorizations_reach_the_eckart_young_bound(method):
    """The shared-key factorization is the best rank-r one for the group: its error equals the tail of the
    singular values of the stacked explicit products [M_1; ...; M_n] (whitened, W^T M_h W, for asvd); the value
    error equals the tail of each KV head's W_v (W_v W for asvd)."""
    params, r, rv = teacher(seed=7), 3, 5
    _, scfg, report = surgery.surgery(params, CFG, CALIB, sem_dim=r, geo_dim=8, v_dim=rv, method=method)
    x = surgery.calibration_inputs(params, CFG, CALIB).double()
    hd, n, G, a = CFG.head_dim, CFG.n_heads // CFG.n_kv_heads, CFG.n_kv_heads, params["layers"]["attn"]
    metric = "" if method == "svd" else "_act"
    for layer in range(CFG.n_layers):
        W = torch.eye(CFG.d_model, dtype=torch.float64) if method == "svd" else torch.linalg.cholesky(
            x[layer].mT @ x[layer])
        tail = lambda s, k: (s[k:].square().sum(), s.square().sum())   # noqa: E731
        score, value = [0.0, 0.0], [0.0, 0.0]
        for g in range(G):
            drop = [f for f in range(hd // 2) if f not in scfg.rope_pairs[layer][g]]
            dims = drop + [f + hd // 2 for f in drop]
            K = a["wk"][layer].double()[g * hd:(g + 1) * hd][dims]
            stack = torch.cat([W.mT @ (a["wq"][layer].double()[h * hd:(h + 1) * hd][dims].mT @ K) @ W
                               for h in range(g * n, (g + 1) * n)])
            for acc, s, k in ((score, torch.linalg.svdvals(stack), r),
                              (value, torch.linalg.svdvals(a["wv"][layer].double()[g * hd:(g + 1) * hd] @ W), rv)):
                part, whole = tail(s, k)
                acc[0], acc[1] = acc[0] + part, acc[1] + whole
        assert math.isclose(report["score_err" + metric][layer], (score[0] / score[1]).sqrt().item(), rel_tol=1e-4)
        assert math.isclose(report["v_err" + metric][layer], (value[0] / value[1]).sqrt().item(), rel_tol=1e-4)


# ----------------------------------------------------------------------------------------------------------
# partial RoPE: the 2-norm selection

def planted_teacher():
    """Per layer and KV head, a different set of 3 pairs carries all of W_k's energy (the other pairs' key rows
    are zero), so those pairs are the only ones that matter and dropping the rest is lossless."""
    params, hd = teacher(seed=5), CFG.head_dim
    planted = [[[1, 4, 6], [0, 2, 7]], [[3, 4, 5], [1, 5, 6]]]
    wk = params["layers"]["attn"]["wk"].view(CFG.n_layers, CFG.n_kv_heads, hd, CFG.d_model).clone()
    for layer, groups in enumerate(planted):
        for g, pairs in enumerate(groups):
            off = [f for f in range(hd // 2) if f not in pairs]
            wk[layer, g, off + [f + hd // 2 for f in off]] = 0
    params["layers"]["attn"]["wk"] = wk.flatten(1, 2)
    return params, planted


def test_pair_scores_follow_the_mha2mla_formula():
    """score_f = sum over the group's query heads of mean_t ||q_h[f]||, times mean_t ||k[f]||, pair by pair."""
    params = teacher(seed=2)
    x = surgery.calibration_inputs(params, CFG, CALIB)
    scores = surgery.pair_scores(params, CFG, x)
    hd, n, a = CFG.head_dim, CFG.n_heads // CFG.n_kv_heads, params["layers"]["attn"]
    for layer in range(CFG.n_layers):
        for g in range(CFG.n_kv_heads):
            for f in range(hd // 2):
                k = x[layer] @ a["wk"][layer][g * hd:(g + 1) * hd][[f, f + hd // 2]].mT
                q_total = sum((x[layer] @ a["wq"][layer][h * hd:(h + 1) * hd][[f, f + hd // 2]].mT).norm(dim=-1).mean()
                              for h in range(g * n, (g + 1) * n))
                want = q_total * k.norm(dim=-1).mean()
                assert math.isclose(scores[layer, g, f].item(), want.item(), rel_tol=1e-5)


def test_two_norm_selection_finds_planted_pairs_and_rotates_them_at_their_own_frequency():
    params, planted = planted_teacher()
    tok = tokens()
    student, scfg, _ = surgery.surgery(params, CFG, CALIB, sem_dim=0, geo_dim=6, v_dim=16)
    assert scfg.rope_pairs == planted
    assert max_abs_diff(dba.apply(student, tok, scfg), llama.apply(params, tok, CFG)) < 1e-4
    # the same weights rotated with a re-indexed table (pairs 0..2 of every head) are no longer the teacher
    reindexed = dba.DBAConfig.from_teacher(CFG, sem_dim=0, geo_dim=6, v_dim=16,
                                           rope_pairs=[[[0, 1, 2]] * 2] * 2)
    assert max_abs_diff(dba.apply(student, tok, reindexed), llama.apply(params, tok, CFG)) > 0.1


def test_selection_ranks_by_energy():
    scores = torch.tensor([[[0.1, 5.0, 0.2, 3.0, 4.0, 0.0]]])
    assert surgery.select_pairs(scores, 3).tolist() == [[[1, 3, 4]]]
    assert surgery.select_pairs(scores, 0).shape == (1, 1, 0)


# ----------------------------------------------------------------------------------------------------------
# error against rank

@pytest.mark.parametrize("method", METHODS)
def test_errors_shrink_as_ranks_grow(method):
    params, tok = teacher(seed=3), tokens(seed=4)
    want = llama.apply(params, tok, CFG)
    limit_params, limit_cfg, _ = surgery.surgery(params, CFG, CALIB, sem_dim=8, geo_dim=8, v_dim=16, method=method)
    limit = dba.apply(limit_params, tok, limit_cfg)   # full rank at geo_dim = 8: only RoPE left the dropped pairs
    metric = "" if method == "svd" else "_act"          # the metric each method minimizes (Eckart-Young)
    rows = []
    for sem, v in [(0, 2), (2, 4), (4, 8), (6, 12), (8, 16)]:
        student, scfg, report = surgery.surgery(params, CFG, CALIB, sem_dim=sem, geo_dim=8, v_dim=v, method=method)
        out = dba.apply(student, tok, scfg)
        rows.append((max(report["score_err" + metric]), max(report["v_err" + metric]),
                     (out - limit).norm().item(), (out - want).norm().item()))
    for column in zip(*rows):
        assert all(b <= a + 1e-9 for a, b in zip(column, column[1:])), column
    score_err, v_err, to_limit, _ = rows[-1]
    assert score_err < 1e-6 and v_err < 1e-6 and to_limit < 1e-3 and rows[0][0] == 1.0


def test_activation_aware_wins_on_activations_and_plain_svd_on_weights():
    params = teacher(seed=6)
    _, _, svd = surgery.surgery(params, CFG, CALIB, sem_dim=3, geo_dim=8, v_dim=6, method="svd")
    _, _, asvd = surgery.surgery(params, CFG, CALIB, sem_dim=3, geo_dim=8, v_dim=6, method="asvd")
    for key in ("score_err", "v_err"):
        assert all(a <= s + 1e-6 for a, s in zip(asvd[key + "_act"], svd[key + "_act"]))
        assert all(s <= a + 1e-6 for a, s in zip(asvd[key], svd[key]))
        assert sum(asvd[key + "_act"]) < 0.95 * sum(svd[key + "_act"])


def test_bad_surgery_arguments():
    with pytest.raises(ValueError, match="method"):
        surgery.surgery(teacher(), CFG, CALIB, sem_dim=4, geo_dim=8, v_dim=8, method="pca")
    with pytest.raises(ValueError, match="sem_dim"):
        surgery.surgery(teacher(), CFG, CALIB, sem_dim=10, geo_dim=8, v_dim=8)
    with pytest.raises(ValueError, match="v_dim"):
        surgery.surgery(teacher(), CFG, CALIB, sem_dim=4, geo_dim=8, v_dim=17)


# ----------------------------------------------------------------------------------------------------------
# the KV cache

@pytest.mark.parametrize("sem,geo,v", [(4, 4, 8), (0, 8, 8), (8, 0, 8)])
def test_cache_size_is_the_formula_and_decode_equals_full_forward(sem, geo, v):
    params = teacher()
    student, scfg, _ = surgery.surgery(params, CFG, CALIB, sem_dim=sem, geo_dim=geo, v_dim=v)
    # half the teacher's cache: 8 + 8 values per KV head against 2 * 16
    assert dba.kv_bytes_per_token(scfg) * 2 == llama.kv_bytes_per_token(CFG) == 2 * 2 * 2 * 16 * 2
    prompt, max_len = tokens(2, 6, seed=8), 16
    forward = dba.decoder(student, scfg, batch=2, max_len=max_len)
    seen = []

    def measure(_):
        cached = sum(t.numel() * t.element_size() for layer in forward.cache for t in layer.values())
        seen.append(cached / (2 * max_len))

    new = generate(forward, prompt, 10, temperature=0, on_token=measure)
    assert seen == [dba.kv_bytes_per_token(scfg, dtype_bytes=4)] * 10
    bf16 = dba.new_cache(scfg, 1, 1, dtype=torch.bfloat16)
    assert sum(t.numel() * t.element_size() for layer in bf16 for t in layer.values()) == dba.kv_bytes_per_token(scfg)
    # greedy decoding through the cache picks the argmax of the full (uncached) forward at every step
    full = dba.apply(student, torch.cat([prompt, new], 1), scfg)
    assert torch.equal(full[:, prompt.shape[1] - 1:-1].argmax(-1), new)
    # logits: prefill + single-token steps, and a multi-token chunk after a prefix (explicit-mask path)
    tok = tokens(2, 12, seed=9)
    full = dba.apply(student, tok, scfg)
    cache = dba.new_cache(scfg, 2, max_len)
    steps = [dba.apply(student, tok[:, :7], scfg, cache=cache, past_len=0)]
    steps += [dba.apply(student, tok[:, t:t + 1], scfg, cache=cache, past_len=t) for t in range(7, 12)]
    assert max_abs_diff(torch.cat(steps, 1), full) < 1e-4
    cache = dba.new_cache(scfg, 2, max_len)
    chunks = [dba.apply(student, tok[:, :5], scfg, cache=cache, past_len=0),
              dba.apply(student, tok[:, 5:], scfg, cache=cache, past_len=5)]
    assert max_abs_diff(torch.cat(chunks, 1), full) < 1e-4


# ----------------------------------------------------------------------------------------------------------
# the model on its own

def test_init_config_and_gradients():
    scfg = dba.DBAConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, sem_dim=4, geo_dim=6,
                         v_dim=8)
    assert scfg.head_dim == 8 and scfg.rope_pairs == [[[0, 1, 2]] * 2] * 2     # uniform over 4 pairs
    assert from_dict(dba.DBAConfig, to_dict(scfg)) == scfg
    params = dba.init(scfg, seed=0)
    assert params["layers"]["attn"]["wq_g"].shape == (2, 4 * 6, 32)
    assert params["layers"]["attn"]["wo"].shape == (2, 32, 4 * 8)
    tok = tokens(2, 9, vocab=50)
    batch = {"x": tok[:, :-1], "y": tok[:, 1:]}
    grads = torch.func.grad(lambda p: dba.loss(p, batch, scfg))(params)
    assert names(grads) == names(params)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads["layers"]["attn"].values())
    loss = dba.loss(params, batch, scfg)
    assert abs(loss.item() - math.log(50)) < 0.1 * math.log(50)
    # remat (upcycle's global.remat) recomputes the blocks in the backward: the same gradients
    leaves = [t.requires_grad_() for t in tree_leaves(params)]
    plain = torch.autograd.grad(dba.loss(params, batch, scfg), leaves)
    recomputed = torch.autograd.grad(dba.loss(params, batch, scfg, remat=True), leaves)
    assert max(float((a - b).abs().max()) for a, b in zip(plain, recomputed)) < 1e-6


@pytest.mark.parametrize("bad,match", [
    (dict(geo_dim=5), "even"), (dict(geo_dim=10), "head_dim"), (dict(sem_dim=0, geo_dim=0), "no keys"),
    (dict(v_dim=0), "v_dim"), (dict(rope_pairs=[[[0, 1]] * 2]), "rope_pairs"),
    (dict(geo_dim=4, rope_pairs=[[[0, 0]] * 2] * 2), "distinct"), (dict(geo_dim=4, rope_pairs=[[[0, 4]] * 2] * 2),
                                                                   "distinct")])
def test_config_rejects_bad_shapes(bad, match):
    kwargs = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, sem_dim=4, geo_dim=4, v_dim=8)
    with pytest.raises(ValueError, match=match):
        dba.DBAConfig(**{**kwargs, **bad})


# ----------------------------------------------------------------------------------------------------------
# real weights

def smollm2_gguf():
    if importlib.util.find_spec("purestep.models.smollm2") is None:
        pytest.skip("models/smollm2.py is not there yet")
    from purestep.models import smollm2
    if smollm2.find_gguf() is None:
        pytest.skip(f"SmolLM2 is not installed: {smollm2.INSTALL}")


def test_smollm2_exact_surgery_keeps_the_logits():
    """SmolLM2-135M (30 layers, 9 query / 3 KV heads): the all-geometric full-rank student is the teacher.

    In float64: in float32 the student differs by about 7e-5 (the value fold's basis change rounds every weight),
    about the teacher's own float32 error against float64 (5e-5), so 1e-4 would test rounding, not the surgery."""
    smollm2_gguf()
    from purestep.models.loading import load_model
    loaded = load_model("smollm2", dtype=torch.float64)
    params, cfg = loaded.params, loaded.config
    text = ("The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun.\n"
            "def double(x):\n    return 2 * x  # see PEP 8 for the style of this function")
    tok = (torch.tensor([loaded.tokenizer.encode(text)[:32]]) if loaded.tokenizer
           else tokens(1, 32, vocab=cfg.vocab_size))
    assert tok.shape == (1, 32)
    student, scfg, report = surgery.surgery(params, cfg, tok, sem_dim=0, geo_dim=cfg.head_dim, v_dim=cfg.head_dim)
    with torch.no_grad():
        assert max_abs_diff(dba.apply(student, tok, scfg), llama.apply(params, tok, cfg)) < 1e-4
    assert max(report["v_err"]) < 1e-6
    half = dba.DBAConfig.from_teacher(cfg, sem_dim=16, geo_dim=16, v_dim=32)
    assert 2 * dba.kv_bytes_per_token(half) == llama.kv_bytes_per_token(cfg) == 30 * 2 * 3 * 64 * 2
