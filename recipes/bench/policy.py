"""Benchmark: distilled students scored on their own samples, GKD's question, and on the data.

``purestep recipe=bench.policy teacher=smollm2 students=runs/distill-off,runs/distill-on data=PATH`` cuts held-out
windows of ``data`` (its validation split, the teacher's tokenizer), keeps the first ``prompt`` tokens of each as
a prompt and, per student:

- **own samples** (on-policy): continues every prompt with ``new_tokens`` tokens sampled at temperature 1 through
  the KV cache (``recipes.distill.on_policy.OnPolicy.continue_rows``, the decode on-policy training runs; the seed
  of row i is ``seed + i``, the same for every student), then runs teacher and student teacher-forced over the
  window: the forward ``KL(teacher || student)`` per position and the teacher's NLL of the student's tokens, over
  the positions that predict a generated token (up to the first EOS);
- **the data** (off-policy): the same KL over the data's own continuation, and the student's CE there.

GKD (Agarwal et al. 2024) trains on the student's own continuations to fix the exposure bias of teacher-forced
training: its claim is the first column, at equal teacher forwards; the second says what it costs on the data.
Everything is in nats per token, at temperature 1; one line per student, and ``out=`` (optional) gets the table.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from purestep.core.config import UserError, option
from purestep.core.device import DEVICES, resolve_device
from purestep.core.gradients import autocast
from purestep.core.io.logging import progress
from purestep.models import llama
from purestep.models.loading import load_model, require_llama
from purestep.recipes.distill.on_policy import OnPolicy
from purestep.recipes.distill.teacher import load_teacher, teacher_data
from purestep.recipes.train.config import TrainConfig

DESCRIPTION = "distilled students on their own samples (KL to the teacher, teacher NLL) and on the data (GKD)"


@dataclass
class Config:
    teacher: str = option("smollm2", "the teacher: checkpoint or run folder, Hugging Face folder, .gguf, or smollm2")
    students: str = option("", "comma-separated student checkpoints or run folders (the teacher's vocabulary)")
    data: str = option("stdlib", "text whose validation split gives the prompts (file, folder, glob, stdlib)")
    windows: int = option(32, "held-out windows (prompts)", min=1)
    prompt: int = option(32, "tokens of each window kept as the prompt", min=1)
    new_tokens: int = option(32, "tokens each student writes per prompt", min=1)
    seed: int = option(0, "sampling seed of row 0 (row i: seed + i)", min=0)
    device: str = option("auto", "where to run", choices=DEVICES)
    out: str = option("", "markdown file for the table (optional)")


def _windows(cfg: Config, corpus, device) -> torch.Tensor:
    width = cfg.prompt + cfg.new_tokens
    n = cfg.windows * (width + 1)
    if len(corpus.val) < n:
        raise UserError(f"data={cfg.data}: its validation split has {len(corpus.val)} tokens; windows={cfg.windows} "
                        f"of prompt + new_tokens + 1 = {width + 1} need {n}")
    return torch.from_numpy(corpus.val[:n].astype("int64")).view(cfg.windows, width + 1).to(device)


def _log_probs(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), autocast("fp32", x.device.type):
        return torch.log_softmax(llama.apply(model.params, x, model.config).float(), -1)


def scores(teacher, student, windows: torch.Tensor, prompt: int, seed: int, eos_id) -> dict:
    """The table's numbers for one student (module docstring): nats per token."""
    new = windows.shape[1] - 1 - prompt
    decode = OnPolicy(1.0, prompt, 1.0, seed, 0, student.config, eos_id, "fp32")
    sampled = decode.continue_rows(student.params, windows[:, :prompt], [seed + i for i in range(len(windows))], new)
    own = torch.cat([windows[:, :prompt], sampled], 1)
    counted = decode.kl_positions(sampled)[:, :new]           # positions that predict a generated token
    p, q = _log_probs(teacher, own), _log_probs(student, own)
    at = slice(prompt - 1, prompt - 1 + new)
    kl_own = (p[:, at].exp() * (p[:, at] - q[:, at])).sum(-1)
    nll = -p[:, at].gather(-1, sampled[..., None])[..., 0]
    data_x, data_y = windows[:, :-1], windows[:, 1:]
    p, q = _log_probs(teacher, data_x)[:, at], _log_probs(student, data_x)[:, at]
    return {"kl_own": float(kl_own[counted].mean()), "teacher_nll_own": float(nll[counted].mean()),
            "kl_data": float((p.exp() * (p - q)).sum(-1).mean()),
            "ce_data": float(-q.gather(-1, data_y[:, at, None]).mean()),
            "generated": int(counted.sum())}


def run(cfg: Config):
    names = [s for s in cfg.students.split(",") if s]
    if not names:
        raise UserError("recipe=bench.policy needs students=PATH[,PATH...] (distilled students to compare)")
    device = resolve_device(cfg.device)
    teacher = require_llama(load_teacher(cfg.teacher, device, "fp32", recipe="bench.policy"), "teacher",
                            "bench.policy")
    corpus, tok = teacher_data(teacher, TrainConfig.tokenizer, cfg.data)
    windows = _windows(cfg, corpus, device)
    rows = ["| student | KL own samples | teacher NLL own samples | KL data | CE data |", "|---|---:|---:|---:|---:|"]
    for name in names:
        student = require_llama(load_model(name, device), "students", "bench.policy")
        if student.config.vocab_size != teacher.config.vocab_size:
            raise UserError(f"students={name}: vocabulary {student.config.vocab_size}, the teacher's "
                            f"{teacher.config.vocab_size}")
        s = scores(teacher, student, windows, cfg.prompt, cfg.seed, tok.eos_id)
        line = (f"| {name} | {s['kl_own']:.4f} | {s['teacher_nll_own']:.4f} | {s['kl_data']:.4f} | "
                f"{s['ce_data']:.4f} |")
        progress(f"bench.policy: {name}: {s['generated']} generated tokens scored")
        rows.append(line)
    table = "\n".join(rows)
    print(f"{len(windows)} prompts of {cfg.prompt} tokens, {cfg.new_tokens} sampled (T=1); nats/token\n{table}")
    if cfg.out:
        Path(cfg.out).expanduser().write_text(table + "\n")
    return table
