"""The functional Llama against the ordinary nn.Module Llama (same weights), and its own invariants."""
import math

import pytest
import torch
import torch.nn.functional as F

from purestep.core import rng
from purestep.core.tree import max_abs_diff, names
from purestep.models import llama
from purestep.models.llama_module import LlamaModule, grads_as_params, load_params

CONFIGS = {
    "gqa_tied": llama.LlamaConfig(vocab_size=97, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2, tie_embeddings=True),
    "mha_untied": llama.LlamaConfig(vocab_size=80, d_model=32, n_layers=2, n_heads=4, tie_embeddings=False),
    "mqa": llama.LlamaConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, rope_theta=500.0),
}


def tokens(cfg, b=3, t=24, seed=0):
    return torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", CONFIGS)
def test_forward_matches_module(name):
    cfg = CONFIGS[name]
    params = llama.init(cfg, seed=1)
    # scale weights up so attention is far from uniform and a wrong head mapping would show
    params["layers"]["attn"]["wq"] = params["layers"]["attn"]["wq"] * 8
    module = load_params(LlamaModule(cfg), params)
    tok = tokens(cfg)
    assert max_abs_diff(llama.apply(params, tok, cfg), module(tok)) < 1e-5


@pytest.mark.parametrize("name", CONFIGS)
def test_func_grad_matches_backward(name):
    cfg = CONFIGS[name]
    params = llama.init(cfg, seed=2)
    module = load_params(LlamaModule(cfg), params)
    tok = tokens(cfg, seed=5)
    batch = {"x": tok[:, :-1], "y": tok[:, 1:]}
    grads = torch.func.grad(lambda p: llama.loss(p, batch, cfg))(params)
    F.cross_entropy(module(batch["x"]).flatten(0, 1), batch["y"].flatten()).backward()
    assert max_abs_diff(grads, grads_as_params(module)) < 1e-6
    # a tied embedding receives both the input and the output use
    if cfg.tie_embeddings:
        assert "lm_head" not in params and grads["embed"].abs().sum() > 0


def test_param_names_are_readable():
    assert "layers.attn.wq" in names(llama.init(CONFIGS["gqa_tied"]))


def test_kv_cache_decode_equals_full_forward():
    cfg = CONFIGS["gqa_tied"]
    params = llama.init(cfg, seed=4)
    tok = tokens(cfg, b=2, t=12)
    full = llama.apply(params, tok, cfg)
    cache = llama.new_cache(cfg, batch=2, max_len=16)
    prefill = llama.apply(params, tok[:, :7], cfg, cache=cache, past_len=0)
    steps = [prefill] + [llama.apply(params, tok[:, t:t + 1], cfg, cache=cache, past_len=t) for t in range(7, 12)]
    assert max_abs_diff(torch.cat(steps, dim=1), full) < 1e-5
    # a chunk of several new tokens after a prefix (explicit mask path)
    cache = llama.new_cache(cfg, batch=2, max_len=16)
    a = llama.apply(params, tok[:, :5], cfg, cache=cache, past_len=0)
    b = llama.apply(params, tok[:, 5:], cfg, cache=cache, past_len=5)
    assert max_abs_diff(torch.cat([a, b], dim=1), full) < 1e-5


