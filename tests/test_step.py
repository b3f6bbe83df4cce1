"""The pure train step: overfitting, the nn.Module bridge, both gradient paths, accumulation, skipping."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from purestep import optim
from purestep.core.module import from_module
from purestep.core.state import init_state
from purestep.core.step import Compile, Gradients, make_eval_step, make_train_step
from purestep.core.tree import flatten_dict, max_abs_diff, tree_map
from purestep.models import llama

TINY = llama.LlamaConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)


def batch_of(cfg, b, t, seed=0):
    tok = torch.randint(0, cfg.vocab_size, (b, t + 1), generator=torch.Generator().manual_seed(seed))
    return {"x": tok[:, :-1], "y": tok[:, 1:]}


def test_overfits_one_batch():
    batch = batch_of(TINY, 16, 32)
    opt = optim.adamw(lr=1e-2, weight_decay=0.0)
    step = make_train_step(lambda p, b: llama.loss(p, b, TINY), opt)
    state = init_state(llama.init(TINY, seed=0), opt)
    losses = []
    for _ in range(200):
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
        if losses[-1] < 0.1:
            break
    first, last = losses[0].item(), losses[-1].item()
    assert abs(first - math.log(TINY.vocab_size)) < 0.1 * math.log(TINY.vocab_size)
    assert last < 0.1, f"loss {last:.3f} after {len(losses)} steps"
    assert state.step.item() == len(losses) and state.cursor.item() == len(losses)


class UserGPT(nn.Module):
    """Somebody's own model: learned positions, LayerNorm with bias, a tied output head, GELU MLP."""

    def __init__(self, vocab=40, d=32, t=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(t, d)
        self.ln = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        h = h + self.scale * self.mlp(self.ln(h))
        return self.head(h)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-6)])
def test_from_module_matches_backward_and_torch_adamw(dtype, tol):
    """Same trajectory as ``.backward()`` + ``torch.optim.AdamW``; fp32 tolerance relative to |w|."""
    torch.manual_seed(0)
    module = UserGPT().to(dtype)
    params, apply = from_module(module)
    assert "head" not in params and "wte" in params  # the tie is listed once

    def loss_fn(p, b):
        return F.cross_entropy(apply(p, b["x"]).flatten(0, 1), b["y"].flatten())

    opt = optim.adamw(lr=1e-2, weight_decay=0.1, mask=None)
    step = make_train_step(loss_fn, opt)
    state = init_state(params, opt)
    ref = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(15):
        tok = torch.randint(0, 40, (4, 17), generator=g)
        batch = {"x": tok[:, :-1], "y": tok[:, 1:]}
        state, metrics = step(state, batch)
        ref.zero_grad()
        ref_loss = F.cross_entropy(module(batch["x"]).flatten(0, 1), batch["y"].flatten())
        ref_loss.backward()
        ref.step()
        assert abs(metrics["loss"].item() - ref_loss.item()) <= tol * max(1.0, ref_loss.item())
    trained = {n: p.detach() for n, p in module.named_parameters()}
    for name, value in flatten_dict(state.params).items():
        err = ((value - trained[name]).abs() / trained[name].abs().clamp(min=1.0)).max().item()
        assert err <= tol, (name, err)


def loss_fn(p, b):
    return llama.loss(p, b, TINY)


def test_autograd_path_equals_func_path():
    """SGD (linear in the gradients) so the comparison measures gradients, not Adam's sign-like amplification."""
    batch = batch_of(TINY, 4, 16)
    opt = optim.sgd(lr=0.5, momentum=0.9)
    params = llama.init(TINY, seed=3)
    a = make_train_step(loss_fn, opt, gradients=Gradients(mode="func"))
    b = make_train_step(loss_fn, opt, gradients=Gradients(mode="autograd"))
    sa, sb = init_state(params, opt), init_state(params, opt)
    for _ in range(3):
        sa, ma = a(sa, batch)
        sb, mb = b(sb, batch)
    assert max_abs_diff(sa.params, sb.params) < 1e-6
    assert abs(ma["grad_norm"].item() - mb["grad_norm"].item()) < 1e-5


def test_grad_accum_equals_big_batch():
    big = batch_of(TINY, 16, 16, seed=9)
    micro = tree_map(lambda t: t.reshape(4, 4, *t.shape[1:]), big)
    opt = optim.sgd(lr=0.5, momentum=0.9)
    params = llama.init(TINY, seed=5)
    one = make_train_step(loss_fn, opt)
    acc = make_train_step(loss_fn, opt, gradients=Gradients(accum=4))
    s1, m1 = one(init_state(params, opt), big)
    s4, m4 = acc(init_state(params, opt), micro)
    assert abs(m1["loss"].item() - m4["loss"].item()) < 1e-6
    assert max_abs_diff(s1.params, s4.params) < 1e-6


def test_nonfinite_loss_never_reaches_params():
    opt = optim.adamw(lr=1e-2)
    state = init_state(llama.init(TINY), opt)

    def poisoned(p, b):
        return llama.loss(p, b, TINY) * b["poison"]

    step = make_train_step(poisoned, opt)
    batch = batch_of(TINY, 2, 8)
    good, m = step(state, {**batch, "poison": torch.tensor(1.0)})
    assert m["skipped"].item() == 0.0 and max_abs_diff(good.params, state.params) > 0
    bad, m = step(good, {**batch, "poison": torch.tensor(float("nan"))})
    assert m["skipped"].item() == 1.0
    assert max_abs_diff(bad.params, good.params) == 0.0
    assert max_abs_diff(bad.opt_state, good.opt_state) == 0.0
    assert bad.step.item() == good.step.item() + 1  # the batch was consumed


