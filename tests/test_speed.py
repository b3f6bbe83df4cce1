"""``recipe=bench.speed`` (the standard loop against nanoGPT's plain loop), ``compile_scope=auto`` and the step's
``skip=False`` (only the benchmark builds it). The benchmark's figures are in docs/benchmarks.md; here its code path
runs eagerly on a tiny model in seconds."""
import math
from dataclasses import replace

import pytest
import torch

from purestep.core.config import ConfigError, UserError
from purestep.core.spike import SpikeConfig
from purestep.core.state import init_state
from purestep.core.step import make_train_step
from purestep.optim import adamw
from purestep.recipes.bench import speed
from purestep.recipes.train import backend
from purestep.recipes.train.config import TrainConfig
from purestep.recipes.train.loop import build_steps
from purestep.core.update import Monitors


def test_bench_speed_times_every_variant(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PURESTEP_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    cfg = speed.Config(data=str(text), d_model=32, n_layers=1, n_heads=2, batch_size=2, block_size=16, warmup=1,
                       steps=3, rounds=1, log_every=1, compile=False, overhead=True, peak_size=64, threads=0, pairs=2)
    out = speed.run(cfg)
    rows = out["rows"]
    assert set(rows) == {"standard", "plain", "standard, health=false", "standard, spike.enabled=false",
                         "standard, no non-finite skip"}
    assert rows["plain"]["vs_plain"] == 1.0 and rows["standard"]["vs_standard"] == 1.0
    for row in rows.values():
        assert row["tokens_per_sec"] > 0 and 0 < row["of_peak"] and math.isfinite(row["flops"])
    assert out["peak_flops"] > 0 and out["wall_seconds"] > 0
    printed = capsys.readouterr().out
    assert "| variant | ms/step | tokens/s | vs plain (tokens/s) |" in printed and "standard / plain tokens/s" in printed
    assert set(out["defaults"]) == set(speed.DEFAULTS) and all(math.isfinite(v) for v in out["defaults"].values())
    assert "each default's cost, as a share of standard's step (2 alternating step pairs" in printed


def test_without_names_a_subset_of_the_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("PURESTEP_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    with pytest.raises(ConfigError, match="without='health,bogus'"):
        speed.Config(data=str(text), overhead=True, without="health,bogus")
    with pytest.raises(ConfigError, match="set overhead=true"):
        speed.Config(data=str(text), without="health")
    cfg = speed.Config(data=str(text), d_model=32, n_layers=1, n_heads=2, batch_size=2, block_size=16, warmup=1,
                       steps=3, rounds=1, log_every=1, compile=False, overhead=True, without="skip", peak_size=64,
                       threads=0)
    assert set(speed.run(cfg)["rows"]) == {"standard", "plain", "standard, no non-finite skip"}


def test_auto_compile_scope_is_the_one_graph_on_cuda_and_up_to_four_layers():
    def params(layers):
        return {"embed": torch.zeros(3, 2), "layers": {"wq": torch.zeros(layers, 2, 2)}}

    auto = TrainConfig()
    assert auto.compile_scope == "auto"
    assert backend.compile_scope(auto, params(backend.AUTO_STEP_LAYERS)) == "step"
    assert backend.compile_scope(auto, params(backend.AUTO_STEP_LAYERS + 1)) == "block"
    assert backend.compile_scope(TrainConfig(compile_scope="block"), params(1)) == "block"
    assert backend.compile_scope(TrainConfig(compile_scope="step"), params(30)) == "step"
    assert backend.auto_scope(30, "cuda") == "step" and backend.auto_scope(30, "cpu") == "block"
    assert backend.auto_scope(30, "cuda", sharded=True) == "block"


def test_grad_mode_picks_the_engine_and_refuses_func_where_it_cannot_run():
    """``grad_mode=auto``: the one torch.func graph up to 4 layers, the loss's graph and the update's through autograd
    beyond (a step compiled whole there: CUDA, or compile_scope=step), unless sharded; func is refused by the keys
    that rule it out, and where ``compile_scope=auto`` chose the block graph for a deep model on the CPU."""
    def params(layers):
        return {"embed": torch.zeros(3, 2), "layers": {"wq": torch.zeros(layers, 2, 2)}}

    shallow, deep = params(backend.AUTO_STEP_LAYERS), params(backend.AUTO_STEP_LAYERS + 1)
    assert backend.grad_mode(TrainConfig(), shallow, "step") is None          # core.step's choice: func
    assert backend.grad_mode(TrainConfig(), deep, "step") == "autograd"
    assert backend.grad_mode(TrainConfig(), deep, "block") is None            # autograd, block by block
    assert backend.grad_mode(TrainConfig(compile=False), deep, "step") is None
    assert backend.grad_mode(TrainConfig(parallel="fsdp"), deep, "step") is None
    assert backend.grad_mode(TrainConfig(grad_mode="func", compile_scope="step"), deep, "step") == "func"
    assert backend.grad_mode(TrainConfig(grad_mode="autograd"), shallow, "step") == "autograd"
    for keys, why in (({"remat": True}, "remat=true"), ({"compile_scope": "block"}, "compile_scope=block")):
        with pytest.raises(ConfigError, match=f"grad_mode=func .* which {why}"):
            TrainConfig(grad_mode="func", **keys)
    with pytest.raises(UserError, match="grad_mode=func .* compile_scope=auto compiles this model's block"):
        backend.grad_mode(TrainConfig(grad_mode="func"), deep, "block")
    assert backend.grad_mode(TrainConfig(grad_mode="func", compile=False), deep, "block") == "func"   # eager


def test_step_without_skip_writes_a_non_finite_update():
    params = {"w": torch.ones(3)}

    def loss_fn(p, batch):
        return (p["w"] * batch).sum()

    bad = torch.tensor([1.0, float("nan"), 1.0])
    for skip, finite in ((True, True), (False, False)):
        step = make_train_step(loss_fn, adamw(1e-2), monitors=Monitors(skip=skip))
        state, metrics = step(init_state(params, adamw(1e-2)), bad)
        assert metrics["skipped"].item() == 1.0
        assert bool(torch.isfinite(state.params["w"]).all()) is finite


def test_skip_nonfinite_false_is_the_runs_key_for_the_select():
    """``skip_nonfinite=false`` reaches the step ``build_steps`` makes: a non-finite step writes its NaNs."""
    params = {"w": torch.ones(3)}
    bad = torch.tensor([1.0, float("nan"), 1.0])
    for skip, finite in ((True, True), (False, False)):
        cfg = TrainConfig(skip_nonfinite=skip, compile=False, dtype="fp32", health=False,
                          spike=SpikeConfig(enabled=False))
        steps = build_steps(cfg, lambda p, batch, key: (p["w"] * batch).sum(), adamw(1e-2), params, None,
                            torch.device("cpu"), 8)
        state, metrics = steps.train(init_state(params, adamw(1e-2)), bad)
        assert metrics["skipped"].item() == 1.0
        assert bool(torch.isfinite(state.params["w"]).all()) is finite


def test_overhead_variants_step_standards_own_state(tmp_path, monkeypatch):
    monkeypatch.setenv("PURESTEP_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    with pytest.raises(ConfigError, match="multiples of log_every=2"):
        speed.Config(data=str(text), overhead=True, steps=3, warmup=2, log_every=2)
    cfg = speed.Config(data=str(text), d_model=32, n_layers=1, n_heads=2, batch_size=2, block_size=16, warmup=2,
                       steps=4, rounds=1, log_every=2, compile=False, overhead=True, peak_size=64, threads=0)
    variants = speed.build(cfg, tmp_path / "runs")
    std, others = variants["standard"], [v for k, v in variants.items() if k not in ("standard", "plain")]
    assert len(others) == 3 and all(v.state is None and v.params is None for v in others)
    for v in [std, *others]:
        v(cfg.steps)
    assert int(std.state.step) == 4 * cfg.steps and int(std.state.cursor) == 4 * cfg.steps
    assert std.state.monitor and others[1].monitor == {}   # spike.enabled=false keeps no detector state
    assert len(std.health_excess) == 1 and not others[0].health_excess   # step 4 is due, step 3 is not
    assert speed._health_cost(cfg, std.health_excess, 0.01) == pytest.approx(std.health_excess[0] / 2 / 0.01)
    timed = []
    monkeypatch.setattr(speed.Standard, "step_once", lambda self, f=speed.Standard.step_once: timed.append(
        (self, int(self.owner.state.step) + 1)) or f(self))
    shares = speed._step_pairs(replace(cfg, pairs=2), variants)
    assert set(shares) == set(speed.DEFAULTS) and int(std.state.step) > 16 + 2 * 3 * 2
    mine = [n for run, n in timed if run is not std]
    assert len(mine) == 2 * 3 and all(n % 2 for n in mine)                 # never a due step (even)
    assert sum(n % 2 for run, n in timed if run is std) == 2 * 3           # standard's due steps: untimed extras
    for v in [std, *others]:
        v.logger.close()
