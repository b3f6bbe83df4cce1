"""Muon (``optim.muon``) against ``torch.optim.Muon`` per layer, its batched Newton-Schulz against one matrix at a
time, the mask that sends embeddings, head and gains to AdamW, and ``optimizer=muon`` refused under ``parallel=fsdp`` on 2
torchrun ranks. As users run it, compiled (and a resume that asks for AdamW refused), it is
tests/test_default_paths.py's ``test_standard_with_muon``."""
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from purestep import optim
from purestep.core.tree import named_leaves, tree_map
from purestep.models import llama
from purestep.models.llama_module import LlamaModule, load_params
from purestep.optim.muon import orthogonalize
from purestep.recipes import main
from test_optim import CFG, batches, load_params_back, run_functional
from purestep.core.cli.command import merge_args  # noqa: E402 (bin/run refuses a repeated key)

REPO = Path(__file__).resolve().parent.parent
HIDDEN = {"attn": ("wq", "wk", "wv", "wo"), "mlp": ("w_gate", "w_up", "w_down")}
TORCH_NAMES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
               "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
needs_torch_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"),
                                      reason=f"torch {torch.__version__} has no torch.optim.Muon (newer torch has it)")

pytestmark = pytest.mark.usefixtures("token_cache")


@pytest.fixture(scope="module")
def params64():
    return tree_map(lambda t: t.double(), llama.init(CFG, seed=3))


def hidden_weights(module) -> list:
    """Every layer's hidden matrices, as separate 2-D weights (what torch.optim.Muon takes)."""
    return [module.layers[i].get_parameter(f"{TORCH_NAMES[n]}.weight")
            for i in range(CFG.n_layers) for names in HIDDEN.values() for n in names]


def run_torch_muon(params, steps, *, lr, momentum, nesterov, weight_decay, adjust_lr, adam):
    """torch.optim.Muon on each layer's hidden matrices, torch.optim.AdamW on the rest (decay on the head only,
    as ``optim.common.decay_mask``), stepping together: ``MuonWithAuxAdam``'s split in two torch optimizers."""
    module = load_params(LlamaModule(CFG).double(), params)
    hidden = {id(p) for p in hidden_weights(module)}
    head = [module.lm_head.weight]
    rest = [p for p in module.parameters() if id(p) not in hidden and p is not module.lm_head.weight]
    opts = [torch.optim.Muon(hidden_weights(module), lr=lr, momentum=momentum, nesterov=nesterov,
                             weight_decay=weight_decay, adjust_lr_fn=adjust_lr),
            torch.optim.AdamW([{"params": head, "weight_decay": adam["weight_decay"]},
                               {"params": rest, "weight_decay": 0.0}], lr=adam["lr"], betas=adam["betas"],
                              foreach=False)]
    for batch in batches(steps):
        for opt in opts:
            opt.zero_grad()
        torch.nn.functional.cross_entropy(module(batch["x"]).flatten(0, 1), batch["y"].flatten()).backward()
        for opt in opts:
            opt.step()
    return load_params_back(module)


@needs_torch_muon
@pytest.mark.parametrize("nesterov,adjust_lr", [(True, "original"), (False, "match_rms_adamw")])
def test_muon_equals_torch_muon_per_layer_over_20_steps(params64, nesterov, adjust_lr):
    """Stacked [L, out, in] leaves against torch's Muon on each layer's 2-D weight; AdamW on the rest against
    torch's AdamW. float64 weights (Newton-Schulz runs in bfloat16 in both, as torch has it)."""
    hp = dict(lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=0.1, adjust_lr=adjust_lr)
    adam = dict(lr=3e-3, betas=(0.85, 0.97), weight_decay=0.1)
    ours = run_functional(optim.muon(**hp, aux=optim.adamw(lr=adam["lr"], b1=0.85, b2=0.97, weight_decay=0.1)),
                          params64)
    ref = run_torch_muon(params64, 20, **hp, adam=adam)
    for group, names in HIDDEN.items():
        for name in names:
            for layer in range(CFG.n_layers):
                a, b, start = (t["layers"][group][name][layer] for t in (ours, ref, params64))
                assert (a - start).abs().max() > 1e-2, f"{name}[{layer}] hardly moved: the comparison is void"
                assert (a - b).abs().max() < 1e-6, (name, layer, (a - b).abs().max().item())
    for name in ("embed", "lm_head", "norm"):
        assert (ours[name] - ref[name]).abs().max() < 1e-6, name
    for name in ("attn_norm", "mlp_norm"):
        assert (ours["layers"][name] - ref["layers"][name]).abs().max() < 1e-6, name


