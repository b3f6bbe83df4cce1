"""AdaGC against a transcription of the official Megatron code, per-layer gammas, AGC against optax's formula."""
import math

import numpy as np
import pytest
import torch

from purestep import optim
from purestep.core.compile import compile_count
from purestep.core.state import init_state
from purestep.core.step import make_train_step
from purestep.core.tree import tree_map
from purestep.models import llama
from purestep.optim.adagc import AdaGCState, adagc, adagc_metrics, gammas
from purestep.optim.agc import agc, unit_norms
from purestep.optim.health import layer_stacked, stacked_predicate


# ------------------------------------------------------------------------------------------------ AdaGC

def official_adagc(steps, lambda_rel, beta, t_start, max_norm, eps):
    """``AdaGC.clip_by_norm`` of lishuai-97/AdaGC (megatron-gpt2.patch, clip_grads.py), one call per step,
    in NumPy. ``state[i]`` is ``self.state[param]["norm_value"]``; the two lines marked DEPARTURE are
    purestep's documented handling of zero norms (the official code would store 0 there)."""
    state, out = {}, []
    for t, grads in enumerate(steps, start=1):          # self.steps += 1
        grads = [np.array(g, dtype=np.float64) for g in grads]
        total_norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads))
        if t <= t_start:                                 # GlobalGC warm-up
            clip_coeff = max_norm / (total_norm + eps)
            if clip_coeff < 1.0:
                grads = [g * clip_coeff for g in grads]
            for i, g in enumerate(grads):
                norm_value = np.linalg.norm(g)
                if norm_value == 0:
                    continue                             # DEPARTURE 1: a zero norm is not an observation
                if i not in state:
                    state[i] = norm_value
                if norm_value < state[i]:
                    state[i] = norm_value
        else:                                            # tensor-wise AdaGC
            for i, g in enumerate(grads):
                norm_value = np.linalg.norm(g)
                if i not in state:
                    if norm_value == 0:
                        continue                         # DEPARTURE 2: stay unset until a nonzero norm
                    state[i] = norm_value
                avg_norm_value = state[i]
                if norm_value > lambda_rel * avg_norm_value:
                    grads[i] = g * ((lambda_rel * avg_norm_value) / (norm_value + eps))
                    norm_value = lambda_rel * avg_norm_value
                state[i] = avg_norm_value * beta + norm_value * (1.0 - beta)
        out.append((grads, dict(state)))
    return out


# three tensors: a matrix A, a vector b, and z, whose gradient is zero throughout the warm-up
DIRS = {"A": np.array([[0.6, 0.0, 0.0], [0.0, 0.0, 0.8]]), "b": np.array([0.0, 0.6, 0.8]), "z": np.array([1.0, 0.0])}
NORMS = [  # (||g_A||, ||g_b||, ||g_z||) per step; t_start = 2
    (3.0, 4.0, 0.0),    # t=1 warm-up: total 5 -> every grad * 1/(5+1e-6): gamma_A = 0.6, gamma_b = 0.8, z unset
    (0.3, 0.4, 0.0),    # t=2 warm-up: total 0.5, no clip: gamma_A = 0.3, gamma_b = 0.4 (running minimum)
    (0.5, 0.4, 0.0),    # t=3: A 0.5 > 1.04*0.3 = 0.312 -> * 0.312/(0.5+1e-6), gamma_A = 0.99*0.3 + 0.01*0.312 = 0.30012
                        #      b 0.4 <= 0.416 untouched, gamma_b = 0.4; z still zero: still unset
    (0.2, 1.0, 3.0),    # t=4: A untouched, gamma_A = 0.99*0.30012 + 0.01*0.2 = 0.2991188;
                        #      b -> * 0.416/(1+1e-6), gamma_b = 0.40016; z first nonzero: untouched, gamma_z = 3
    (0.31, 0.41, 0.0),  # t=5: z zero after it was set: the official rule decays it, gamma_z = 0.99*3 = 2.97
    (5.0, 0.1, 4.0),    # t=6: spikes in A and z are clipped to 1.04 * gamma (z: 1.04*2.97 = 3.0888)
]
HAND = {1: {"A": 0.6, "b": 0.8}, 2: {"A": 0.3, "b": 0.4}, 3: {"A": 0.30012, "b": 0.4},
        4: {"A": 0.2991188, "b": 0.40016, "z": 3.0}, 5: {"z": 2.97}}


def three_tensor_steps():
    signs = [1.0, -1.0, 1.0, 1.0, -1.0, 1.0]
    return [[DIRS[k] * n * s for k, n in zip("Abz", norms)] for norms, s in zip(NORMS, signs)]


