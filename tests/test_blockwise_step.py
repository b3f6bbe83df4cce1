"""The upcycle recipe's blockwise step on the shared pieces (issue 32): the fp16 dynamic loss scale and the non-finite
skip of ``core.update``, donation (``core.donate``) eager and compiled, and resuming a checkpoint written before the
phase's state was ``core.state.TrainState``. A random tiny teacher: these are the step's mechanics, not its quality
(``tests/test_upcycle.py`` trains one)."""
import dataclasses
from collections import namedtuple

import pytest
import torch

from purestep.core.compile import compile_count
from purestep.core.io import checkpoint as ckpt
from purestep.core.state import init_state
from purestep.core.tree import clone, tree_leaves
from purestep.models import blockwise, llama, surgery
from purestep.recipes.train.optimizer import make_optimizer
from purestep.recipes.upcycle import blockwise as bw

TEACHER = llama.LlamaConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)
BLOCKS = bw.Blocks(loss="l1", mode="teacher_forced", match="block", train="attn", ema=0.5, target=0.0, patience=0,
                   min_delta=1e-3)


@pytest.fixture(scope="module")
def models():
    teacher = llama.init(TEACHER, seed=0)
    calib = torch.randint(0, 64, (16, 32), generator=torch.Generator().manual_seed(1))
    student, scfg, _ = surgery.surgery(teacher, TEACHER, calib, sem_dim=2, geo_dim=6, v_dim=8)
    return teacher, student, scfg


def batch(teacher, i: int) -> dict:
    x = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(100 + i))
    inputs, targets = blockwise.teacher_io(teacher, TEACHER, x)
    return {"x": x, "inputs": inputs, "targets": targets}


def optimizer():
    return make_optimizer(bw.optimizer_spec(1e-3, 2, 50))


def same(a, b) -> bool:
    pairs = list(zip(tree_leaves(a), tree_leaves(b)))
    return len(pairs) > 0 and all(torch.equal(x, y) for x, y in pairs if isinstance(x, torch.Tensor))


def test_fp16_scales_the_loss_skips_an_overflow_and_backs_the_scale_off(models):
    """Under fp16 the loss is multiplied by the state's loss scale and the gradients divided by it (the gradient norm
    is the fp32 step's, not 2**16 times it); a scale that overflows the fp16 backward skips the step (student,
    moments and convergence state untouched) and halves the scale, as ``core.step``'s fp16 step does."""
    teacher, student, scfg = models
    opt = optimizer()
    step = bw.make_step(scfg, opt, BLOCKS, precision="fp16")
    state = bw.init_state(clone(student), opt, "attn", scfg.n_layers, precision="fp16")
    assert state.loss_scale["scale"].item() == 2.0 ** 16
    _, m32 = bw.make_step(scfg, opt, BLOCKS)(bw.init_state(clone(student), opt, "attn", scfg.n_layers),
                                             batch(teacher, 0))
    _, m16 = step(state, batch(teacher, 0))
    assert m16["skipped"].item() == 0 and m16["loss_scale"].item() == 2.0 ** 16
    assert m16["grad_norm"].item() == pytest.approx(m32["grad_norm"].item(), rel=5e-2)

    huge = state._replace(loss_scale={**state.loss_scale, "scale": torch.tensor(2.0 ** 80)})
    after, m = step(huge, batch(teacher, 0))
    assert m["skipped"].item() == 1.0 and m["loss_scale"].item() == 2.0 ** 79
    assert same(after.params, huge.params) and same(after.opt_state, huge.opt_state)
    assert same(after.monitor, huge.monitor) and int(after.step) == 1
    for i in range(1, 80):
        if not m["skipped"].item():
            break
        after, m = step(after, batch(teacher, i))
    assert m["skipped"].item() == 0 and m["loss_scale"].item() < 2.0 ** 40 and not same(after.params, huge.params)


def test_a_donated_step_equals_the_pure_one_bitwise_and_writes_into_its_input(models):
    """Eager: three donated steps give the pure steps' states and metrics bit for bit, the new student and moments
    held in the input's tensors; ``owned`` first clones a trained leaf that is the teacher's (here the MLP, with
    ``train=block``), so donation never writes into the teacher."""
    teacher, student, scfg = models
    blocks, opt = dataclasses.replace(BLOCKS, train="block"), optimizer()
    pure, donated = bw.make_step(scfg, opt, blocks), bw.make_step(scfg, opt, blocks, donate=True)
    mine = clone(student)
    aliased = {**mine, "layers": {**mine["layers"], "mlp": teacher["layers"]["mlp"]}}   # equal values, shared
    teacher_mlp = clone(teacher["layers"]["mlp"])
    a = bw.init_state(clone(student), opt, "block", scfg.n_layers)
    b = bw.owned(bw.init_state(aliased, opt, "block", scfg.n_layers), "block", teacher)
    assert b.params["layers"]["mlp"]["w_up"] is not teacher["layers"]["mlp"]["w_up"]
    assert b.params["layers"]["attn"]["wo"] is aliased["layers"]["attn"]["wo"]          # nothing else copied
    buffers = tree_leaves((b.params, b.opt_state))
    for i in range(3):
        a, ma = pure(a, batch(teacher, i))
        b, mb = donated(b, batch(teacher, i))
        assert same(a, b) and same(ma, mb), i
    assert all(x is y for x, y in zip(tree_leaves((b.params, b.opt_state)), buffers))
    assert not same(b.params["layers"]["mlp"], teacher_mlp) and same(teacher["layers"]["mlp"], teacher_mlp)


