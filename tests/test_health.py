"""Gradient health statistics: packed values against per-tensor loops, NaN localization, zero-gradient report."""
import math

import pytest
import torch

from purestep import optim
from purestep.core.compile import compile_count
from purestep.core.state import init_state
from purestep.core.step import make_train_step
from purestep.core.tree import named_leaves, tree_map
from purestep.models import llama
from purestep.optim.health import COLUMNS, GradientHealth, computed
from purestep.core.update import Monitors

CFG = llama.LlamaConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2, ffn_dim=32)


def setup(seed=0):
    params = llama.init(CFG, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    grads = tree_map(lambda p: torch.randn(p.shape, generator=g) * 1e-2, params)
    new_params = tree_map(lambda p, d: p - 0.1 * d, params, grads)
    return params, grads, new_params


def loop_reference(params, grads, new_params):
    """The naive way: one slice at a time, one statistic at a time."""
    rows, names = [], []
    for (name, g), (_, w), (_, nw) in zip(named_leaves(grads), named_leaves(params), named_leaves(new_params)):
        parts = [(f"{name}[{i}]", g[i], w[i], nw[i]) for i in range(g.shape[0])] \
            if name.startswith("layers.") else [(name, g, w, nw)]
        for label, gs, ws, nws in parts:
            gn, wn = torch.linalg.norm(gs.flatten()), torch.linalg.norm(ws.flatten())
            rows.append([float((~torch.isfinite(gs)).sum()), float(gn == 0), float(gn), float(gn / wn),
                         float(torch.linalg.norm((nws - ws).flatten()) / wn)])
            names.append(label)
    return names, torch.tensor(rows, dtype=torch.float64)


def test_packed_matches_per_tensor_loops():
    params, grads, new_params = setup()
    health = GradientHealth(params, clip_norm=1.0)
    packed = health.metrics(grads=grads, updates=None, params=params, new_params=new_params)["health"]
    names, want = loop_reference(params, grads, new_params)
    assert packed.dtype == torch.float32 and packed.shape == (len(names) + 1, len(COLUMNS))
    assert health.layout == names + ["global"]
    assert "layers.attn.wq[2]" in health.layout and "embed" in health.layout
    torch.testing.assert_close(packed[:-1].double(), want, rtol=1e-5, atol=0)
    g_all = torch.cat([g.flatten() for g in optim.base.tree_leaves(grads)])
    w_all = torch.cat([w.flatten() for w in optim.base.tree_leaves(params)])
    d_all = torch.cat([(n - w).flatten() for n, w in zip(optim.base.tree_leaves(new_params),
                                                          optim.base.tree_leaves(params))])
    glob = health.global_stats(packed)
    assert glob["grad_norm"] == pytest.approx(float(g_all.norm()), rel=1e-5)
    assert glob["grad_to_weight"] == pytest.approx(float(g_all.norm() / w_all.norm()), rel=1e-5)
    assert glob["update_to_weight"] == pytest.approx(float(d_all.norm() / w_all.norm()), rel=1e-5)
    assert glob["nonfinite"] == 0 and glob["zero"] == 0

    scalars = health.to_scalars(packed)
    assert scalars["health/grad_norm/layers.attn.wq/2"] == pytest.approx(float(grads["layers"]["attn"]["wq"][2].norm()),
                                                                         rel=1e-5)
    assert scalars["health/grad_norm/embed"] == pytest.approx(float(grads["embed"].norm()), rel=1e-5)
    assert scalars["health/clip/ratio"] == pytest.approx(glob["grad_norm"])
    assert scalars["health/clip/clipped"] == 0.0
    assert len(scalars) == len(health.layout) * len(COLUMNS) + 2
    hist = health.histograms(packed)
    assert set(hist) == {f"health/{c}" for c in COLUMNS}
    assert hist["health/grad_norm"].shape == (len(names),)
    assert health.report(packed) == []


def test_nan_in_one_layer_slice_is_found_by_name():
    params, grads, new_params = setup()
    grads["layers"]["mlp"]["w_up"][1, 3, 2] = float("nan")
    grads["layers"]["mlp"]["w_up"][1, 0, 0] = float("inf")
    health = GradientHealth(params)
    packed = health.metrics(grads=grads, params=params, new_params=new_params)["health"]
    nonfinite = packed[:, 0]
    row = health.layout.index("layers.mlp.w_up[1]")
    assert nonfinite[row] == 2 and nonfinite.sum() == 2 + 2       # the slice, and the global row
    assert nonfinite[-1] == 2
    assert math.isnan(float(packed[row, 2])) and math.isfinite(float(packed[row + 1, 2]))
    assert health.report(packed) == [("layers.mlp.w_up[1]", "2 non-finite gradient values")]
    hist = health.histograms(packed)                              # the NaN row is left out of the norms
    assert hist["health/grad_norm"].shape == (len(health.layout) - 2,)


def test_first_step_report_names_an_unused_parameter():
    params = llama.init(CFG, seed=0)
    params["unused"] = torch.ones(4)                               # the loss never reads it
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=1e-3))
    health = GradientHealth(params, clip_norm=1.0)
    step = make_train_step(lambda p, b: llama.loss(p, b, CFG), opt, monitors=Monitors(extra_metrics=health.metrics))
    tok = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    state, metrics = step(init_state(params, opt), {"x": tok[:, :-1], "y": tok[:, 1:]})
    packed = metrics["health"]
    assert packed.shape == (len(health.layout), len(COLUMNS))
    assert health.report(packed) == [("unused", "gradient is exactly zero")]


