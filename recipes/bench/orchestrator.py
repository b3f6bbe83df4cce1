"""The orchestrator's acceptance figures, measured in one process (ratios against a baseline run here).

    purestep recipe=bench.orchestrator [data=PATH] [steps=300] [only=unstable,healthy,nowcast]
                                      [healthy_steps=1000] [repeats=3]

Runs the standard recipe's ``tiny`` preset (char tokens; an empty ``data`` means the shared tiny-shakespeare
file when ``PURESTEP_SHARED_DATA`` or ``../shared/data`` has it, else this Python's ``json`` module source):

- unstable: a learning rate far too high for the preset (``lr=1.0``; also ``0.1`` and ``0.3``, where the
  fixed run is merely slow), fixed strategy vs orchestrated (decisions every 10 steps): validation loss of
  each final state (a fixed run stopped by its rollback cap is evaluated where it stopped), and NaN checks;
- healthy: the preset's own settings, fixed vs orchestrated with the default orchestrator keys, for the same
  number of steps: wall-time ratio and validation-loss ratio;
- nowcast: the same healthy run with nowcasting on (no strategy decisions) vs off: acceptance rate and
  validation loss.

Every run is a ``purestep`` equivalent in a temporary folder, ``compile=false``, ``OMP_NUM_THREADS`` as set.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from purestep.recipes import main as run_main
from purestep.core import exits
from purestep.core.config import ConfigError, UserError, option
from purestep.core.data.documents import prepare_text
from purestep.core.step import make_eval_step
from purestep.core.tree import tree_leaves
from purestep.models import llama
from purestep.models.loading import load_model
from purestep.recipes.train.loop import evaluate

DESCRIPTION = "the orchestrator's figures: unstable, healthy and nowcast runs against fixed strategies"
PARTS = ("unstable", "healthy", "nowcast")
UNSTABLE = ["orchestrator.decision_interval=10", "orchestrator.eval_horizon=10", "orchestrator.min_gap=10"]
NOWCAST = ["orchestrator.decision_interval=1000000", "orchestrator.spike_trigger=1000000",
           "orchestrator.nowcast.enabled=true", "orchestrator.nowcast.interval=50", "orchestrator.nowcast.stride=10",
           "orchestrator.nowcast.window=5", "orchestrator.nowcast.horizon=25"]


def default_data() -> str:
    for root in (os.environ.get("PURESTEP_SHARED_DATA"), Path(__file__).resolve().parents[2] / "shared" / "data"):
        if root and (Path(root) / "tinyshakespeare.txt").exists():
            return str(Path(root) / "tinyshakespeare.txt")
    return json.__file__


def train(out: Path, data: str, steps: int, *extra: str, may_stop: bool = False) -> tuple[float, float]:
    """Run; returns (wall seconds, CPU seconds of this process). ``may_stop``: a run that stops without finishing
    (exit code 4, the fixed strategy's rollbacks at their cap) is a result too, its last state measured."""
    args = ["recipe=standard", "preset=tiny", f"data={data}", "tokenizer=char", "compile=false", "sample_tokens=0",
            f"steps={steps}", f"out={out}", "resume=never", *extra]
    t0, c0 = time.perf_counter(), time.process_time()
    code = run_main(args)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if code != 0 and not (may_stop and code == exits.STOPPED):
        raise SystemExit(f"run failed ({code}): {' '.join(args)}")
    return seconds, cpu


def final_val(out: Path, data: str, batch_size: int = 16, block_size: int = 64, batches: int = 10):
    """Validation loss of the newest state in ``out`` (default: the tiny preset's 10 validation batches),
    its step, and whether every parameter is finite."""
    from purestep.core.io import checkpoint as ckpt
    path = ckpt.latest(out)
    model = load_model(str(path))
    corpus = prepare_text(data, model.tokenizer)
    batches = corpus.eval_batches(batch_size, block_size, batches)
    step = make_eval_step(lambda p, b: llama.loss(p, b, model.config))
    finite = all(bool(torch.isfinite(t).all()) for t in tree_leaves(model.params))
    return evaluate(step, model.params, batches), ckpt.read_meta(path)["step"], finite


def decisions(out: Path) -> list[dict]:
    path = out / "orchestrator.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def bench_unstable(root: Path, data: str, steps: int) -> None:
    print("unstable: fixed strategy vs orchestrated, same run (tiny preset, char tinyshakespeare)")
    for lr in ("1.0", "0.3", "0.1"):
        fixed, orch = root / f"fixed-{lr}", root / f"orch-{lr}"
        train(fixed, data, steps, f"lr={lr}", may_stop=True)
        train(orch, data, steps, f"lr={lr}", "orchestrator.enabled=true", *UNSTABLE)
        (vf, sf, ff), (vo, so, fo) = final_val(fixed, data), final_val(orch, data)
        switches = [(r["step"], r["winner"]) for r in decisions(orch) if r["kind"] == "decision" and r["switched"]]
        print(f"  lr={lr}: fixed val {vf:.4f} (stopped at step {sf}, finite {ff}); orchestrated val {vo:.4f} "
              f"(step {so}, finite {fo}); orchestrated / fixed = {vo / vf:.3f}; switches {switches}")


def bench_healthy(root: Path, data: str, steps: int, repeats: int = 2) -> None:
    """Fixed and orchestrated runs interleaved ``repeats`` times (this machine is shared and noisy): the
    median wall-time and CPU-time ratios of the pairs."""
    print(f"healthy: the tiny preset's own settings, {steps} steps, default orchestrator keys")
    walls, cpus = [], []
    for i in range(repeats):
        fixed, orch = root / f"healthy-fixed-{i}", root / f"healthy-orch-{i}"
        (tf, cf), (to, co) = train(fixed, data, steps), train(orch, data, steps, "orchestrator.enabled=true")
        walls.append(to / tf)
        cpus.append(co / cf)
        print(f"  pair {i}: fixed {tf:.1f} s wall / {cf:.1f} s CPU, orchestrated {to:.1f} s / {co:.1f} s")
    (vf, sf, _), (vo, so, _) = final_val(fixed, data), final_val(orch, data)
    made = [(r["step"], r["trigger"], r["winner"]) for r in decisions(orch) if r["kind"] == "decision"]
    print(f"  val fixed {vf:.4f} (step {sf}), orchestrated {vo:.4f} (step {so}): ratio {vo / vf:.4f}; wall-time ratio "
          f"median {sorted(walls)[len(walls) // 2]:.3f} {[round(w, 3) for w in walls]}, CPU-time ratio median "
          f"{sorted(cpus)[len(cpus) // 2]:.3f} {[round(c, 3) for c in cpus]}; decisions (step, trigger, winner) {made}")


def bench_nowcast(root: Path, data: str, steps: int) -> None:
    print(f"nowcast: the tiny preset, {steps} steps, nowcasting on (no strategy decisions) vs off")
    off, on = root / "nowcast-off", root / "nowcast-on"
    train(off, data, steps)
    train(on, data, steps, "orchestrator.enabled=true", *NOWCAST)
    (v_off, _, _), (v_on, _, _) = final_val(off, data), final_val(on, data)
    rows = [r for r in decisions(on) if r["kind"] == "nowcast"]
    kept = [r for r in rows if r["accepted"]]
    gain = sum(r["probe_before"] - r["probe_after"] for r in kept)
    print(f"  nowcasts {len(rows)}, accepted {len(kept)} ({len(kept) / max(len(rows), 1):.0%}), probe-loss gain of the "
          f"accepted jumps {gain:.4f} in total; val loss off {v_off:.4f}, on {v_on:.4f} (on / off = {v_on / v_off:.4f})")
    print("  (step, accepted, probe before -> after): " + ", ".join(
        f"({r['step']}, {r['accepted']}, {r['probe_before']:.4f} -> {r['probe_after']:.4f})" for r in rows))


@dataclass
class Config:
    data: str = option("", "text to train on (empty: the shared tinyshakespeare.txt if present, "
                           "else this Python's json module source)")
    steps: int = option(300, "steps of the unstable and nowcast runs", min=1)
    only: tuple[str, ...] = option(PARTS, "parts to run, comma-separated: unstable, healthy, nowcast")
    healthy_steps: int = option(1000, "steps of each healthy run", min=1)
    repeats: int = option(3, "interleaved fixed/orchestrated pairs of healthy runs", min=1)


def run(cfg: Config) -> None:
    unknown = [part for part in cfg.only if part not in PARTS]
    if unknown:
        raise ConfigError(f"bad value for 'only': {','.join(unknown)}; choose from {', '.join(PARTS)}")
    if min(cfg.steps, cfg.healthy_steps, cfg.repeats) < 1:
        raise UserError("steps, healthy_steps and repeats must be >= 1")
    data = cfg.data or default_data()
    own_cache = "PURESTEP_CACHE" not in os.environ     # a token cache of its own, gone with the folder
    with tempfile.TemporaryDirectory(prefix="orchestrator-bench-") as tmp:
        root = Path(tmp)
        if own_cache:
            os.environ["PURESTEP_CACHE"] = str(root / "cache")
        try:
            if "unstable" in cfg.only:
                bench_unstable(root, data, cfg.steps)
            if "healthy" in cfg.only:
                bench_healthy(root, data, cfg.healthy_steps, cfg.repeats)
            if "nowcast" in cfg.only:
                bench_nowcast(root, data, cfg.steps)
        finally:
            if own_cache:
                os.environ.pop("PURESTEP_CACHE", None)