def test_the_compiled_donated_step_the_recipe_runs_matches_the_eager_step(models):
    """The default path: one graph (compiled once for both steps: the returned state has the input's structure, key
    order included, which the donated graph pairs its leaves by), donated (the new state written into the input's
    buffers), equal to the eager pure step to float tolerance. The student's keys are in another order than the
    surgery's (layers first, attention first in them), as research code may hold them."""
    teacher, student, scfg = models
    opt = optimizer()
    eager = bw.make_step(scfg, opt, BLOCKS)
    compiled = bw.make_step(scfg, opt, BLOCKS, compile=True, donate=True)
    layers = student["layers"]
    reordered = {"layers": {"attn": layers["attn"], **{k: v for k, v in layers.items() if k != "attn"}},
                 **{k: v for k, v in student.items() if k != "layers"}}
    assert list(reordered) != list(student) and list(reordered["layers"]) != list(layers)
    a = bw.init_state(clone(student), opt, "attn", scfg.n_layers)
    b = bw.owned(bw.init_state(clone(reordered), opt, "attn", scfg.n_layers), "attn", teacher)
    buffers, graphs = tree_leaves((b.params, b.opt_state)), compile_count()
    for i in range(2):
        a, ma = eager(a, batch(teacher, i))
        b, mb = compiled(b, batch(teacher, i))
        assert torch.allclose(ma["block_loss"], mb["block_loss"], rtol=1e-5, atol=1e-7), i
    assert compile_count() - graphs == 1
    assert all(x is y for x, y in zip(tree_leaves((b.params, b.opt_state)), buffers))
    for x, y in zip(tree_leaves((a.params, a.opt_state, a.monitor)), tree_leaves((b.params, b.opt_state, b.monitor))):
        assert torch.allclose(x.float(), y.float(), rtol=1e-4, atol=1e-6)


def test_a_checkpoint_written_before_resumes_and_another_runs_is_refused_in_one_line(models, tmp_path):
    """A checkpoint of the phase's former state (step, params, opt_state, cursor, conv) resumes into the
    ``TrainState`` (its convergence state as ``monitor["blocks"]``); another run's checkpoint is one line naming it."""
    teacher, student, scfg = models
    opt = optimizer()
    step = bw.make_step(scfg, opt, BLOCKS)
    state, _ = step(bw.init_state(clone(student), opt, "attn", scfg.n_layers), batch(teacher, 0))
    former = namedtuple("BlockwiseState", "step params opt_state cursor conv")
    ckpt.save(tmp_path / "step_1.msgpack", former(state.step, state.params, state.opt_state, state.cursor,
                                                   bw.convergence(state)), step=1)
    fresh = bw.init_state(clone(student), opt, "attn", scfg.n_layers)
    got = bw.restore(tmp_path / "step_1.msgpack", fresh, fresh)
    assert same(got, state)
    assert same(step(got, batch(teacher, 1)), step(state, batch(teacher, 1)))
    ckpt.save(tmp_path / "other.msgpack", init_state({"w": torch.zeros(3)}, opt), step=0)
    with pytest.raises(ckpt.CheckpointError, match="not a blockwise checkpoint of this run") as e:
        bw.restore(tmp_path / "other.msgpack", fresh, fresh)
    assert "other.msgpack" in str(e.value) and "\n" not in str(e.value)


def test_a_sharded_rank_resumes_its_cut_of_a_blockwise_checkpoint(models, tmp_path):
    """Under fsdp each rank restores its own cut of the phase's checkpoint (``layout``: read box by box, not made
    whole), bit for bit the cut of the whole restored state."""
    from purestep.core.parallel.shard import Layout
    from purestep.optim.health import stacked_predicate
    teacher, student, scfg = models
    opt = optimizer()
    state, _ = bw.make_step(scfg, opt, BLOCKS)(bw.init_state(clone(student), opt, "attn", scfg.n_layers),
                                               batch(teacher, 0))
    ckpt.save(tmp_path / "step_1.msgpack", state, step=1)
    fresh = bw.init_state(clone(student), opt, "attn", scfg.n_layers)
    for rank in range(3):
        layout = Layout(student, lambda p: opt.init(bw.split(p, "attn")[0]), stacked=stacked_predicate(None),
                        world=3, rank=rank)
        assert same(bw.restore(tmp_path / "step_1.msgpack", fresh, fresh, layout=layout), layout.shard(state))
