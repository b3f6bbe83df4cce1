"""Optimizers against torch.optim (float64, a real small Llama, 20 steps) and Lion against the paper."""
import math

import pytest
import torch
import torch.nn.functional as F

from purestep import optim
from purestep.core.tree import max_abs_diff, tree_map
from purestep.models import llama
from purestep.models.llama_module import LlamaModule, load_params
from purestep.optim import schedules

CFG = llama.LlamaConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                        tie_embeddings=False)


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        tok = torch.randint(0, CFG.vocab_size, (4, 17), generator=g)
        yield {"x": tok[:, :-1], "y": tok[:, 1:]}


def run_functional(transform, params, steps=20):
    state = transform.init(params)
    grad_fn = torch.func.grad(lambda p, b: llama.loss(p, b, CFG))
    for batch in batches(steps):
        updates, state = transform.update(grad_fn(params, batch), state, params)
        params = optim.apply_updates(params, updates)
    return params


def run_torch(make_opt, params, steps=20):
    module = load_params(LlamaModule(CFG).double(), params)
    opt = make_opt(module)
    for batch in batches(steps):
        opt.zero_grad()
        F.cross_entropy(module(batch["x"]).flatten(0, 1), batch["y"].flatten()).backward()
        opt.step()
        if hasattr(opt, "after_step"):   # an LR scheduler steps after the optimizer, as torch expects
            opt.after_step()
    return load_params_back(module)


def load_params_back(module):
    L = module.layers
    st = lambda get: torch.stack([get(l).detach() for l in L])  # noqa: E731
    return {
        "embed": module.embed_tokens.weight.detach(), "norm": module.norm.weight.detach(),
        "lm_head": module.lm_head.weight.detach(),
        "layers": {
            "attn_norm": st(lambda l: l.input_layernorm.weight), "mlp_norm": st(lambda l: l.post_attention_layernorm.weight),
            "attn": {"wq": st(lambda l: l.self_attn.q_proj.weight), "wk": st(lambda l: l.self_attn.k_proj.weight),
                     "wv": st(lambda l: l.self_attn.v_proj.weight), "wo": st(lambda l: l.self_attn.o_proj.weight)},
            "mlp": {"w_gate": st(lambda l: l.mlp.gate_proj.weight), "w_up": st(lambda l: l.mlp.up_proj.weight),
                    "w_down": st(lambda l: l.mlp.down_proj.weight)},
        },
    }


@pytest.fixture(scope="module")
def params64():
    return tree_map(lambda t: t.double(), llama.init(CFG, seed=3))


def delta_diff(a, b, base):
    """Compare the *changes* from the initial weights (torchopt's trick: errors are relative to the motion)."""
    return max_abs_diff(tree_map(torch.sub, a, base), tree_map(torch.sub, b, base))


def test_adamw_matches_torch(params64):
    ours = run_functional(optim.adamw(lr=3e-3, b1=0.85, b2=0.97, eps=1e-8, weight_decay=0.1, mask=None), params64)
    ref = run_torch(lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.85, 0.97), eps=1e-8,
                                                weight_decay=0.1, foreach=False), params64)
    assert delta_diff(ours, ref, params64) < 1e-10


def test_adamw_decay_mask_matches_torch_param_groups(params64):
    """The default mask (no decay on norms and embeddings) equals torch param groups that exclude them."""
    mask = optim.decay_mask(params64)
    assert mask["layers"]["attn"]["wq"] and mask["lm_head"]
    assert not mask["embed"] and not mask["norm"] and not mask["layers"]["attn_norm"]
    ours = run_functional(optim.adamw(lr=3e-3, weight_decay=0.5), params64)

    def make(m):
        no_decay = [m.embed_tokens.weight, m.norm.weight] + [w for l in m.layers for w in
                                                              (l.input_layernorm.weight, l.post_attention_layernorm.weight)]
        ids = {id(p) for p in no_decay}
        decay = [p for p in m.parameters() if id(p) not in ids]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.5}, {"params": no_decay, "weight_decay": 0.0}],
                                 lr=3e-3)

    assert delta_diff(ours, run_torch(make, params64), params64) < 1e-10


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_sgd_matches_torch(params64, momentum, nesterov):
    ours = run_functional(optim.sgd(lr=0.2, momentum=momentum, nesterov=nesterov, weight_decay=0.01), params64)
    ref = run_torch(lambda m: torch.optim.SGD(m.parameters(), lr=0.2, momentum=momentum, nesterov=nesterov,
                                              weight_decay=0.01, foreach=False), params64)
    assert delta_diff(ours, ref, params64) < 1e-10