def test_llama3_rope_scaling_follows_the_reference_formula():
    """Meta's ``apply_scaling`` (llama-models, Llama 3.1) computed independently per frequency."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    cfg = llama.LlamaConfig(d_model=64, n_heads=2, rope_theta=500000.0, rope_scaling=scaling)
    ours = llama.rope_frequencies(cfg)
    base = 1.0 / (500000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32))
    expect = []
    for f in base.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < 64 / 4.0:
            expect.append(f)
        elif wavelen > 64 / 1.0:
            expect.append(f / 8.0)
        else:
            smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
            expect.append((1 - smooth) * f / 8.0 + smooth * f)
    assert torch.allclose(ours, torch.tensor(expect, dtype=torch.float64), rtol=1e-12)
    assert not torch.allclose(ours, base)  # the scaling really changed some frequencies


def test_dropout_is_a_function_of_the_key():
    cfg = llama.LlamaConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, dropout=0.3)
    params = llama.init(cfg)
    tok = tokens(cfg)
    k = rng.key(7)
    a, b = llama.apply(params, tok, cfg, key=k), llama.apply(params, tok, cfg, key=k)
    c = llama.apply(params, tok, cfg, key=rng.fold_in(k, 1))
    assert torch.equal(a, b) and not torch.allclose(a, c)
    assert not torch.allclose(a, llama.apply(params, tok, cfg))  # no key: no dropout


def test_rng_uniform_is_uniform_and_keyed():
    u = rng.uniform(rng.key(0), (100_000,))
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert not torch.equal(u, rng.uniform(rng.key(1), (100_000,)))
    assert torch.equal(rng.uniform(rng.key(3), (5,)), rng.uniform(rng.key(3), (5,)))


def test_initial_loss_is_near_log_vocab():
    cfg = CONFIGS["gqa_tied"]
    tok = tokens(cfg, b=8, t=33)
    loss = llama.loss(llama.init(cfg), {"x": tok[:, :-1], "y": tok[:, 1:]}, cfg)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1 * math.log(cfg.vocab_size)


def test_position_tables_are_the_rope_tables_and_one_op_of_the_compiled_graph():
    """``position_tables`` (what ``apply`` reads) equals ``rope_tables`` at every offset bitwise, and a compiled
    ``torch.func.grad`` over two models' tables (a teacher's and a student's in one graph, which a trace-time
    constant named after the function could not hold) calls one op for each, with no cos/sin inlined."""
    cfg = llama.LlamaConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, rope_scaling={"rope_type": "llama3",
                            "factor": 8.0, "original_max_position_embeddings": 8})
    other = llama.LlamaConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, rope_theta=500.0)
    for start, length in ((0, 5), (7, 3)):
        cos, sin = llama.position_tables(llama.rope_frequencies, cfg, start, length, torch.float32, torch.device("cpu"))
        ref = llama.rope_tables(llama.rope_frequencies(cfg), torch.arange(start, start + length), torch.float32)
        assert torch.equal(cos, ref[0]) and torch.equal(sin, ref[1])
    ops = []

    def backend(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward
    x = torch.randn(5, 8)

    def f(x):
        cos, sin = llama.position_tables(llama.rope_frequencies, cfg, 0, 5, x.dtype, x.device)
        cos2, sin2 = llama.position_tables(llama.rope_frequencies, other, 0, 5, x.dtype, x.device)
        return (x * cos + x * sin).sum() + (x * cos2 - x * sin2).sum()
    grad = torch.compile(torch.func.grad(f), backend=backend, fullgraph=True)(x)
    assert torch.allclose(grad, torch.func.grad(f)(x))
    assert sum("rope_tables" in op for op in ops) == 2, ops
    assert not any("cos" in op or "sin" in op for op in ops), ops


def _sdpa_fp32(q, k, v, mask=None, causal=False, scale=None):
    """The reference: SDPA over the fp32 values of the inputs (GQA as SDPA's own ``enable_gqa``)."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal,
                                          scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_short_attention_under_the_cpus_autocast_is_the_written_out_formula(compiled):
    """Under the CPU's bf16 autocast, attention over up to MATH_ATTENTION_MAX_KEYS keys is nanoGPT's attention
    written out (scores and probs @ v as bf16 products, the masked softmax in fp32): within bf16's rounding of SDPA
    over the fp32 values, in bf16; causal, with GQA, a scale, a sliding window, packed documents and queries
    after a KV cache's past; eager, and compiled (the train step's path; three of the cases, each a graph)."""
    g = torch.Generator().manual_seed(0)
    attend = torch.compile(llama.causal_attention, fullgraph=True, dynamic=False) if compiled \
        else llama.causal_attention
    doc = torch.tensor([[0] * 7 + [1] * 9, [0] * 16])
    cases = [  # (kv heads, T, S, causal_attention's keywords, the reference's mask)
        (4, 16, 16, {}, None),
        (2, 16, 16, {"scale": 0.3}, None),
        (2, 16, 16, {"doc": doc}, llama.attention_mask(16, 16, doc=doc)),
        (4, 16, 16, {"window": 5}, llama.attention_mask(16, 16, window=5)),
        (2, 3, 16, {"past_len": 13}, llama.attention_mask(3, 16, past_len=13)),
        (4, 1, 16, {"past_len": 15}, None),
    ]
    for kv_heads, T, S, kw, mask in cases[::2] if compiled else cases:   # compiled: causal, documents, a past
        q = torch.randn(2, 4, T, 8, generator=g).bfloat16() * 2
        k, v = (torch.randn(2, kv_heads, S, 8, generator=g).bfloat16() for _ in range(2))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = attend(q, k, v, **kw)
        want = _sdpa_fp32(q, k, v, mask, causal=mask is None and T == S, scale=kw.get("scale"))
        assert y.dtype == torch.bfloat16, kw
        # bf16's rounding: the scores' and the output's; the output's alone is up to 0.008 in these cases, the
        # whole difference up to 0.012 eager
        assert (y.float() - want).abs().max() < 0.02, (kw, (y.float() - want).abs().max())


def test_long_attention_runs_in_fp32_under_the_cpus_autocast():
    """Past MATH_ATTENTION_MAX_KEYS keys, attention under the CPU's bf16 autocast is SDPA over the fp32 values of its
    bf16 inputs, back in bf16 (torch's CPU flash kernel is slower in bf16); outside autocast bf16 tensors take
    SDPA in bf16 as given (a bf16 model's forward stays transformers' own, bit for bit), with and without GQA."""
    g = torch.Generator().manual_seed(0)
    T = llama.MATH_ATTENTION_MAX_KEYS + 1
    for kv_heads in (4, 2):
        q = torch.randn(1, 4, T, 8, generator=g).bfloat16()
        k, v = (torch.randn(1, kv_heads, T, 8, generator=g).bfloat16() for _ in range(2))
        gqa = kv_heads != 4
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = llama.causal_attention(q, k, v)
        assert y.dtype == torch.bfloat16 and torch.equal(y, _sdpa_fp32(q, k, v, causal=True).bfloat16())
        plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        assert torch.equal(llama.causal_attention(q, k, v), plain)
        short = q[:, :, :16], k[:, :, :16], v[:, :, :16]
        assert torch.equal(llama.causal_attention(*short),
                           F.scaled_dot_product_attention(*short, is_causal=True, enable_gqa=gqa))
