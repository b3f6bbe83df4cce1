"""The train step compiles into one graph, and a learning-rate schedule never recompiles it.

One of the two test files that pay for real inductor compiles (with ``tests/test_donation.py``; cached on
disk by inductor's FX graph cache, so a second run is fast).
"""
import torch

from purestep import optim
from purestep.core.compile import compile_count
from purestep.core.state import init_state
from purestep.core.step import Gradients, make_train_step
from purestep.core.tree import max_abs_diff, tree_map
from purestep.models import llama

CFG = llama.LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


def loss_fn(p, b):
    return llama.loss(p, b, CFG)


def batches(n):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tok = torch.randint(0, CFG.vocab_size, (4, 17), generator=g)
        out.append({"x": tok[:, :-1], "y": tok[:, 1:]})
    return out


def optimizer():
    sched = optim.schedules.cosine(warmup=3, total=10, floor=0.1)
    return optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=1e-2, schedule=sched))


def test_train_step_has_no_graph_breaks():
    opt = optimizer()
    step = make_train_step(loss_fn, opt, gradients=Gradients(mode="func"))   # the path compile_scope="step" compiles
    explanation = torch._dynamo.explain(step)(init_state(llama.init(CFG), opt), batches(1)[0])
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_schedule_does_not_recompile_and_matches_eager():
    opt = optimizer()
    params = llama.init(CFG, seed=1)
    eager = make_train_step(loss_fn, opt)
    compiled = make_train_step(loss_fn, opt, compile=True)
    s_eager, s_comp = init_state(params, opt), init_state(params, opt)
    before = compile_count()
    lrs = []
    for batch in batches(10):
        s_eager, _ = eager(s_eager, batch)
        s_comp, metrics = compiled(s_comp, batch)
        lrs.append(metrics["lr"].item())
    assert compile_count() - before == 1, "the LR schedule caused a recompile"
    assert len(set(round(lr, 8) for lr in lrs)) == 10  # the LR really changed every step
    assert max_abs_diff(s_eager.params, s_comp.params) < 1e-5


def test_the_step_compiled_whole_through_autograd_equals_the_one_graph():
    """``Gradients(mode="autograd")`` under ``Compile(scope="step")``: the loss a graph of its own, its backward split
    off by AOTAutograd (recomputing cheap activations: the lower peak, docs/benchmarks.md), the update a graph of
    its own; the same training as the one ``torch.func`` graph, donated as the recipes run it."""
    opt = optimizer()
    params = llama.init(CFG, seed=2)
    one_graph = make_train_step(loss_fn, opt, compile=True, donate=True, gradients=Gradients(mode="func"))
    split = make_train_step(loss_fn, opt, compile=True, donate=True, gradients=Gradients(mode="autograd"))
    s_one, s_split = (init_state(tree_map(torch.clone, params), opt) for _ in range(2))   # each donated
    for batch in batches(5):
        s_one, m_one = one_graph(s_one, batch)
        s_split, m_split = split(s_split, batch)
        assert abs(m_one["loss"].item() - m_split["loss"].item()) < 1e-5
    assert max_abs_diff(s_one.params, s_split.params) < 1e-5
