"""``fused=true`` (``optim.fused``, ``core.update.apply_in_place``): the eager donated step with torch's fused AdamW
kernel equals the pure AdamW step and ``torch.optim.AdamW`` (param groups, ``LambdaLR``, ``clip_grad_norm_``, a
skipped non-finite step) to 1e-6 in float32, writes into the state it is given, reports the same metrics, and the key
is refused where it cannot apply."""
import math
import re

import pytest
import torch

from purestep import optim
from purestep.core.config import ConfigError, UserError
from purestep.core.spike import SpikeConfig
from purestep.core.state import init_state
from purestep.core.step import make_train_step
from purestep.core.tree import clone, flatten_dict, leaves_of, max_abs_diff, tree_map, unflatten_dict
from purestep.core.update import Monitors
from purestep.models import llama
from purestep.optim import schedules
from purestep.optim.adamw import ScaleByAdamState
from purestep.optim.health import GradientHealth, computed

CFG = llama.LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
POISONED = 2   # the step whose loss is NaN: skipped
SCHEDULE = dict(warmup=2, total=6, floor=0.1)
ADAMW = dict(lr=1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1)


def loss_fn(p, b, layers=None):
    return llama.loss(p, b, CFG, layers=layers) * b["poison"]


def batches(n=6):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        tok = torch.randint(0, CFG.vocab_size, (4, 17), generator=g)
        out.append({"x": tok[:, :-1], "y": tok[:, 1:], "poison": torch.tensor(math.nan if i == POISONED else 1.0)})
    return out


def pure_and_fused(mask, max_norm):
    kw = dict(ADAMW, mask=mask, schedule=schedules.cosine(**SCHEDULE))
    pure = optim.adamw(**kw)
    return (pure if max_norm is None else optim.chain(optim.clip_by_global_norm(max_norm), pure),
            optim.fused_adamw(**kw, max_norm=max_norm))


def counted(fused):
    """``fused`` whose ``in_place`` counts its calls, and the list they are counted in."""
    calls = []

    def in_place(*args, **kwargs):
        calls.append(1)
        return fused.in_place(*args, **kwargs)

    out = fused._replace(in_place=in_place)
    return out, calls


def run(optimizer, params, monitors=Monitors(), donate=True):
    step = make_train_step(loss_fn, optimizer, donate=donate, monitors=monitors)
    state, history = init_state(clone(params), optimizer, spike=monitors.spike is not None), []
    for batch in batches():
        state, metrics = step(state, batch)
        history.append(metrics)
    return state, history


def torch_reference(params, mask, max_norm):
    """``torch.optim.AdamW(fused=False)`` with the decay mask as two param groups, ``LambdaLR`` on our schedule,
    ``clip_grad_norm_``, and a non-finite step skipped (no optimizer or scheduler step), as GradScaler skips."""
    leaves = {name: t.clone().requires_grad_() for name, t in flatten_dict(params).items()}
    decays = flatten_dict(optim.decay_mask(params) if mask is not None else tree_map(lambda _: True, params))
    groups = [{"params": [t for n, t in leaves.items() if decays[n] == d], "weight_decay": ADAMW["weight_decay"] * d}
              for d in (True, False)]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=ADAMW["lr"], betas=(ADAMW["b1"], ADAMW["b2"]),
                            eps=ADAMW["eps"], foreach=False)
    schedule = schedules.cosine(**SCHEDULE)
    lr_steps = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: float(schedule(torch.tensor(i + 1))))
    for batch in batches():
        opt.zero_grad()
        loss = loss_fn(unflatten_dict(leaves), batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(leaves.values()), max_norm if max_norm is not None else math.inf)
        if torch.isfinite(loss) and torch.isfinite(norm):
            opt.step()
            lr_steps.step()
    return unflatten_dict({n: t.detach() for n, t in leaves.items()})


@pytest.mark.parametrize("mask,max_norm", [(optim.decay_mask, 0.5), (None, None)], ids=["masked-clipped", "plain"])
def test_fused_step_equals_pure_adamw_and_torch(mask, max_norm):
    params = llama.init(CFG, seed=0)
    pure, fused = pure_and_fused(mask, max_norm)
    fused, calls = counted(fused)
    expected, expected_metrics = run(pure, params)
    state = init_state(clone(params), fused)
    buffers = [t.data_ptr() for t in leaves_of((state.params, state.opt_state))]
    step = make_train_step(loss_fn, fused, donate=True)
    got_metrics = []
    for batch in batches():
        state, metrics = step(state, batch)
        got_metrics.append(metrics)
    assert len(calls) == 6   # every step ran the in-place kernel, into the buffers it was given
    assert [t.data_ptr() for t in leaves_of((state.params, state.opt_state))] == buffers
    assert max_abs_diff(state.params, expected.params) < 1e-6
    assert max_abs_diff(state.opt_state, expected.opt_state) < 1e-6
    assert int(state.step) == 6 and int(optim.find_state(state.opt_state, ScaleByAdamState).count) == 5
    for want, got in zip(expected_metrics, got_metrics):
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6, equal_nan=True, msg=k)
    assert [float(m["skipped"]) for m in got_metrics] == [float(i == POISONED) for i in range(6)]
    if max_norm is not None:
        assert float(got_metrics[0]["grad_norm"]) > max_norm   # the clip is active
    assert max_abs_diff(state.params, torch_reference(params, mask, max_norm)) < 1e-6