@pytest.mark.parametrize("shape", [(4, 48, 32), (3, 16, 40), (2, 24, 24), (2, 3, 20, 12)])
def test_batched_newton_schulz_equals_each_matrix_alone(shape):
    """One orthogonalisation over the layer axis gives each layer's own, bit for bit (tall, wide, square, and two
    batch dims), and each is torch's one-matrix function's result where torch has it. It is an orthogonalisation:
    for matrices of condition number 50 (random singular vectors ``U``, ``V``) Keller Jordan's quintic leaves every
    singular value in about [0.68, 1.14] (around 1, not at 1) and the result points along ``U V^T``."""
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    u, _, vh = torch.linalg.svd(torch.randn(shape, generator=g, dtype=torch.float64), full_matrices=False)
    spectrum = torch.linspace(0.06, 3.0, u.shape[-1], dtype=torch.float64)
    x = u @ torch.diag_embed(spectrum.expand(*u.shape[:-2], -1)) @ vh
    batched = orthogonalize(x)
    assert batched.dtype == torch.bfloat16 and batched.shape == x.shape
    flat = zip(x.reshape(-1, *shape[-2:]), batched.reshape(-1, *shape[-2:]), (u @ vh).reshape(-1, *shape[-2:]))
    for one, out, polar in flat:
        assert torch.equal(orthogonalize(one), out)
        if hasattr(torch.optim, "Muon"):
            from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz
            assert torch.equal(_zeropower_via_newtonschulz(one, (DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, EPS), out)
        s = torch.linalg.svdvals(out.double())
        assert s.min() > 0.6 and s.max() < 1.2, s
        cosine = (out.double() * polar).sum() / (out.double().norm() * polar.norm())
        assert cosine > 0.98, cosine


def test_the_mask_sends_embeddings_head_and_gains_to_adamw():
    cfg = llama.LlamaConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                            tie_embeddings=False, qkv_bias=True)
    params = llama.init(cfg, seed=0)
    mask = optim.muon_mask(params)
    chosen = {n for n, m in zip(*_named(mask)) if m}
    assert chosen == {f"layers.{g}.{n}" for g, names in HIDDEN.items() for n in names}
    # AdamW's part of the state holds exactly the rest, and moves it as optim.adamw alone would
    transform = optim.muon(lr=0.02, aux=optim.adamw(lr=1e-3, weight_decay=0.1))
    state = transform.init(params)
    aux_names = set(_named(state["aux"][0].mu)[0])
    assert aux_names == set(_named(params)[0]) - chosen
    assert {"embed", "lm_head", "norm", "layers.attn_norm", "layers.mlp_norm", "layers.attn.q_bias"} <= aux_names
    grads = torch.func.grad(lambda p, b: llama.loss(p, b, cfg))(params, next(batches(1)))
    updates, _ = transform.update(grads, state, params)
    alone, _ = optim.adamw(lr=1e-3, weight_decay=0.1).update(grads, optim.adamw(lr=1e-3, weight_decay=0.1).init(
        params), params)
    for (name, u), a in zip(zip(*_named(updates)), _named(alone)[1]):
        if name in chosen:
            assert not torch.allclose(u, a), name
        else:
            assert torch.equal(u, a), name
    assert set(transform.metrics(state)) == {"lr", "muon_lr"}


def _named(tree):
    pairs = named_leaves(tree)
    return [n for n, _ in pairs], [v for _, v in pairs]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def test_parallel_fsdp_refuses_muon_on_every_rank_and_the_orchestrator_too(corpus, tmp_path, capsys):
    """Newton-Schulz needs whole matrices, fsdp shards them: refused before anything runs, one line per rank
    naming both keys, exit 2 (torchrun reports each worker's code); the orchestrator, built on AdamW, refuses it."""
    proc = subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", str(REPO / "bin" / "run"),
                           *merge_args("recipe=standard", "preset=tiny", "optimizer=muon", "parallel=fsdp",
                                       f"data={corpus}", "compile=false", f"out={tmp_path / 'x'}")],
                          cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "optimizer=muon with parallel=fsdp" in line]
    assert lines and all(line.startswith("error: ") for line in lines), proc.stderr[-3000:]
    # each worker exits 2; torchrun stops a worker still running once the first has failed (SIGTERM, -15)
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)
    assert "2" in codes and set(codes) <= {"2", "-15"}, proc.stderr[-3000:]
    assert not (tmp_path / "x").exists()
    assert main(["recipe=standard", "preset=tiny", "optimizer=muon", "orchestrator.enabled=true",
                 f"data={corpus}", f"out={tmp_path / 'y'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "orchestrator.enabled=true with optimizer=muon" in err[0], err


def test_muon_runs_compile_on_cuda_without_mixed_order_reduction():
    """Inductor's mixed-order reduction failed a compiled Muon step on an H100 (torch 2.11): a run with
    optimizer=muon compiles with it off, on CUDA only (``Compile.cuda_options``, decided by the recipe, not by the
    transform); AdamW's runs keep it (it saves memory there)."""
    from purestep.core.compile import NO_MIX_ORDER_REDUCTION, _compile_kwargs
    from purestep.recipes.standard import Config
    from purestep.recipes.train import backend
    muon = backend.cuda_options(Config(optimizer="muon"))
    assert muon == NO_MIX_ORDER_REDUCTION and backend.cuda_options(Config()) == ()
    assert optim.muon()._fields == ("init", "update", "metrics")   # a transform carries no compiler settings
    cuda = _compile_kwargs(None, False, "cuda", muon)["options"]
    assert cuda["loop_ordering_after_fusion"] is False
    assert cuda.get("triton.mix_order_reduction", False) is False
    assert "triton.mix_order_reduction" not in _compile_kwargs(None, False, "cuda", ())["options"]
    assert _compile_kwargs(None, True, "cpu", muon) == _compile_kwargs(None, True, "cpu")
