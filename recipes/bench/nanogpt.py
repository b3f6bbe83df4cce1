"""Benchmark: nanoGPT's own ``train.py`` against ``purestep recipe=standard``, whole runs, on nanoGPT's configuration.

``purestep recipe=bench.nanogpt nanogpt=PATH data=tinyshakespeare.txt`` (``--help`` lists the keys). ``PATH`` is a
nanoGPT checkout (``git clone https://github.com/karpathy/nanoGPT``; it is not a dependency): its ``train.py`` runs
as it is, with its ``config/train_shakespeare_char.py`` and the CPU command of its README (``--device=cpu
--eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
--max_iters=2000 --lr_decay_iters=2000 --dropout=0.0``), with ``--compile=True`` (the keys here set the shape,
the steps and the evaluations of both sides alike). Its data is made from ``data=`` as its
``data/shakespeare_char/prepare.py`` makes it: one id per character in sorted order over the whole text, the first
90% train, ``uint16`` ``train.bin``/``val.bin`` and ``meta.pkl``, in a temporary folder given as ``--dataset``
(``train.py`` reads ``data/<dataset>``, and an absolute path stays itself), its checkpoints under ``out``.
purestep's char tokenizer is that vocabulary and that split, so both sides train on the same tokens.

purestep's side is ``bench.wall``'s (``recipes.bench.wall.standard_args``: the same learning rate, warmup, cosine,
beta2, weight decay and clipping as the configuration), with ``optimizer=adamw dtype=fp32`` by default: nanoGPT's
algorithm and its precision on a CPU (its ``ctx`` is a ``nullcontext`` there); ``optimizer=muon dtype=bf16`` runs
``recipes/standard.py``'s docstring's command, and the table's header then says the precisions differ.

Each run is a child process (``recipes.bench.turns``: timed start to exit, taking turns, cold and warm inductor
caches, ``repeats`` pairs). Per run: the wall time, the median tokens/s (nanoGPT: ``tokens per iteration`` over each
``iter`` line's time; purestep: its ``tokens_per_sec`` in ``metrics.jsonl``), the peak RSS, the final validation
loss, and the wall time at which it first reaches the other side's final validation loss in the same pair, from
both logs' evaluation lines (each stamped with when it was printed): linear between the last evaluation above the
target and the first at or below it.
"""
from __future__ import annotations

import functools
import json
import pickle
import re
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from purestep.core.cli.command import merge_args
from purestep.core.cli.runs import make_folder, run_folder
from purestep.core.config import UserError, option, same_as
from purestep.core.data import text as text_data
from purestep.core.gradients import PRECISIONS
from purestep.recipes.bench import wall
from purestep.recipes.bench.turns import REPO, Child, check_caches, loss_text, take_turns, timed

DESCRIPTION = ("nanoGPT's own train.py (its shakespeare-char CPU configuration, compiled) against purestep "
               "recipe=standard on the same tokens, whole runs taking turns, cold and warm inductor cache")
CLONE = "git clone https://github.com/karpathy/nanoGPT"
CONFIG_FILE = "config/train_shakespeare_char.py"
NEEDED = ("train.py", "model.py", "configurator.py", CONFIG_FILE)
SIDES = ("nanogpt", "purestep")
NANOGPT_EVAL = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)$")
NANOGPT_ITER = re.compile(r"^iter (\d+): loss [\d.na]+, time ([\d.]+)ms")
PURESTEP_EVAL = re.compile(r"^step (\d+): val loss ([\d.]+), perplexity")
WARMUP = 100        # its config's warmup_iters (and bench.wall's warmup_steps): get_lr divides by max_iters - WARMUP


