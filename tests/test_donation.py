"""Buffer donation (``make_train_step(donate=True)``, ``core.donate``) and regional compilation
(``compile_scope="block"``, ``core.compile.BlockCompiler``): the same numbers as the pure, uncompiled step.

Eager donated steps equal pure ones bitwise; compiled donated steps equal compiled pure ones within 1e-6, and
with AdaGC (whose gamma reads its step count) eager ones. The skip on a non-finite loss leaves
the donated params and optimizer state as they were. A state that shares storage with the frozen inputs
is copied before anything is written. The block graph's gradients equal eager ``torch.func``'s to 1e-6,
and a deeper model of the same width compiles nothing new.
"""
import math

import pytest
import torch

from purestep import optim
from purestep.core.compile import BlockCompiler, compile_count
from purestep.core.donate import owned
from purestep.core.layers import Layers
from purestep.core.spike import SpikeConfig
from purestep.core.state import init_state
from purestep.core.step import Compile, make_train_step
from purestep.core.tree import clone, leaves_of, max_abs_diff, tree_flatten, tree_map, tree_unflatten
from purestep.models import llama
from purestep.optim.health import GradientHealth, computed
from purestep.optim.swats import swats
from purestep.core.update import Monitors

CFG = llama.LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


def loss_fn(p, b, layers=None):
    """Cross entropy times ``b["poison"]`` (1, or NaN for the step that must be skipped)."""
    return llama.loss(p, b, CFG, layers=layers) * b["poison"]


def batches(n, poisoned=()):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        tok = torch.randint(0, CFG.vocab_size, (4, 17), generator=g)
        out.append({"x": tok[:, :-1], "y": tok[:, 1:], "poison": torch.tensor(math.nan if i in poisoned else 1.0)})
    return out


def optimizer():
    return optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=1e-2, weight_decay=0.1))


def run(step, state, data):
    for batch in data:
        state, metrics = step(state, batch)
    return state, metrics


OPTIMIZERS = {"adamw": optimizer, "lion": lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.lion(lr=1e-3)),
              "sgd": lambda: optim.sgd(lr=1e-2, momentum=0.9),
              "swats": lambda: optim.chain(optim.clip_by_global_norm(1.0), swats(lr=1e-2, switch_eps=1.0))}


@pytest.mark.parametrize("name,health,dtype", [("adamw", True, torch.float32), ("adamw", 3, torch.float32),
                                               ("adamw", False, torch.float32),
                                               ("adamw", False, torch.bfloat16), ("lion", False, torch.float32),
                                               ("sgd", False, torch.float32), ("swats", False, torch.float32)])
def test_donated_eager_steps_equal_pure_bitwise_in_the_same_buffers(name, health, dtype):
    """The eager donated step computes the pure step's new state and copies it into the buffers it was given, with
    and without health statistics (``every=3``: only on the steps they are due), for bf16 leaves too."""
    opt, params = OPTIMIZERS[name](), tree_map(lambda p: p.to(dtype), llama.init(CFG, seed=1))
    extra = GradientHealth(params, clip_norm=1.0, every=None if health is True else health) if health else None
    kw = dict(monitors=Monitors(extra_metrics=extra, spike=SpikeConfig()))
    pure = make_train_step(loss_fn, opt, **kw)
    donated = make_train_step(loss_fn, opt, donate=True, **kw)
    start = init_state(clone(params), opt, spike=True)
    buffers = [t.data_ptr() for t in leaves_of((start.params, start.opt_state))]
    data = batches(20, poisoned={7})
    a, ma = run(pure, init_state(clone(params), opt, spike=True), data)
    b, mb = run(donated, start, data)
    assert [t.data_ptr() for t in leaves_of((b.params, b.opt_state))] == buffers
    assert all(torch.equal(x, y) for x, y in zip(leaves_of(a), leaves_of(b)))
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_transform_is_pure_whatever_runs_it(name):
    """optax's ``update(updates, state, params)`` and nothing more: no keyword for donation, norms or the compiler;
    it writes into nothing it was given (the inputs keep their bits, the outputs share no storage with them), so
    donation is the step's wrapper alone (``core.donate.donate``)."""
    import inspect
    opt, params = OPTIMIZERS[name](), llama.init(CFG, seed=8)
    assert list(inspect.signature(opt.update).parameters) == ["updates", "state", "params"]
    assert opt._fields == ("init", "update", "metrics")
    g = torch.Generator().manual_seed(8)
    grads = tree_map(lambda p: torch.randn(p.shape, generator=g), params)
    state = opt.init(params)
    before = clone((grads, state, params))
    updates, new_state = opt.update(grads, state, params)
    assert all(torch.equal(x, y) for x, y in zip(leaves_of(before), leaves_of((grads, state, params))))
    mine = {t.data_ptr() for t in leaves_of(updates) + leaves_of(new_state) if t.numel() > 1}
    assert not mine & {t.data_ptr() for t in leaves_of((grads, state, params)) if t.numel() > 1}


