"""Fine-tune, then export, then measure what the export costs: ``purestep recipe=bench.export [init=smollm2]``.

The path a user takes, end to end: ``recipe=standard init=INIT`` for ``steps`` steps on ``data``, then
``recipe=export`` of the result to an HF folder (fp32, read back through transformers when it is installed) and to
GGUF at ``gguf_dtypes`` (read back through purestep's loader). For each export it reports the file size, the
largest logit difference from the fine-tuned model (``recipe=export``'s own check) and the mean next-token NLL on
``windows`` held-out windows of ``block_size`` tokens from the data's validation split, against the fine-tuned
model's own NLL on the same tokens (the figure llama.cpp users compare quantizations by). Everything is written
under ``out`` (the run and the exports); the table goes to stdout and ``results.md``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from purestep.core.config import UserError, option, same_as
from purestep.core.data.documents import prepare_text
from purestep.core.io.logging import progress
from purestep.core.cli.runs import run_folder
from purestep.models.loading import load_model
from purestep.recipes.export import Config as ExportConfig, run as export
from purestep.recipes.train.config import TrainConfig

DESCRIPTION = "fine-tune a model a few steps, export it to HF and GGUF, compare logits and held-out NLL"
GGUF_DTYPES = ("fp32", "f16", "bf16", "q8_0")


@dataclass
class Config:
    init: str = option("smollm2", "the model to fine-tune (a checkpoint, run folder, HF folder, GGUF or smollm2)")
    data: str = same_as(TrainConfig, "data")
    steps: int = option(10, "fine-tuning steps before the export (0: export init as it is)", min=0)
    lr: float = option(1e-4, "fine-tuning learning rate", min=0)
    batch_size: int = option(1, "fine-tuning sequences per step", min=1)
    block_size: int = option(128, "tokens per sequence, for fine-tuning and the NLL windows", min=2)
    windows: int = option(2, "held-out windows the NLL is measured on", min=1)
    gguf_dtypes: tuple[str, ...] = option(("q8_0",), f"GGUF exports to measure, among {', '.join(GGUF_DTYPES)}")
    out: str = option("", "folder for the run and the exports (default: runs/bench-export-<timestamp>)")


def run(cfg: Config) -> list[dict]:
    bad = [d for d in cfg.gguf_dtypes if d not in GGUF_DTYPES]
    if bad:
        raise UserError(f"gguf_dtypes: {', '.join(map(str, bad))} not one of {', '.join(GGUF_DTYPES)}")
    root = run_folder(cfg.out, "", "bench-export")
    tuned = _fine_tune(cfg, root) if cfg.steps else cfg.init
    model = load_model(tuned)
    windows = _windows(cfg, model.tokenizer)
    rows = [{"export": f"{tuned} (fine-tuned)" if cfg.steps else tuned, "MiB": None, "max_logit_diff": 0.0,
             "nll": _nll(model, windows)}]
    for fmt, dtype in [("hf", "fp32")] + [("gguf", d) for d in cfg.gguf_dtypes]:
        result = export(ExportConfig(init=tuned, format=fmt, dtype=dtype, out=str(root / f"{fmt}-{dtype}"),
                                     overwrite=True))
        path = Path(result["out"])
        read = load_model(str(path if fmt == "hf" else next(path.glob("*.gguf"))))
        rows.append({"export": f"{fmt} {dtype}", "MiB": sum(result["files"].values()) / 2**20,
                     "max_logit_diff": result["max_logit_diff"], "nll": _nll(read, windows)})
    table = _table(rows)
    (root / "results.md").write_text(table + "\n")
    progress(table)
    return rows


def _fine_tune(cfg: Config, root: Path) -> str:
    from purestep.recipes import main
    folder = root / "run"
    args = ["recipe=standard", f"init={cfg.init}", f"data={cfg.data}", f"steps={cfg.steps}", f"lr={cfg.lr}",
            f"batch_size={cfg.batch_size}", f"block_size={cfg.block_size}", "warmup_steps=0", "compile=false",
            "sample_tokens=0", "eval_every=0", "eval_batches=1", "save_every=0", f"out={folder}"]
    progress(f"fine-tuning: purestep {' '.join(args)}")
    if main(args) != 0:
        raise UserError(f"the fine-tuning run in {folder} failed (its error is above)")
    return str(folder)


def _windows(cfg: Config, tokenizer) -> torch.Tensor:
    """``windows`` x (block_size + 1) tokens from the start of the data's validation split."""
    corpus = prepare_text(cfg.data, tokenizer)
    n = cfg.windows * (cfg.block_size + 1)
    if len(corpus.val) < n:
        raise UserError(f"data={cfg.data}: its validation split has {len(corpus.val)} tokens, {n} are needed")
    return torch.from_numpy(corpus.val[:n].astype("int64")).view(cfg.windows, cfg.block_size + 1)


@torch.no_grad()
def _nll(model, windows: torch.Tensor) -> float:
    batch = {"x": windows[:, :-1], "y": windows[:, 1:]}
    return model.module.loss(model.params, batch, model.config).item()


def _table(rows: list[dict]) -> str:
    base = rows[0]["nll"]
    lines = ["| export | size MiB | max logit diff | NLL | delta NLL |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        size = "" if r["MiB"] is None else f"{r['MiB']:,.1f}"
        diff = "n/a" if r["max_logit_diff"] is None else f"{r['max_logit_diff']:.3g}"
        lines.append(f"| {r['export']} | {size} | {diff} | {r['nll']:.4f} | {r['nll'] - base:+.4f} |")
    return "\n".join(lines)