def test_adagc_matches_official_code():
    steps = three_tensor_steps()
    expected = official_adagc(steps, lambda_rel=1.04, beta=0.99, t_start=2, max_norm=1.0, eps=1e-6)
    for t, want in HAND.items():                         # the transcription agrees with the hand numbers
        for k, v in want.items():
            assert expected[t - 1][1]["Abz".index(k)] == pytest.approx(v, rel=1e-6)

    params = {k: torch.ones(DIRS[k].shape, dtype=torch.float64) for k in "Abz"}
    tx = adagc(lambda_rel=1.04, beta=0.99, t_start=2, lambda_abs=1.0, eps=1e-6)
    state = tx.init(params)
    assert all(torch.isinf(g) for g in gammas(state).values())
    for t, (grads_np, (want_grads, want_state)) in enumerate(zip(steps, expected), start=1):
        grads = {k: torch.tensor(g) for k, g in zip("Abz", grads_np)}
        clipped, state = tx.update(grads, state, params)
        assert int(state.count) == t
        for i, k in enumerate("Abz"):
            np.testing.assert_allclose(clipped[k].numpy(), want_grads[i], rtol=1e-12, atol=1e-15)
            gamma = float(state.gamma[k])
            if i in want_state:
                assert gamma == pytest.approx(want_state[i], rel=1e-12)
            else:
                assert math.isinf(gamma), f"{k} should still be unset at t={t}"
    # z was zero through the warm-up and is not zeroed afterwards (the official code would zero it forever)
    assert float(torch.linalg.norm(clipped["z"])) == pytest.approx(1.04 * 2.97, rel=1e-6)


def test_clip_metrics_follow_the_phase():
    params = {k: torch.ones(DIRS[k].shape, dtype=torch.float64) for k in "Abz"}
    tx = adagc(t_start=2)
    state = tx.init(params)
    seen = []
    for grads_np in three_tensor_steps()[:4]:
        _, state = tx.update({k: torch.tensor(g) for k, g in zip("Abz", grads_np)}, state, params)
        m = adagc_metrics(state)
        seen.append((float(m["adagc/clip_fraction"]), float(m["adagc/max_ratio"])))
    assert seen[0] == pytest.approx((1.0, 5.0))          # warm-up: the global clip at 5 / lambda_abs
    assert seen[1] == pytest.approx((0.0, 0.5))
    assert seen[2] == pytest.approx((1 / 3, 0.5 / 0.312))  # only A clipped
    assert seen[3] == pytest.approx((1 / 3, 1.0 / 0.416))  # only b clipped (z is seen for the first time)
    assert adagc_metrics(optim.adamw().init(params)) == {}


def stacked_case(seed=0, L=3):
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([1.0, 0.0, 3.0])[:L]            # layer 1 has zero gradient during the warm-up
    seq = []
    for t in range(8):
        s = scales if t < 3 else torch.tensor([1.0, 2.0, 0.5])[:L] * (1 + t % 3)
        w = torch.randn(L, 4, 5, generator=g, dtype=torch.float64) * s.view(L, 1, 1)
        seq.append({"embed": torch.randn(6, 4, generator=g, dtype=torch.float64), "layers": {"w": w}})
    return seq


