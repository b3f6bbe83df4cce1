"""Every benchmark is a recipe: ``bin/run recipe=bench.NAME --help`` answers (in process, exit 0)."""
import importlib
import sys
from pathlib import Path

import pytest

from purestep.recipes import RECIPES, main

BENCHES = [name for name in RECIPES if name.startswith("bench.")]


def test_there_are_benchmarks():
    assert {"bench.step", "bench.health", "bench.checkpoint", "bench.orchestrator", "bench.distill"} <= set(BENCHES)


@pytest.mark.parametrize("name", BENCHES)
def test_benchmark_answers_help(name, capsys):
    assert main([f"recipe={name}", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: purestep recipe={name} ") and "\nkeys:\n" in out
    assert importlib.import_module(RECIPES[name]).DESCRIPTION in out


def test_step_bench_gives_every_variant_its_own_peak_memory(capsys):
    """``isolate=true`` runs each variant in a fresh process; every row has a positive peak RSS and time."""
    from purestep.recipes.bench import step
    cfg = step.Config(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, batch_size=2, block_size=16,
                      warmup=1, steps=2, rounds=1, compile=False, isolate=True)
    rows = step.run(cfg)
    assert set(rows) == {"plain eager", "functional eager"}
    for row in rows.values():
        assert row["peak_mb"] > 0 and row["ms_per_step"] > 0 and row["first_step_s"] > 0
        if sys.platform == "linux":   # the peak after the first step, from the reset high-water mark
            assert 0 < row["steady_mb"] <= row["peak_mb"] * 1.01   # two counters of the same pages
    assert rows["plain eager"]["memory_vs_plain_eager"] == 1.0
    assert "| peak MB | steady MB |" in capsys.readouterr().out


def test_fsdp_bench_halves_the_state_on_2_ranks_and_overlaps_the_prefetched_gathers(tmp_path, capsys):
    """``bench.fsdp`` on 2 gloo ranks at a small size (15 s): each rank holds half of one process's params, gradients
    and moments; the prefetched all-gathers ran while matmuls did (profiler events), the blocking ones never; rank
    0's trace is written."""
    from purestep.recipes.bench import fsdp
    cfg = fsdp.Config(d_model=256, n_layers=3, n_heads=4, block_size=64, ranks=2, warmup=1, steps=2,
                      out=str(tmp_path))
    rows = fsdp.run(cfg)
    assert list(rows) == list(fsdp.VARIANTS)
    for variant in fsdp.VARIANTS[1:]:
        assert 0.5 <= rows[variant]["persistent_ratio"] < 0.51, rows[variant]     # no leaf is padded by much here
    assert rows["fsdp, prefetch"]["collectives"]["all_gather"]["overlapped"] > 0
    assert rows["fsdp, blocking"]["collectives"]["all_gather"]["overlapped"] < 0.02
    assert "gloo:all_gather" in (tmp_path / "trace.json").read_text()
    assert "| fsdp, prefetch |" in capsys.readouterr().out


def test_step_bench_has_the_100m_preset():
    from purestep.core.config import resolve
    from purestep.recipes.bench import step
    cfg = resolve(step.Config, presets=step.PRESETS, preset="100m", overrides={})
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (32000, 768, 12, 12, 4)
    assert (cfg.batch_size, cfg.block_size) == (2, 128)


def test_step_bench_interleaved_refuses_repeats_and_leaves_the_inductor_cache_setting(monkeypatch):
    """``repeats`` means processes (isolate=true); in one process the cold cache is a temporary one, undone after."""
    import os
    from purestep.core.config import ConfigError
    from purestep.recipes.bench import step
    small = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, batch_size=2, block_size=16, warmup=1, steps=1,
                 rounds=1, compile=False, isolate=False)
    with pytest.raises(ConfigError, match="repeats=2 .* needs isolate=true"):
        step.Config(**small, repeats=2)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/kept")
    assert set(step.run(step.Config(**small))) == {"plain eager", "functional eager"}
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/kept"


def test_step_bench_fused_times_the_fused_eager_step_and_needs_compile_false():
    """``fused=true`` is the recipes' key (optim.fused_adamw in the functional eager variant), refused with
    ``compile=true``, whose compiled variants would not run it."""
    from purestep.core.config import ConfigError
    from purestep.recipes.bench import step
    small = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, batch_size=2, block_size=16, warmup=1, steps=1,
                 rounds=1, isolate=False, fused=True)
    with pytest.raises(ConfigError, match="fused=true is the eager step's .* set compile=false"):
        step.Config(**small)
    assert set(step.run(step.Config(**small, compile=False))) == {"plain eager", "functional eager"}


def test_wall_bench_times_both_whole_runs_per_cache_state(tmp_path, capsys):
    """``bench.wall`` at test size (uncompiled, 6 steps): recipe=standard's run and the plain loop's run, each a
    child process of its own, per cache state; the plain loop evaluates the windows recipe=standard evaluates, so
    at step 0 both would agree, and both end with a finite validation loss and their seconds."""
    from purestep.recipes.bench import wall
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    cfg = wall.Config(data=str(corpus), n_layers=1, d_model=32, steps=6, eval_every=3, eval_batches=2,
                      compile=False, out=str(tmp_path / "wall"))
    result = wall.run(cfg)
    for cache in ("cold", "warm"):
        for side in ("standard", "plain"):
            (r,) = result[cache]["runs"][side]
            assert r["wall_s"] > 0 and 0 < r["val_loss"] < 10, (cache, side, r)
        assert result[cache]["standard_over_plain"] > 0
    assert (tmp_path / "wall" / "standard-cold-0" / "final.msgpack").exists()
    assert (tmp_path / "wall" / "plain-cold-0" / "ckpt.pt").exists()
    assert "| warm | standard / plain |" in capsys.readouterr().out
    with pytest.raises(Exception, match="caches"):
        wall.Config(caches=("hot",))


def test_wall_bench_runs_the_standard_recipes_nanogpt_command():
    """``bench.wall``'s standard side with ``optimizer=muon`` runs nanoGPT's configuration's Muon keys
    (``recipes.standard.NANOGPT_MUON``); with AdamW (the default, the plain loop's optimizer) none of them."""
    from purestep.recipes.bench import wall
    from purestep.recipes.standard import NANOGPT_MUON
    args = wall.standard_args(wall.Config(optimizer="muon"), Path("out"))
    assert tuple(a for a in args if a.startswith(("optimizer=", "muon."))) == NANOGPT_MUON
    assert not any(a.startswith("muon.") for a in wall.standard_args(wall.Config(), Path("out")))


def test_the_tensors_peak_counts_a_step_s_largest_rise_over_what_lives():
    """``cpu_allocated_peak_mb``: the live tensors plus the allocator's largest rise during the step (an 8 MiB
    temporary, freed before a 4 MiB one is made, rises 8 MiB, not 12), against a step that allocates nothing."""
    import torch
    from purestep.recipes.bench.common import cpu_allocated_peak_mb

    def temporaries():
        a = torch.ones(2 * 2**20)          # 8 MiB of float32
        del a
        b = torch.ones(2**20)              # 4 MiB
        return b.sum()

    kept = torch.ones(2**20)               # alive across both calls: counted in each
    rise = cpu_allocated_peak_mb(temporaries) - cpu_allocated_peak_mb(lambda: None)
    assert abs(rise - 8.0) < 0.5, rise
    assert kept.numel() == 2**20