def test_adamw_with_schedule_matches_torch_lambda_lr(params64):
    sched = schedules.cosine(warmup=5, total=20, floor=0.1)
    ours = run_functional(optim.adamw(lr=1e-2, weight_decay=0.1, mask=None, schedule=sched), params64)

    def factor(i):  # torch's LambdaLR calls this with 0, 1, ... before steps 1, 2, ...
        t = i + 1
        warm = min(t / 5, 1.0)
        p = min(max((t - 5) / 15, 0.0), 1.0)
        return warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    def make(m):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        opt.after_step = torch.optim.lr_scheduler.LambdaLR(opt, factor).step
        return opt

    # float32 schedule arithmetic: compare to 1e-7 of the motion, not 1e-10
    assert delta_diff(ours, run_torch(make, params64), params64) < 1e-7


def test_lion_matches_paper_on_hand_values():
    """Chen et al. 2023, Alg. 2, worked by hand for lr=0.1, b1=0.9, b2=0.99, wd=0.5."""
    params = {"w": torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)}
    t = optim.lion(lr=0.1, b1=0.9, b2=0.99, weight_decay=0.5, mask=None)
    state = t.init(params)
    g1 = {"w": torch.tensor([0.3, -0.1, 0.0], dtype=torch.float64)}
    upd, state = t.update(g1, state, params)
    p1 = optim.apply_updates(params, upd)
    # m0 = 0: c = 0.1 * g -> sign = [1, -1, 0]; p -= 0.1 * (sign + 0.5 p)
    assert torch.allclose(p1["w"], torch.tensor([1 - 0.1 * (1 + 0.5), -2 - 0.1 * (-1 - 1.0), 0.5 - 0.1 * 0.25],
                                                dtype=torch.float64))
    # m1 = 0.01 * g1 = [0.003, -0.001, 0]
    g2 = {"w": torch.tensor([-0.01, 0.2, -0.4], dtype=torch.float64)}
    upd, state = t.update(g2, state, p1)
    p2 = optim.apply_updates(p1, upd)
    # c = 0.9*m1 + 0.1*g2 = [0.0027-0.001, -0.0009+0.02, -0.04] -> sign [1, 1, -1]
    expect = p1["w"] - 0.1 * (torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64) + 0.5 * p1["w"])
    assert torch.allclose(p2["w"], expect)
    # m2 = 0.99*m1 + 0.01*g2
    m2 = 0.99 * torch.tensor([0.003, -0.001, 0.0], dtype=torch.float64) + 0.01 * g2["w"]
    assert torch.allclose(state[0].mu["w"], m2)


def test_clip_by_global_norm_matches_torch():
    g = {"a": torch.randn(5, 3), "b": {"c": torch.randn(7)}}
    t = optim.clip_by_global_norm(0.5)
    ours, _ = t.update(g, t.init(g), g)
    ref = [g["a"].clone(), g["b"]["c"].clone()]
    for r in ref:
        r.grad = r.clone()
    torch.nn.utils.clip_grad_norm_(ref, 0.5)
    assert torch.allclose(ours["a"], ref[0].grad) and torch.allclose(ours["b"]["c"], ref[1].grad)
    small = {"a": torch.full((2,), 0.01)}
    assert torch.equal(t.update(small, t.init(small), small)[0]["a"], small["a"])


@pytest.mark.parametrize("kind,expected", [
    ("constant", {1: 0.25, 4: 1.0, 50: 1.0}),
    ("cosine", {1: 0.25, 4: 1.0, 52: 0.55, 100: 0.1, 150: 0.1}),
    ("linear", {4: 1.0, 52: 0.55, 100: 0.1}),
])
def test_schedule_values(kind, expected):
    s = schedules.make(kind, warmup=4, total=100, floor=0.1)
    for step, value in expected.items():
        assert s(torch.tensor(step)).item() == pytest.approx(value, abs=1e-6), (kind, step)


def test_step_decay():
    s = schedules.make("step", warmup=0, every=10, gamma=0.5)
    assert [round(s(torch.tensor(t)).item(), 6) for t in (1, 9, 10, 25)] == [1.0, 1.0, 0.5, 0.25]


def test_scale_lr_edits_state_not_graph():
    params = {"w": torch.ones(3)}
    t = optim.adamw(lr=0.1)
    state = optim.scale_lr(t.init(params), 0.5)
    assert optim.base_lr(state).item() == pytest.approx(0.05)
    _, state = t.update({"w": torch.ones(3)}, state, params)
    assert optim.current_lr(state).item() == pytest.approx(0.05)