def test_stacked_gammas_equal_one_slice_at_a_time():
    L = 3
    seq = stacked_case(L=L)
    params = {"embed": torch.ones(6, 4, dtype=torch.float64), "layers": {"w": torch.ones(L, 4, 5, dtype=torch.float64)}}
    split = lambda tree: {"embed": tree["embed"], **{f"w{i}": tree["layers"]["w"][i] for i in range(L)}}
    tx_stacked = adagc(t_start=3, lambda_abs=2.0)
    tx_split = adagc(t_start=3, lambda_abs=2.0, stacked=())
    s1, s2 = tx_stacked.init(params), tx_split.init(split(params))
    assert s1.gamma["layers"]["w"].shape == (L,) and s1.gamma["embed"].shape == ()
    for grads in seq:
        out1, s1 = tx_stacked.update(grads, s1, params)
        out2, s2 = tx_split.update(split(grads), s2, split(params))
        for i in range(L):
            torch.testing.assert_close(out1["layers"]["w"][i], out2[f"w{i}"], rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(s1.gamma["layers"]["w"][i], s2.gamma[f"w{i}"], rtol=1e-12, atol=0)
        torch.testing.assert_close(out1["embed"], out2["embed"], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(s1.clip_fraction, s2.clip_fraction)
    assert torch.isfinite(s1.gamma["layers"]["w"]).all()


def test_stacked_predicate():
    w, v = torch.zeros(2, 3, 4), torch.zeros(3)
    assert layer_stacked("layers.attn.wq", w) and not layer_stacked("embed", w)
    assert not layer_stacked("layers.scale", torch.zeros(()))
    by_name = stacked_predicate(["blocks"])
    assert by_name("blocks.mlp.w", w) and by_name("blocks", w) and not by_name("blocksx.w", w)
    assert not stacked_predicate(())("layers.attn.wq", w)
    assert stacked_predicate(lambda n, x: x.ndim == 1)("anything", v)


def test_adagc_traces_into_one_graph_and_edits_do_not_recompile():
    torch._dynamo.reset()
    params = {"embed": torch.randn(6, 4), "layers": {"w": torch.randn(3, 4, 5)}}
    tx = adagc(t_start=2)
    update = torch.compile(tx.update, backend="eager", fullgraph=True, dynamic=False)
    state = tx.init(params)
    grads = tree_map(torch.randn_like, params)
    for _ in range(4):
        _, state = update(grads, state, params)
    before = compile_count()
    h = dict(state.hparams, lambda_rel=state.hparams["lambda_rel"] * 0 + 2.0)
    _, state = update(grads, state._replace(hparams=h), params)
    assert compile_count() == before


def test_adagc_state_survives_a_skipped_step_and_a_checkpoint(tmp_path):
    checkpoint = pytest.importorskip("purestep.core.io.checkpoint")
    cfg = llama.LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, ffn_dim=32)
    params = llama.init(cfg, seed=0)
    opt = optim.chain(adagc(t_start=1), optim.adamw(lr=1e-2))
    step = make_train_step(lambda p, b: llama.loss(p, b, cfg) * b["scale"], opt)
    tok = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    batch = {"x": tok[:, :-1], "y": tok[:, 1:], "scale": torch.tensor(1.0)}
    state = init_state(params, opt)
    for _ in range(3):
        state, _ = step(state, batch)
    ada = state.opt_state[0]
    assert isinstance(ada, AdaGCState) and int(ada.count) == 3
    assert ada.gamma["layers"]["attn"]["wq"].shape == (2,)
    skipped, metrics = step(state, dict(batch, scale=torch.tensor(float("nan"))))
    assert float(metrics["skipped"]) == 1.0
    assert int(skipped.opt_state[0].count) == 3
    torch.testing.assert_close(skipped.opt_state[0].gamma, ada.gamma)

    unset = adagc().init(params)                          # +inf (unset) gammas survive the file format
    for tree in (state.opt_state, unset):
        checkpoint.save(tmp_path / "s.msgpack", tree, step=3)
        back = checkpoint.load(tmp_path / "s.msgpack", template=tree)["state"]
        torch.testing.assert_close(back, tree)


# ------------------------------------------------------------------------------------------------ AGC

def test_agc_hand_computed():
    params = {"w": torch.tensor([[3.0, 4.0], [0.0, 1.0]]), "b": torch.zeros(2)}
    grads = {"w": torch.tensor([[0.3, 0.4], [0.001, 0.0]]), "b": torch.tensor([0.01, 0.0])}
    out, _ = agc(clipping=0.05, eps=1e-3).update(grads, optim.EmptyState(), params)
    # row 0: ||W_0|| = 5, max 0.25 < ||g_0|| = 0.5 -> halved; row 1: max 0.05 > 0.001 -> unchanged
    torch.testing.assert_close(out["w"], torch.tensor([[0.15, 0.2], [0.001, 0.0]]))
    # zero weights: max = 0.05 * eps = 5e-5, ||g|| = 0.01 -> scaled to norm 5e-5
    torch.testing.assert_close(out["b"], torch.tensor([5e-5, 0.0]))


def optax_agc(grad, param, clipping, eps, unit_axes):
    """optax ``adaptive_grad_clip`` transcribed to NumPy; ``unit_axes`` are the axes of one unit's norm."""
    def unitwise_norm(x):
        return np.sqrt(np.sum(x * x, axis=unit_axes, keepdims=True)) if unit_axes else np.abs(x)
    g_norm, p_norm = unitwise_norm(grad), unitwise_norm(param)
    max_norm = clipping * np.maximum(p_norm, eps)
    clipped = grad * (max_norm / np.maximum(g_norm, 1e-6))
    return np.where(g_norm < max_norm, grad, clipped)


def test_agc_matches_optax_formula():
    g = torch.Generator().manual_seed(0)
    params = {"embed": torch.randn(8, 4, generator=g), "norm": torch.randn(4, generator=g),
              "scale": torch.tensor(0.5),
              "layers": {"wq": torch.randn(3, 5, 4, generator=g), "attn_norm": torch.randn(3, 4, generator=g)}}
    grads = tree_map(lambda p: torch.randn(p.shape, generator=g) * 0.02, params)
    grads["layers"]["wq"][1] *= 100                       # some rows far over the limit, others far under
    axes = {"embed": (1,), "norm": (0,), "scale": (), "layers.wq": (2,), "layers.attn_norm": (1,)}
    out, _ = agc(clipping=0.05).update(grads, optim.EmptyState(), params)
    flat = lambda t: {"embed": t["embed"], "norm": t["norm"], "scale": t["scale"],
                      "layers.wq": t["layers"]["wq"], "layers.attn_norm": t["layers"]["attn_norm"]}
    n_clipped = n_kept = 0
    for name, got in flat(out).items():
        want = optax_agc(flat(grads)[name].numpy(), flat(params)[name].numpy(), 0.05, 1e-3, axes[name])
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-9)
        same = np.isclose(got.numpy(), flat(grads)[name].numpy(), rtol=0, atol=0)
        n_clipped += int((~same).sum())
        n_kept += int(same.sum())
    assert n_clipped > 0 and n_kept > 0
    kept_row = unit_norms(grads["layers"]["wq"], True) < 0.05 * unit_norms(params["layers"]["wq"], True)
    assert kept_row.any() and (~kept_row).any()


def test_agc_needs_params():
    with pytest.raises(ValueError, match="params"):
        agc().update({"w": torch.ones(2)}, optim.EmptyState())