@dataclass
class Config:
    nanogpt: str = option("", f"the nanoGPT checkout whose train.py runs ({CLONE}; not a dependency)")
    data: str = option("tinyshakespeare.txt", "the one text file both sides train on (nanoGPT's: tinyshakespeare.txt, "
                       "its data/shakespeare_char/prepare.py's input.txt)")
    n_layers: int = same_as(wall.Config, "n_layers")
    n_heads: int = same_as(wall.Config, "n_heads")
    d_model: int = same_as(wall.Config, "d_model")
    batch_size: int = same_as(wall.Config, "batch_size")
    block_size: int = same_as(wall.Config, "block_size")
    steps: int = option(2000, f"steps of each run (more than nanoGPT's {WARMUP} warmup iterations)", min=WARMUP + 1)
    eval_every: int = option(250, "steps between evaluations (nanoGPT's eval_interval, purestep's eval_every)", min=1)
    eval_batches: int = option(20, "batches per evaluation (nanoGPT's eval_iters, on each of train and val; "
                               "purestep's eval_batches, on val)", min=1)
    optimizer: str = same_as(wall.Config, "optimizer")
    dtype: str = option("fp32", "purestep's dtype= (fp32: nanoGPT's precision on a CPU; bf16: the docstring's "
                        "command)", choices=tuple(PRECISIONS))
    caches: tuple[str, ...] = same_as(wall.Config, "caches")
    repeats: int = option(2, "pairs of runs per cache state", min=1)
    compile: bool = option(True, "compile both sides (nanoGPT's --compile; false: eager, for a quick look)")
    out: str = option("", "folder for every run's folder, log and results.json (default runs/bench-nanogpt-<time>)")

    def __post_init__(self):
        check_caches(self.caches)


def checkout(path: str) -> Path:
    """The nanoGPT checkout at ``path``, or an error saying how to get one."""
    if not path:
        raise UserError(f"nanogpt= is required: the path of a nanoGPT checkout ({CLONE})")
    root = Path(path).expanduser().resolve()
    missing = [name for name in NEEDED if not (root / name).is_file()]
    if missing:
        raise UserError(f"nanogpt={path}: not a nanoGPT checkout (no {', '.join(missing)}); get one with {CLONE} "
                        f"and give its folder")
    return root


def prepare_nanogpt_data(data: Path, folder: Path) -> Path:
    """nanoGPT's ``train.bin``, ``val.bin`` and ``meta.pkl`` for the text file ``data`` in ``folder``, as its
    ``data/shakespeare_char/prepare.py`` writes them, through purestep's char tokenizer (the same sorted
    vocabulary and 90/10 split by position, ``core.data.text``)."""
    corpus = text_data.prepare(str(data), "char")
    if corpus.tokenizer.vocab_size > 2**16:
        raise UserError(f"data={data}: {corpus.tokenizer.vocab_size} distinct characters; nanoGPT's uint16 files "
                        f"hold at most 65,536")
    folder.mkdir(parents=True, exist_ok=True)
    np.asarray(corpus.train, dtype=np.uint16).tofile(folder / "train.bin")
    np.asarray(corpus.val, dtype=np.uint16).tofile(folder / "val.bin")
    chars = corpus.tokenizer.chars
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump(meta, f)
    return folder


def nanogpt_args(cfg: Config, root: Path, dataset: Path, out: Path) -> list[str]:
    """``train.py``'s command line: the configuration file, then its README's CPU keys with this bench's shape,
    steps, evaluations and compile, the data folder and the run's output folder."""
    return [sys.executable, str(root / "train.py"), CONFIG_FILE, "--device=cpu", f"--compile={cfg.compile}",
            f"--eval_iters={cfg.eval_batches}", "--log_interval=1", f"--block_size={cfg.block_size}",
            f"--batch_size={cfg.batch_size}", f"--n_layer={cfg.n_layers}", f"--n_head={cfg.n_heads}",
            f"--n_embd={cfg.d_model}", f"--max_iters={cfg.steps}", f"--lr_decay_iters={cfg.steps}", "--dropout=0.0",
            f"--eval_interval={cfg.eval_every}", f"--dataset={dataset}", f"--out_dir={out}"]