def test_a_stacked_leaf_zero_in_every_layer_is_named_once():
    params, grads, new_params = setup()
    grads["layers"]["attn"]["wk"].zero_()
    grads["layers"]["attn"]["wv"][0].zero_()
    health = GradientHealth(params)
    packed = health.metrics(grads=grads, params=params, new_params=new_params)["health"]
    assert health.report(packed) == [("layers.attn.wk", "gradient is exactly zero in all 3 layers"),
                                     ("layers.attn.wv[0]", "gradient is exactly zero")]


def test_health_traces_into_one_graph():
    torch._dynamo.reset()
    params, grads, new_params = setup()
    health = GradientHealth(params)
    fn = torch.compile(health.metrics, backend="eager", fullgraph=True, dynamic=False)
    packed = fn(grads=grads, params=params, new_params=new_params)["health"]
    assert compile_count() >= 1
    torch.testing.assert_close(packed, health.metrics(grads=grads, params=params, new_params=new_params)["health"])


def test_bad_packed_shape_is_an_error():
    params, _, _ = setup()
    with pytest.raises(ValueError, match="expected"):
        GradientHealth(params).report(torch.zeros(3, 5))


def test_a_column_with_no_finite_value_has_no_histogram():
    params, grads, new_params = setup()
    grads = {k: v for k, v in grads.items()}
    health = GradientHealth(params)
    packed = health.metrics(grads=grads, params=params, new_params=new_params)["health"].clone()
    packed[:, COLUMNS.index("grad_norm")] = float("nan")           # a diverged step: every norm is NaN
    hist = health.histograms(packed)
    assert "health/grad_norm" not in hist and hist                  # the others are still there


def test_with_every_only_due_steps_compute_the_statistics():
    """Due: the multiples of ``every`` and the first step (asked on the host with an int, in a graph with a tensor);
    the others skip the per-leaf work and return -1 everywhere, as :meth:`skipped` does. The due ones equal the
    ungated statistics, eagerly and traced (``torch.cond``)."""
    params, grads, new_params = setup()
    full = GradientHealth(params).metrics(grads=grads, params=params, new_params=new_params)["health"]
    health = GradientHealth(params, every=4)
    traced = torch.compile(health.metrics, backend="eager", fullgraph=True)
    assert torch.equal(health.skipped(torch.device("cpu"))["health"], torch.full_like(full, -1))
    for step, due in [(1, True), (2, False), (4, True), (5, False), (8, True)]:
        assert health.due(step) is due
        for fn in (health.metrics, traced):
            packed = fn(grads=grads, params=params, new_params=new_params, step=torch.tensor(step))["health"]
            assert computed(packed) == due and packed.shape == full.shape
            assert torch.equal(packed, full) if due else bool((packed == -1).all())


def test_the_loop_logs_the_newest_computed_statistics_at_their_own_step():
    """``recipes.train.metrics.pull``: at a log step that was not due (a run's last step) the interval's newest
    computed statistics, and how many steps before the last they came from; none when the interval has none."""
    from purestep.recipes.train.metrics import pull
    params, grads, new_params = setup()
    health = GradientHealth(params, every=4)
    done = health.metrics(grads=grads, params=params, new_params=new_params)["health"]
    skipped = health.skipped(torch.device("cpu"))["health"]
    pending = [{"loss": torch.tensor(2.0), "health": h} for h in (skipped, done, skipped, skipped)]
    values, packed, age, skips = pull(pending)
    assert values["loss"] == 2.0 and torch.equal(packed, done) and age == 2 and skips == []   # no "skipped" metric
    assert pull(pending[2:])[1:] == (None, 0, [])


def test_the_host_knows_the_step_count_without_reading_the_device(monkeypatch):
    """A step that asks ``due`` on the host reads ``state.step`` once for a state it did not return (a fresh,
    resumed or rolled-back one) and never for the one it returned; health is still due where it should be."""
    from purestep.core.step import HostDue
    reads = []
    monkeypatch.setattr(HostDue, "read", staticmethod(lambda step: reads.append(1) or int(step)))
    params, opt = llama.init(CFG, seed=0), optim.adamw(1e-3)
    health = GradientHealth(params, every=3)
    step = make_train_step(lambda p, b: llama.apply(p, b, CFG).logsumexp(-1).mean(), opt, donate=True,
                           monitors=Monitors(extra_metrics=health))
    tokens, state, seen = torch.randint(0, 32, (2, 8)), init_state(params, opt), []
    for _ in range(7):
        state, metrics = step(state, tokens)
        seen.append(computed(metrics["health"]))
    assert len(reads) == 1 and seen == [True, False, True, False, False, True, False]
    rolled_back = state._replace(step=state.step.clone() - 2)   # a state the step did not return: one read
    state, metrics = step(rolled_back, tokens)
    assert len(reads) == 2 and int(state.step) == 6 and computed(metrics["health"])
    state.step.fill_(0)                                        # changed in place since returned: read again
    state, metrics = step(state, tokens)
    assert len(reads) == 3 and computed(metrics["health"])     # step 1