def test_a_non_finite_step_leaves_the_donated_state_unchanged():
    opt = optimizer()
    step = make_train_step(loss_fn, opt, donate=True)
    state, _ = run(step, init_state(llama.init(CFG, seed=2), opt), batches(3))
    before = clone((state.params, state.opt_state))
    state, metrics = step(state, batches(1, poisoned={0})[0])
    assert metrics["skipped"].item() == 1.0 and int(state.step) == 4
    assert all(torch.equal(x, y) for x, y in zip(leaves_of(before), leaves_of((state.params, state.opt_state))))


def test_donation_never_writes_into_the_frozen_inputs():
    """A student whose leaf is the teacher's tensor (or a view of it) gets its own copy first."""
    opt = optimizer()
    teacher = llama.init(CFG, seed=3)
    student = {**clone(teacher), "embed": teacher["embed"], "norm": teacher["layers"]["mlp_norm"][0]}
    kept = clone(teacher)
    state = init_state(student, opt)
    assert owned(state, teacher) is not state and owned(init_state(clone(teacher), opt), teacher) is not None

    def kd(p, b, frozen):
        return loss_fn(p, b) + 0 * llama.loss(frozen, b, CFG)

    step = make_train_step(kd, opt, donate=True)
    state, _ = step(state, batches(1)[0], teacher)
    assert all(torch.equal(x, y) for x, y in zip(leaves_of(kept), leaves_of(teacher)))
    assert not torch.equal(state.params["embed"], teacher["embed"])


def _gradients(params, batch, compiler: BlockCompiler):
    leaves, spec = tree_flatten(params)
    live = [p.detach().requires_grad_() for p in leaves]
    loss = llama.loss(tree_unflatten(spec, live), batch, CFG, layers=Layers(block=compiler, head=compiler))
    return torch.autograd.grad(loss, live)


def test_the_compiled_block_gives_eager_gradients_and_depth_compiles_nothing_new():
    """The block compiled from outside the model (its compiler handed to it as ``layers``), one graph for every
    layer, and the loss tail (final norm, head, cross entropy) one more, held by the compiler: a deeper model of the
    same width calls the same ones."""
    params, batch = llama.init(CFG, seed=4), batches(1)[0]
    reference = torch.func.grad(lambda p: llama.loss(p, batch, CFG))(params)
    compiler = BlockCompiler()
    grads = _gradients(params, batch, compiler)
    assert list(compiler.compiled) == [llama.block, llama.head_loss]
    assert max(float((g - r).abs().max()) for g, r in zip(grads, leaves_of(reference))) < 1e-6
    deeper = llama.init(llama.LlamaConfig(**{**vars(CFG), "n_layers": 5}), seed=5)
    before = compile_count()
    _gradients(deeper, batch, compiler)
    assert compile_count() == before, "a deeper model of the same width recompiled the block or the loss tail"