def wall_config(cfg: Config, data: Path) -> wall.Config:
    """``bench.wall``'s keys for purestep's side of this configuration."""
    return wall.Config(data=str(data), tokenizer="char", n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                       d_model=cfg.d_model, batch_size=cfg.batch_size, block_size=cfg.block_size, steps=cfg.steps,
                       eval_every=cfg.eval_every, eval_batches=cfg.eval_batches, optimizer=cfg.optimizer,
                       dtype=cfg.dtype, compile=cfg.compile)


def evaluations(child: Child, pattern: re.Pattern) -> list[tuple[float, int, float]]:
    """``(seconds since the start, step, val loss)`` of each evaluation line ``pattern`` matches."""
    found = []
    for seconds, line in child.lines:
        m = pattern.match(line)
        if m:
            found.append((seconds, int(m.group(1)), float(m.group(2))))
    return found


def reach_time(evals: list[tuple[float, int, float]], target: float) -> Optional[dict]:
    """When the evaluations first reach ``target`` (a val loss at or below it): ``{"s", "step"}``, ``s`` linear in
    time between the evaluation before (above the target) and that one; None if none does."""
    for i, (seconds, step, loss) in enumerate(evals):
        if loss <= target:
            if i == 0:
                return {"s": seconds, "step": step}
            before_s, _, before = evals[i - 1]
            return {"s": before_s + (before - target) / (before - loss) * (seconds - before_s), "step": step}
    return None


def run_nanogpt(cfg: Config, root: Path, dataset: Path, folder: Path, cache: Path) -> dict:
    child = timed(nanogpt_args(cfg, root, dataset, folder), cache, folder.with_suffix(".log"), cwd=root)
    per_iter = re.search(r"^tokens per iteration will be: ([\d,]+)$", child.text, re.M)
    if per_iter is None:
        raise UserError(f"nanogpt={root}: train.py printed no 'tokens per iteration' line; its output is in "
                        f"{folder.with_suffix('.log')}")
    tokens = int(per_iter.group(1).replace(",", ""))
    rates = [tokens / (float(m.group(2)) / 1000) for _, line in child.lines
             if (m := NANOGPT_ITER.match(line)) and float(m.group(2)) > 0]
    return _result(child, evaluations(child, NANOGPT_EVAL), rates)


def run_purestep(cfg: Config, data: Path, folder: Path, cache: Path) -> dict:
    args = merge_args(*wall.standard_args(wall_config(cfg, data), folder))
    child = timed([sys.executable, str(REPO / "bin" / "run"), *args], cache, folder.with_suffix(".log"))
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_sec"] for r in records if r.get("tokens_per_sec")]
    return _result(child, evaluations(child, PURESTEP_EVAL), rates)


def _result(child: Child, evals: list, rates: list[float]) -> dict:
    return {"wall_s": child.seconds, "tokens_per_s": statistics.median(rates) if rates else None,
            "peak_rss_mib": child.peak_rss_mib, "val_loss": evals[-1][2] if evals else None, "evals": evals}


def run(cfg: Config) -> dict:
    root = checkout(cfg.nanogpt)
    data = Path(cfg.data).expanduser().resolve()
    if not data.is_file():
        raise UserError(f"data={cfg.data}: no such text file (nanoGPT's prepare.py reads one file; its corpus: "
                        f"https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt)")
    folder = make_folder(run_folder(cfg.out, "", "bench-nanogpt"))
    with tempfile.TemporaryDirectory(prefix="bench-nanogpt-") as tmp:
        dataset = prepare_nanogpt_data(data, Path(tmp) / "data")
        sides = {"nanogpt": functools.partial(run_nanogpt, cfg, root, dataset),
                 "purestep": functools.partial(run_purestep, cfg, data)}
        runs = take_turns(sides, cfg.caches, cfg.repeats, folder, Path(tmp))
    pairs = [pair(cache, i, nano, pure) for cache, sides_runs in runs.items()
             for i, (nano, pure) in enumerate(zip(sides_runs["nanogpt"], sides_runs["purestep"]))]
    return table(cfg, pairs, folder)