def test_param_norm_is_the_norm_of_the_params_the_step_keeps():
    """After the update (one pass with it), and the old params' norm on a skipped step."""
    opt = optim.adamw(lr=1e-2)
    step = make_train_step(lambda p, b: llama.loss(p, b, TINY) * b["poison"], opt)
    state = init_state(llama.init(TINY), opt)

    def norm(params):
        return math.sqrt(sum(float((t.double() ** 2).sum()) for t in flatten_dict(params).values()))
    batch = batch_of(TINY, 2, 8)
    new, m = step(state, {**batch, "poison": torch.tensor(1.0)})
    assert m["param_norm"].item() == pytest.approx(norm(new.params), rel=1e-6)
    assert abs(norm(new.params) - norm(state.params)) > 1e-4   # so the test tells the two apart
    kept, m = step(new, {**batch, "poison": torch.tensor(float("nan"))})
    assert m["param_norm"].item() == pytest.approx(norm(new.params), rel=1e-6)


def test_eval_step_equals_loss():
    params = llama.init(TINY)
    batch = batch_of(TINY, 2, 8)
    metrics = make_eval_step(loss_fn)(params, batch)
    assert torch.equal(metrics["loss"], llama.loss(params, batch, TINY))


def test_the_library_keeps_at_most_two_compiler_branches():
    """What a function computes does not depend on whether it is traced: ``torch.compiler.is_compiling()`` is
    asked in two places of core/ and optim/ only, each for a reason it states (a compiled block called inside a
    whole-step graph is traced through; ``foreach.add_scaled``'s one-pass eager form reads a 0-d tensor on the
    host, which a graph cannot)."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    found = sorted(f"{p.relative_to(root)}:{i}" for d in ("core", "optim") for p in (root / d).rglob("*.py")
                   for i, line in enumerate(p.read_text().splitlines(), 1)
                   if "is_compiling()" in line and "``" not in line)
    assert [f.split(":")[0] for f in found] == ["core/compile.py", "optim/foreach.py"], found


def test_apply_gradients_compiles_whole_and_runs_eagerly_through_the_same_code():
    """``core.update.apply_gradients`` under ``torch.compile(fullgraph=True)`` (no graph break, no host sync) gives
    the eager call's new state and metrics, a non-finite step's skip included."""
    from purestep.core.update import apply_gradients
    opt = optim.chain(optim.clip_by_global_norm(0.1), optim.adamw(lr=1e-2))
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=g), "norm": torch.randn(3, generator=g)}
    state = init_state(params, opt)
    grads = tree_map(lambda p: torch.randn(p.shape, generator=g), params)

    def apply(state, grads, loss):
        return apply_gradients(state, grads, opt, loss=loss)

    compiled = torch.compile(apply, fullgraph=True, dynamic=False)
    for loss in (torch.tensor(2.0), torch.tensor(float("nan"))):
        (eager, em), (graph, gm) = apply(state, grads, loss), compiled(state, grads, loss)
        assert max_abs_diff(eager.params, graph.params) < 1e-6
        assert max_abs_diff(eager.opt_state, graph.opt_state) < 1e-6
        assert all(torch.allclose(em[k], gm[k], equal_nan=True) for k in em)


def test_make_train_step_takes_at_most_eight_parameters():
    """The composition stays small: the rest is grouped (Gradients, Compile, Monitors, Parallel)."""
    import inspect
    assert len(inspect.signature(make_train_step).parameters) <= 8


def test_the_public_pieces_compose_into_make_train_steps_step():
    """A step composed by hand from the public pieces (``core.gradients``' objective and engine, ``averaged``,
    ``core.update.apply_gradients``) equals ``make_train_step``'s bitwise, on both engines."""
    from purestep.core import rng
    from purestep.core.gradients import autograd_gradients, averaged, func_gradients, loss_caller, make_objective
    from purestep.core.update import apply_gradients
    batch = batch_of(TINY, 4, 16)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=1e-2))
    loss = lambda p, b: llama.loss(p, b, TINY)   # noqa: E731
    objective = make_objective(loss_caller(loss), 1, "fp32", "cpu")
    for mode, engine in (("func", func_gradients(objective, 1)), ("autograd", autograd_gradients(objective, 1))):
        state = init_state(llama.init(TINY, seed=0), opt)
        key, scale = rng.fold_in(state.key, state.step), torch.ones(())
        grads, value, aux = averaged(None)(*engine(state.params, batch, key, None, scale))
        by_hand, mine = apply_gradients(state, grads, opt, loss=value, aux=aux)
        composed, theirs = make_train_step(loss, opt, gradients=Gradients(mode=mode))(state, batch)
        assert max_abs_diff(by_hand.params, composed.params) == 0 and max_abs_diff(by_hand.opt_state,
                                                                                  composed.opt_state) == 0
        assert {k: v.item() for k, v in mine.items()} == {k: v.item() for k, v in theirs.items()}


@pytest.mark.parametrize("gradients,compile", [(Gradients(mode="func", remat=True), False),
                                               (Gradients(mode="func"), Compile(scope="block"))])
def test_the_func_engine_refuses_what_it_cannot_run(gradients, compile):
    """``torch.func.grad`` takes neither activation checkpointing nor a compiled region: asked for either, the step
    says so rather than differentiating another way."""
    with pytest.raises(ValueError, match="Gradients\\(mode='func'\\) cannot run with"):
        make_train_step(loss_fn, optim.sgd(lr=0.1), compile=compile, gradients=gradients)
