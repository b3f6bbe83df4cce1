"""Benchmark: a whole run, compile included: ``purestep recipe=standard`` against the plain PyTorch loop's whole run.

``purestep recipe=bench.wall data=tinyshakespeare.txt`` (``--help`` lists the keys). The defaults are nanoGPT's CPU
shakespeare-char configuration, the command in ``recipes/standard.py``'s docstring (4 layers, 4 heads, d=128,
block 64, batch 12, 2000 steps, lr 1e-3 with 100 warmup steps and cosine to 1e-4, beta2 0.99, an evaluation of 20
batches every 250 steps), with ``optimizer=`` as given: ``adamw`` by default, the plain loop's own optimizer, so both
sides run the same algorithm, and ``dtype=`` (bf16 by default) on both sides; ``optimizer=muon`` runs the docstring's
command itself (``recipes.standard.NANOGPT_MUON``).

Every run is a child process, timed from its start to its exit (interpreter start-up, imports, the data, every
compile, the steps, the evaluations, the checkpoints):

- ``standard``: ``purestep recipe=standard`` with those keys, every other key at its default (samples at each
  evaluation, gradient health, spike detection, checkpoints every 500 steps and the best): what users run.
- ``plain``: ``python -m purestep.recipes.bench.plain_run`` (``recipes/bench/plain_run.py``): nanoGPT's ``train.py``
  loop over the same Llama as an ``nn.Module``: ``torch.compile(module)`` over the model and its loss (nanoGPT's
  ``model(X, Y)``), fused AdamW, the same evaluations (the same windows, under ``no_grad``), a ``torch.save`` when the
  validation loss improves; in ``dtype``'s precision unless ``plain_dtype`` names another (the table's header then
  says the precisions are mixed).
- with ``loss_outside=true`` also ``plain, loss outside``: the same loop with the cross entropy taken eagerly on the
  compiled module's logits (the weaker baseline of the earlier figures).

``caches``: ``cold`` runs compile into a new, empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``), one per run;
``warm`` runs read the cache their own side's cold run filled (a cold run first if none ran). The order is
standard, plain (then ``plain, loss outside``) for each cache state, ``repeats`` times; the ratio standard / plain is
the median of each pair's.
Each run also gives what it spent compiling (dynamo's timers, ``core.compile.compile_seconds``) and its final
validation loss. This machine is shared and noisy: ratios taken back to back are the result, not bare times.
"""
from __future__ import annotations

import functools
import json
import re
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from purestep.core.cli.command import merge_args
from purestep.core.config import option
from purestep.core.gradients import PRECISIONS
from purestep.core.cli.runs import make_folder, run_folder
from purestep.recipes.bench.plain_run import MARK, PlainRun
from purestep.recipes.bench.turns import CACHES, REPO, check_caches, loss_text, take_turns, timed
from purestep.recipes.standard import NANOGPT_MUON
from purestep.recipes.train.optimizer import OPTIMIZERS

LOSS_OUTSIDE = "plain, loss outside"   # the side loss_outside=true adds
DESCRIPTION = ("wall time of a whole purestep recipe=standard run (compile, steps, evaluations, checkpoints) against "
               "nanoGPT's plain loop's whole run, cold and warm inductor cache")


@dataclass
class Config:
    data: str = option("stdlib", "the corpus, as recipe=standard's data= (nanoGPT's: tinyshakespeare.txt)")
    tokenizer: str = option("char", "as recipe=standard's tokenizer=")
    n_layers: int = option(4, "transformer blocks", min=1)
    n_heads: int = option(4, "query heads", min=1)
    d_model: int = option(128, "model width", min=1)
    batch_size: int = option(12, "sequences per step", min=1)
    block_size: int = option(64, "tokens per sequence", min=1)
    steps: int = option(2000, "steps of each run", min=1)
    eval_every: int = option(250, "steps between evaluations (both sides)", min=0)
    eval_batches: int = option(20, "validation batches per evaluation (both sides)", min=1)
    optimizer: str = option("adamw", "recipe=standard's optimizer= (the plain loop's is AdamW; muon: with the "
                            "docstring's muon.lr=0.01 muon.momentum=0.9)", choices=OPTIMIZERS)
    dtype: str = option("bf16", "recipe=standard's dtype= (the configuration's command: bf16 autocast)",
                        choices=tuple(PRECISIONS))
    plain_dtype: str = option("same", "the plain loop's autocast dtype (same: dtype's, the same precision on both "
                              "sides; fp32: nanoGPT's train.py on a CPU)", choices=("same", *PRECISIONS))
    loss_outside: bool = option(False, "also run the plain loop with the cross entropy taken eagerly outside the "
                                       "compiled module (the weaker baseline): 'plain, loss outside'")
    caches: tuple[str, ...] = option(CACHES, "the inductor cache states to time, among cold, warm")
    repeats: int = option(1, "pairs of runs per cache state", min=1)
    compile: bool = option(True, "compile both sides (false: eager, for a quick look)")
    out: str = option("", "folder for every run's folder and results.json (default runs/bench-wall-<time>)")

    def __post_init__(self):
        check_caches(self.caches)


def standard_args(cfg: Config, folder: Path) -> list[str]:
    """``purestep recipe=standard``'s keys for this configuration (``recipes/standard.py``'s docstring)."""
    return ["recipe=standard", f"data={cfg.data}", f"tokenizer={cfg.tokenizer}", f"model.n_layers={cfg.n_layers}",
            f"model.n_heads={cfg.n_heads}", f"model.d_model={cfg.d_model}", f"block_size={cfg.block_size}",
            f"batch_size={cfg.batch_size}", "lr=1e-3", "beta2=0.99", "warmup_steps=100", f"steps={cfg.steps}",
            "min_lr=1e-4", f"eval_every={cfg.eval_every}", f"eval_batches={cfg.eval_batches}",
            f"optimizer={cfg.optimizer}", *(NANOGPT_MUON[1:] if cfg.optimizer == "muon" else ()), f"dtype={cfg.dtype}",
            f"compile={str(cfg.compile).lower()}", f"out={folder}"]