def pair(cache: str, repeat: int, nano: dict, pure: dict) -> dict:
    """One pair's runs, each with the time it took to reach the other's final val loss, and purestep / nanoGPT."""
    for mine, other in ((nano, pure), (pure, nano)):
        target = other["val_loss"]
        mine["reaches_other"] = None if target is None else reach_time(mine["evals"], target)
    return {"cache": cache, "repeat": repeat, "nanogpt": nano, "purestep": pure,
            "wall_ratio": pure["wall_s"] / nano["wall_s"],
            "tokens_ratio": (pure["tokens_per_s"] / nano["tokens_per_s"]
                             if pure["tokens_per_s"] and nano["tokens_per_s"] else None)}


def header(cfg: Config) -> str:
    precision = ("the same precision (fp32: nanoGPT has no autocast on a CPU)" if cfg.dtype == "fp32" else
                 f"**precisions differ**: nanoGPT fp32 (no autocast on a CPU), purestep {cfg.dtype} autocast")
    return (f"nanoGPT's train.py (its GPT, AdamW) against purestep recipe=standard (Llama, optimizer={cfg.optimizer}, "
            f"dtype={cfg.dtype}), {cfg.steps} steps, {cfg.n_layers} layers, d={cfg.d_model}, batch {cfg.batch_size} x "
            f"{cfg.block_size}, compile={str(cfg.compile).lower()}; {precision}")


def table(cfg: Config, pairs: list[dict], folder: Path) -> dict:
    """Print the table (a row per run, a ratio row per pair, the medians per cache state) and write results.json."""
    rows = []
    for p in pairs:
        for side in SIDES:
            r = p[side]
            rows.append(f"| {p['repeat'] + 1}, {p['cache']} | {side} | {r['wall_s']:.1f} | {_rate(r['tokens_per_s'])} "
                        f"| {r['peak_rss_mib']:,.0f} | {loss_text(r['val_loss'])} | {_reach(r['reaches_other'])} |")
        rows.append(f"| {p['repeat'] + 1}, {p['cache']} | purestep / nanoGPT | {p['wall_ratio']:.3f}x | "
                    f"{_ratio(p['tokens_ratio'])} | {p['purestep']['peak_rss_mib'] / p['nanogpt']['peak_rss_mib']:.3f}x"
                    f" | | |")
    medians = {}
    for cache in cfg.caches:
        mine = [p for p in pairs if p["cache"] == cache]
        tokens = [p["tokens_ratio"] for p in mine if p["tokens_ratio"] is not None]
        medians[cache] = {"wall_ratio": statistics.median(p["wall_ratio"] for p in mine),
                          "tokens_ratio": statistics.median(tokens) if tokens else None}
        rows.append(f"| median, {cache} | purestep / nanoGPT | **{medians[cache]['wall_ratio']:.3f}x** | "
                    f"**{_ratio(medians[cache]['tokens_ratio'])}** | | | |")
    print(header(cfg) + ":")
    print("| pair | run | wall s | tokens/s (median) | peak RSS MiB | val loss at the end | reaches the other's final "
          "val loss |\n|---|---|---:|---:|---:|---:|---|")
    print("\n".join(rows))
    result = {"config": asdict(cfg), "header": header(cfg), "pairs": pairs, "medians": medians}
    (folder / "results.json").write_text(json.dumps(result, indent=1))
    print(f"results in {folder / 'results.json'}")
    return result


def _rate(value) -> str:
    return "?" if value is None else f"{value / 1000:.1f}k"


def _ratio(value) -> str:
    return "?" if value is None else f"{value:.3f}x"


def _reach(reach) -> str:
    return "not reached" if reach is None else f"{reach['s']:.1f} s (step {reach['step']})"