def test_fused_step_with_health_and_spike_reports_what_the_pure_step_does():
    """Gradient health every 2 steps (it reads the gradients, old and new params: copied on those steps) and the
    spike detector: the same metrics as the pure donated step, the same state."""
    params = llama.init(CFG, seed=0)
    pure, fused = pure_and_fused(optim.decay_mask, 0.5)

    def monitors():
        return Monitors(GradientHealth(params, clip_norm=0.5, every=2), SpikeConfig(enabled=True))

    expected, want_metrics = run(pure, params, monitors())
    state, got_metrics = run(fused, params, monitors())
    assert max_abs_diff(state.params, expected.params) < 1e-6
    torch.testing.assert_close(state.monitor, expected.monitor, rtol=1e-4, atol=1e-6)   # z-scores: relative
    assert [i for i, m in enumerate(got_metrics) if computed(m["health"])] == [0, 1, 3, 5]   # due, or the first
    for i, (want, got) in enumerate(zip(want_metrics, got_metrics)):
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, equal_nan=True, msg=f"step {i} {k}")


def test_fused_optimizer_is_the_pure_chain_where_the_step_is_not_eager_donated():
    """Not donated (or compiled), a FusedAdamW is its pure update: the same bits as the pure chain."""
    params = llama.init(CFG, seed=0)
    pure, fused = pure_and_fused(optim.decay_mask, 0.5)
    fused, calls = counted(fused)
    a, _ = run(pure, params, donate=False)
    b, _ = run(fused, params, donate=False)
    assert not calls
    assert max_abs_diff(a.params, b.params) == 0 and max_abs_diff(a.opt_state, b.opt_state) == 0


@pytest.mark.parametrize("keys,named", [
    ({}, "compile=true"), ({"compile": False, "optimizer": "muon"}, "optimizer=muon"),
    ({"compile": False, "clipping": "adagc"}, "clipping=adagc"), ({"compile": False, "clipping": "agc"}, "clipping=agc"),
    ({"compile": False, "parallel": "ddp"}, "parallel=ddp"), ({"compile": False, "parallel": "fsdp"}, "parallel=fsdp"),
    ({"compile": False, "orchestrator.enabled": True, "spike.enabled": True}, "orchestrator.* switched on"),
])
def test_fused_is_refused_where_it_cannot_apply(keys, named):
    from purestep.core.config import apply_overrides
    from purestep.recipes.standard import Config
    with pytest.raises(ConfigError, match=re.escape(f"fused=true cannot apply with {named}")):
        apply_overrides(Config(), {k: str(v).lower() for k, v in {"fused": True, **keys}.items()})


def test_fused_is_refused_under_torchrun_with_parallel_auto():
    from purestep.core.parallel.distributed import Dist
    from purestep.recipes.train.config import TrainConfig
    from purestep.recipes.train.loop import build_steps
    with pytest.raises(UserError, match="fused=true cannot apply with parallel=auto over several ranks"):
        build_steps(TrainConfig(compile=False, fused=True), loss_fn, None, {}, [], torch.device("cpu"), 64,
                    Dist(world_size=2))


def test_the_recipe_builds_the_fused_optimizer_from_its_keys():
    from purestep.recipes.train.config import TrainConfig
    from purestep.recipes.train.optimizer import make_optimizer, optimizer_spec
    assert isinstance(make_optimizer(optimizer_spec(TrainConfig(compile=False, fused=True))), optim.FusedAdamW)
    assert not isinstance(make_optimizer(optimizer_spec(TrainConfig(compile=False))), optim.FusedAdamW)


@pytest.fixture
def corpus(tmp_path):
    import json
    import textwrap
    from pathlib import Path
    path = tmp_path / "text.txt"
    path.write_text("".join(Path(m.__file__).read_text() for m in (json, textwrap)))
    return path


@pytest.mark.usefixtures("token_cache")   # tests/conftest.py
def test_standard_run_with_fused_equals_the_run_without(corpus, tmp_path):
    """``recipe=standard preset=tiny steps=3 compile=false fused=true`` trains, and its final state is the unfused
    run's to float32 rounding: params and optimizer state to 1e-6; the spike monitor's z-scores, a loss's distance
    from its running mean over a standard deviation of three steps, amplify that rounding (4.4e-6 on an AMD EPYC box,
    where torch's fused AdamW kernel rounds otherwise than on the Intel ones), so they are compared relatively."""
    from purestep.core.io import checkpoint as ckpt
    from purestep.core.tree import named_leaves
    from purestep.recipes import main
    finals = []
    for fused in ("true", "false"):
        out = tmp_path / f"fused-{fused}"
        assert main(["recipe=standard", "preset=tiny", "steps=3", "compile=false", f"fused={fused}",
                     f"data={corpus}", f"out={out}", "eval_every=0", "eval_batches=1", "sample_tokens=0"]) == 0
        finals.append(dict(named_leaves(ckpt.load(out / "final.msgpack")["state"])))
    assert finals[0].keys() == finals[1].keys()
    for name, a in finals[0].items():
        if a.is_floating_point():
            a, b = a.double(), finals[1][name].double()
            trained = name.split(".")[0] in ("params", "opt_state")
            bound = 1e-6 if trained else 1e-5 * max(1.0, float(a.abs().max()))
            assert float((a - b).abs().max()) < bound, name