def test_a_block_scope_step_needs_a_loss_that_takes_layers():
    """The block is compiled from outside the model, through the loss's ``layers``: a loss without it is refused
    rather than silently run uncompiled."""
    with pytest.raises(ValueError, match="'layers' keyword"):
        make_train_step(lambda p, b: llama.loss(p, b, CFG), optimizer(), compile=Compile(scope="block"))


def test_compiled_donated_steps_match_the_pure_compiled_step(one_thread):
    """Twenty compiled steps (one of them skipped), donated and pure, to 1e-6: donation changes no number. The
    default scope, the one graph; the block scope's donated update graph: ``test_compiled_donated_adagc_equals_eager``.

    The two are different graphs, so inductor may split a reduction differently between them; on one thread
    they agree to 1e-6 after 20 AdamW steps at lr 1e-2 (on two threads this CPU drifted to 2e-6)."""
    opt, params = optimizer(), llama.init(CFG, seed=6)
    data = batches(20, poisoned={5})
    health = GradientHealth(params, clip_norm=1.0, every=4)   # due on 1, 4, 8, ..., 20
    results = []
    for donate in (False, True):
        step = make_train_step(loss_fn, opt, compile=True, donate=donate,
                               monitors=Monitors(extra_metrics=health))
        results.append(run(step, init_state(clone(params), opt), data))
    (pure, pure_metrics), (donated, metrics) = results
    assert int(donated.step) == 20
    assert max_abs_diff(pure.params, donated.params) < 1e-6
    assert max_abs_diff(pure.opt_state, donated.opt_state) < 1e-6
    assert computed(metrics["health"])
    torch.testing.assert_close(metrics["health"], pure_metrics["health"], rtol=1e-4, atol=1e-6)
    assert not computed(step(donated, data[0])[1]["health"])          # step 21 (the donated step's graph)


def test_inductor_foreach_copy_into_inputs_still_reads_an_overwritten_destination():
    """The inductor defect ``core.donate.write_into`` steps around (torch 2.13, CPU), standalone: ``_foreach_copy_``
    is lowered as every copy's loader built first, then the destinations written one by one, so ``gamma``'s new
    value, which reads ``count``'s old one through an unrealized pointwise, is computed after ``count`` was
    written. Eager gives ``(1, 2.0)``, compiled ``(1, 3.0)``; with two ``copy_`` calls it compiles correctly (lowering
    a ``copy_`` realizes the old value's readers before the write: ``GraphLowering.mark_buffer_mutated``)."""
    def update(count, limit, gamma):
        c = count + 1
        torch._foreach_copy_([count, gamma], [c, torch.where(c <= limit, 2.0, 3.0)])

    count, limit, gamma = torch.tensor(0), torch.tensor(1), torch.tensor(0.0)
    torch.compile(update, fullgraph=True)(count, limit, gamma)
    assert (count.item(), gamma.item()) == (1, 3.0), \
        "inductor now compiles this right: write_into may go back to one _foreach_copy_ in graphs too"


def test_compiled_donated_adagc_equals_eager(one_thread):
    """AdaGC's new gamma reads its step count (warm-up or not) and is written into the state after that count:
    the donated graph must read the old count (it read the new one: 8.5e-3 in params after 3 AdamW steps on a
    toy). Two warm-up steps, then per-tensor clipping, one step skipped; SGD, as AdamW's first steps magnify
    rounding (compiled and eager AdamW differ by 1e-5 here, pure or donated)."""
    opt, params = optim.chain(optim.adagc(t_start=2), optim.sgd(lr=1e-2, momentum=0.9)), llama.init(CFG, seed=7)
    data = batches(5, poisoned={3})
    eager = run(make_train_step(loss_fn, opt), init_state(clone(params), opt), data)[0]
    step = make_train_step(loss_fn, opt, compile=Compile(scope="block"), donate=True)   # the update's graph
    donated = run(step, init_state(clone(params), opt), data)[0]
    assert int(donated.step) == 5 and int(donated.opt_state[0].count) == 4
    assert max_abs_diff(eager.params, donated.params) < 1e-6
    assert max_abs_diff(eager.opt_state, donated.opt_state) < 1e-6