def plain_dtype(cfg: Config) -> str:
    """The plain loop's precision: ``plain_dtype``, or ``dtype``'s when it says ``same``."""
    return cfg.dtype if cfg.plain_dtype == "same" else cfg.plain_dtype


def plain_config(cfg: Config, folder: Path, loss_inside: bool = True) -> PlainRun:
    return PlainRun(data=cfg.data, tokenizer=cfg.tokenizer, out=str(folder), n_layers=cfg.n_layers,
                    n_heads=cfg.n_heads, d_model=cfg.d_model, batch_size=cfg.batch_size, block_size=cfg.block_size,
                    steps=cfg.steps, eval_every=cfg.eval_every, eval_batches=cfg.eval_batches, compile=cfg.compile,
                    dtype=plain_dtype(cfg), loss_inside=loss_inside)


def run_standard(cfg: Config, folder: Path, cache: Path) -> dict:
    child = timed([sys.executable, str(REPO / "bin" / "run"), *merge_args(*standard_args(cfg, folder))], cache,
                  folder.with_suffix(".log"))
    seconds, text = child.seconds, child.text
    val = re.search(r"done: step \d+, val loss ([\d.]+)", text)
    compiling = re.search(r"of which compiling ([\d.]+)s", text)
    return {"wall_s": seconds, "val_loss": float(val.group(1)) if val else None,
            "compile_s": float(compiling.group(1)) if compiling else None}


def run_plain(cfg: Config, folder: Path, cache: Path, loss_inside: bool = True) -> dict:
    argv = [sys.executable, "-m", "purestep.recipes.bench.plain_run",
            json.dumps(asdict(plain_config(cfg, folder, loss_inside)))]
    child = timed(argv, cache, folder.with_suffix(".log"))
    seconds, text = child.seconds, child.text
    result = json.loads(next(line[len(MARK):] for line in text.splitlines() if line.startswith(MARK)))
    return {"wall_s": seconds, "val_loss": result["val_loss"], "compile_s": result["compile_s"],
            "steps_s": result["steps_s"], "evals_s": result["evals_s"]}


def run_plain_loss_outside(cfg: Config, folder: Path, cache: Path) -> dict:
    return run_plain(cfg, folder, cache, loss_inside=False)


def side_runs(cfg: Config) -> dict:
    """Each side's name and the function that runs it: standard, plain, and with ``loss_outside`` the plain loop with
    the loss outside the compiled module."""
    return {"standard": run_standard, "plain": run_plain,
            **({LOSS_OUTSIDE: run_plain_loss_outside} if cfg.loss_outside else {})}


def run(cfg: Config) -> dict:
    folder = make_folder(run_folder(cfg.out, "", "bench-wall"))
    sides = {side: functools.partial(fn, cfg) for side, fn in side_runs(cfg).items()}
    with tempfile.TemporaryDirectory(prefix="bench-wall-") as tmp:
        runs = take_turns(sides, cfg.caches, cfg.repeats, folder, Path(tmp))
    return _table(cfg, runs, folder)


def _median_ratio(sides: dict, baseline: str) -> float:
    """The median over pairs of standard's wall time over ``baseline``'s in the same pair."""
    return statistics.median(s["wall_s"] / p["wall_s"] for s, p in zip(sides["standard"], sides[baseline]))


def _s(seconds) -> str:
    return "?" if seconds is None else f"{seconds:.1f}s"


def _table(cfg: Config, runs: dict, folder: Path) -> dict:
    rows, summary = [], {}
    for cache_state, sides in runs.items():
        summary[cache_state] = {"standard_over_plain": _median_ratio(sides, "plain"), "runs": sides}
        if LOSS_OUTSIDE in sides:
            summary[cache_state]["standard_over_plain_loss_outside"] = _median_ratio(sides, LOSS_OUTSIDE)
        for side, rs in sides.items():
            compiling = [r["compile_s"] for r in rs if r["compile_s"] is not None]
            rows.append(f"| {cache_state} | {side} | {statistics.median(r['wall_s'] for r in rs):.1f} | "
                        f"{_s(statistics.median(compiling) if compiling else None)} | "
                        f"{loss_text(rs[-1]['val_loss'])} |")
        rows.append(f"| {cache_state} | standard / plain | {summary[cache_state]['standard_over_plain']:.3f}x | | |")
        if LOSS_OUTSIDE in sides:
            rows.append(f"| {cache_state} | standard / {LOSS_OUTSIDE} | "
                        f"{summary[cache_state]['standard_over_plain_loss_outside']:.3f}x | | |")
    mixed = "" if plain_dtype(cfg) == cfg.dtype else ": mixed precisions"
    print(f"whole runs of {cfg.steps} steps (standard with optimizer={cfg.optimizer} dtype={cfg.dtype}, plain with "
          f"{plain_dtype(cfg)}{mixed}), {cfg.repeats} pair(s) per cache state, medians:")
    print("| cache | run | wall s | compiling | val loss |\n|---|---|---|---|---|")
    print("\n".join(rows))
    result = {"config": asdict(cfg), **summary}
    (folder / "results.json").write_text(json.dumps(result, indent=1))
    print(f"results in {folder / 'results.json'}")
    return result
