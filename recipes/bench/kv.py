"""Benchmark: any two checkpoints, teacher against student, with the upcycle recipe's benchmark phase.

``purestep recipe=bench.kv teacher=PATH student=PATH [data=TEXT] [benchmark.prompt_tokens=256,1024,2048]
[benchmark.batches=1,4] ...``: both models (purestep checkpoints or run folders, Hugging Face folders, .gguf,
``smollm2``; the student typically an upcycle phase's folder, e.g. ``RUN/global``) are loaded in this process;
``data=`` is tokenized with the teacher's tokenizer (the student must share its vocabulary) and every held-out
number comes from the test half of its validation split, as in ``recipe=upcycle``. Measured exactly as the
upcycle benchmark phase (``recipes/upcycle/benchmark.py``: held-out and strided perplexity, the latency/KV sweep
with chunked prefill, passkey retrieval, behaviour cases) and written to ``out=`` (default
``runs/bench-kv-NAME``) as ``results.{json,csv,md}``, ``tables.tex``, PNG charts and TensorBoard scalars.
"""
from __future__ import annotations

from dataclasses import dataclass

from purestep.core.config import UserError, option
from purestep.core.data.text import EvalBatches, prepare
from purestep.core.device import DEVICES, resolve_device
from purestep.core.io.logging import progress
from purestep.core.cli.runs import run_folder
from purestep.models.loading import load_model
from purestep.recipes.distill.teacher import load_teacher
from purestep.recipes.upcycle import benchmark, report
from purestep.recipes.upcycle.config import BenchmarkConfig
from purestep.recipes.upcycle.phases import heldout_loss
from purestep.recipes.upcycle.sweep import Model

DESCRIPTION = "teacher vs student (any two checkpoints): latency/KV sweep, perplexity, passkey, behaviour"


@dataclass
class Config:
    teacher: str = option("smollm2", "the baseline: checkpoint or run folder, Hugging Face folder, .gguf, or "
                          "smollm2")
    student: str = option("", "the model compared with it (e.g. an upcycle run's RUN/global), same vocabulary")
    data: str = option("stdlib", "text for the held-out numbers (file, folder, glob, stdlib), teacher's tokenizer")
    block_size: int = option(128, "tokens per held-out window (and the student's trained context, for the passkey "
                             "table)", min=2)
    eval_windows: int = option(16, "held-out windows (test half of the validation split)", min=1)
    seed: int = option(1337, "seed of the passkey trials", min=0)
    device: str = option("cpu", "where both models run", choices=DEVICES)
    out: str = option("", "result folder (empty: runs/bench-kv-NAME)")
    name: str = option("", "run name under runs/ (empty: a timestamp)")
    benchmark: BenchmarkConfig = option(BenchmarkConfig, "the sweep and the quality measurements (as upcycle's)")


def load_pair(cfg: Config, device) -> tuple:
    if not cfg.student:
        raise UserError("recipe=bench.kv needs student=PATH (and teacher=PATH, default smollm2)")
    teacher = load_teacher(cfg.teacher, device, "fp32", recipe="bench.kv")
    student = load_model(cfg.student, device=device)
    if teacher.tokenizer is None:
        raise UserError(f"teacher={cfg.teacher} ({teacher.format}) has no tokenizer to tokenize data= with")
    if student.config.vocab_size != teacher.config.vocab_size:
        raise UserError(f"student={cfg.student} has a vocabulary of {student.config.vocab_size}, the teacher "
                        f"{teacher.config.vocab_size}; the two must share the teacher's tokenizer")
    return teacher, student


def run(cfg: Config) -> dict:
    device = resolve_device(cfg.device)
    teacher, student = load_pair(cfg, device)
    for who, loaded in (("teacher", teacher), ("student", student)):
        benchmark.check_contexts(cfg.benchmark, loaded.config, f"benchmark ({who})")
    corpus = prepare(cfg.data, teacher.tokenizer)
    test = corpus.val[len(corpus.val) // 2:]
    if len(test) < cfg.block_size + 1:
        raise UserError(f"data={cfg.data}: the test half of the validation split ({len(test):,} tokens) is shorter "
                        f"than one window of {cfg.block_size + 1}; give more text or a smaller block_size")
    folder = run_folder(cfg.out, cfg.name, "bench-kv")
    per = 4 if cfg.eval_windows % 4 == 0 else 1
    heldout = EvalBatches(test, per, cfg.block_size, cfg.eval_windows // per, device=device)
    models = [Model("teacher", teacher.module, teacher.params, teacher.config),
              Model("student", student.module, student.params, student.config)]
    losses = {m.name: heldout_loss(m.module, m.params, m.cfg, heldout) for m in models}
    progress(f"bench.kv: teacher {teacher.source} ({teacher.arch}), student {student.source} ({student.arch}); "
             f"KV bytes/token (bf16) {teacher.module.kv_bytes_per_token(teacher.config):,} vs "
             f"{student.module.kv_bytes_per_token(student.config):,}; held-out loss {losses['teacher']:.4f} vs "
             f"{losses['student']:.4f}; results in {folder}")
    results = benchmark.evaluate(models, teacher.tokenizer, heldout.tokens, cfg.benchmark, losses=losses,
                                 block_size=cfg.block_size, trained_context=cfg.block_size, seed=cfg.seed,
                                 device=device, say=progress)
    results["stages"] = {"teacher": losses["teacher"], "student": losses["student"]}
    report.write(folder, results, say=progress)
    print(report.markdown(results))
    benchmark.check_failed(results, folder)
    return results
