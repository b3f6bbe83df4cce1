"""Stacked leaves' gradients written layer by layer (``core.row_grads``): ``unbind``'s numbers to the bit, with
micro-batches and remat, while no layer's gradient outlives its landing."""
import pytest
import torch

from purestep.core.layers import Layers
from purestep.core.row_grads import RowGradients
from purestep.core.gradients import autograd_gradients, loss_caller, make_objective
from purestep.core import rng
from purestep.core.tree import leaves_of, named_leaves, tree_flatten, tree_map, tree_unflatten
from purestep.models import llama

CFG = llama.LlamaConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64)


def batches(grad_accum):
    tok = torch.randint(0, CFG.vocab_size, (grad_accum, 4, 17), generator=torch.Generator().manual_seed(0))
    return {"x": tok[..., :-1], "y": tok[..., 1:]}


@pytest.mark.parametrize("grad_accum,remat", [(1, False), (2, False), (2, True)])
def test_row_gradients_equal_unbind_bitwise(grad_accum, remat):
    params = llama.init(CFG, seed=1)
    batch = batches(grad_accum) if grad_accum > 1 else tree_map(lambda t: t[0], batches(1))
    objective = make_objective(loss_caller(lambda p, b, layers: llama.loss(p, b, CFG, remat=remat, layers=layers)),
                                grad_accum, "fp32", "cpu")
    scale = torch.ones(())
    got = [autograd_gradients(objective, grad_accum, by_row=by_row)(params, batch, rng.key(0), None,
                                                                     scale)
           for by_row in (True, False)]
    assert all(torch.equal(a, b) for a, b in zip(leaves_of(got[0][0]), leaves_of(got[1][0])))
    assert torch.equal(got[0][1], got[1][1])


def test_stacked_leaves_land_by_row_and_the_others_whole():
    """Every stacked leaf's gradient is written by rows (none flows to the whole leaf); the leaves the model reads
    whole (the embedding, the final norm) get theirs from autograd."""
    params = llama.init(CFG, seed=2)
    leaves, spec = tree_flatten(params)
    rows = RowGradients([p.detach().requires_grad_() for p in leaves])
    loss = llama.loss(tree_unflatten(spec, rows.live), tree_map(lambda t: t[0], batches(1)), CFG,
                      layers=Layers(unstack=rows.unstack))
    rows.backward(loss)
    stacked = [k for k, (name, _) in enumerate(named_leaves(params)) if name.startswith("layers.")]
    assert stacked and all(rows.stacked[k] is not None and rows.direct[k] is None for k in stacked)
    assert all(rows.stacked[k] is None and rows.direct[k] is not None for k in range(len(leaves)) if k not in stacked)
    assert all(g.shape == p.shape for g, p in zip(rows.gradients(), leaves))
