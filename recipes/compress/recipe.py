"""Hidden-state compression: ``purestep recipe=compress teacher=PATH d_compressed=D'`` (or ``sweep=D'1,D'2,...``).

Trains the weight-tied linear compressor of ``models.compressor`` (``z = (x - mu) W``, ``x_hat = z W^T + mu``)
to reconstruct a frozen teacher's hidden states (``layer=``, default the last block's output), and measures
it against PCA fitted on the very same training states, the optimal linear map of that width (Eckart-Young;
a tied linear autoencoder's optimum is that projection, Baldi & Hornik 1989), on the same held-out states.

- Stages: ``stage=1a`` reconstructs states of general text (``data=``); ``stage=1b`` fine-tunes stage 1a's
  best checkpoint on a second domain (``data_1b=``, e.g. code or docs); ``stage=1a,1b`` runs both in order.
  Each stage trains with AdamW until ``steps`` or until ``patience`` evaluations without a lower held-out
  loss, and keeps only its best checkpoint: ``stage1a_best.msgpack``, ``stage1b_best.msgpack`` (with the
  metrics inside). A finished stage is skipped when the command runs again; an interrupted one resumes.
- The loss is the mean squared error per token over the training states' total variance (the fraction of
  variance unexplained), so one learning rate fits any teacher's scale. Held-out metrics: MSE, mean
  per-token cosine, relative error ``||X_hat - X||_F / ||X||_F``, explained variance.
- ``sweep=64,128,256,512``: one run per D' in ``out/d<D'>/``, all reading the same teacher states.
- Every run writes ``summary.csv``, ``summary.md`` (and ``summary.png`` with matplotlib): per D' and stage,
  the compression ratio, parameters and each metric next to PCA's.

Teacher states come from ``recipes.compress.states``: fixed windows of ``block_size`` tokens (``train_tokens``
from the training split, ``val_tokens`` from the validation split), cached once to a memmap
(``cache=true``) or computed by the teacher for every batch (``cache=false``).
"""
from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import click

from purestep.core.io import checkpoint as ckpt
from purestep.core.io.cache import write_csv, write_file, write_text
from purestep.core.parallel import distributed
from purestep.recipes.train.config import refuse_mesh_parallel
from purestep.core.config import ConfigError, UserError, option, same_as, to_dict
from purestep.core.data.documents import prepare_text
from purestep.core.device import resolve_device
from purestep.core.parallel.distributed import Dist
from purestep.core.io.logging import progress
from purestep.core.cli.runs import claim
from purestep.core.spike import SpikeConfig
from purestep.core.state import init_state
from purestep.models import compressor
from purestep.recipes.compress import states
from purestep.recipes.distill.teacher import teacher_dtype_option
from purestep.recipes.train.config import TrainConfig, train_config
from purestep.recipes.train.loop import Loop, Measures, Validation, build_steps
from purestep.recipes.train import setup
from purestep.recipes.train.setup import run_folder

DESCRIPTION = "compress a teacher's hidden states with a weight-tied linear map, against PCA (stages 1a/1b, sweeps)"

STAGES = ("1a", "1b")
COLUMNS = ("stage", "d_compressed", "ratio", "params", "steps", "best_step", "start_cosine", "cosine", "pca_cosine",
           "cosine_gap",
           "mse", "pca_mse", "rel_error", "pca_rel_error", "explained_variance", "pca_explained_variance")
METRICS = ("mse", "cosine", "rel_error", "explained_variance")


@dataclass
class Config:
    teacher: str = option("", "teacher: checkpoint or run folder, Hugging Face folder, .gguf, or 'smollm2'")
    teacher_dtype: str = teacher_dtype_option()
    layer: int = option(-1, "hidden state to compress: 0 the embeddings, i the input of block i, -1 (= n_layers) "
                            "the last block's output", min=-1)
    d_compressed: int = option(0, "compressed width D' of a single run (set this or sweep)", min=0)
    sweep: tuple[int, ...] = option((), "widths D' to train, one run each in out/d<D'> (set this or d_compressed)",
                                    min=1)
    center: str = option("learned", "centering mu: learned (starts at the training mean), fixed (the training "
                                    "mean), none", choices=compressor.CENTERS)
    weight_init: str = option("orthogonal", "initial W: orthogonal (random orthonormal columns) or normal "
                                            "(N(0, 1/D))", choices=compressor.INITS)
    stage: tuple[str, ...] = option(("1a",), "stages to run in order: 1a (data=), 1b (fine-tune 1a's best on "
                                              "data_1b=), or 1a,1b")
    data: str = same_as(TrainConfig, "data")
    data_1b: str = option("", "stage 1b's text, a different domain (file, folder, glob, or 'stdlib')")
    cache: bool = option(True, "cache the teacher's states once in a memmap ($PURESTEP_CACHE/states); false: "
                               "run the teacher for every batch")
    train_tokens: int = option(32768, "training states per stage (windows of block_size tokens)", min=1)
    val_tokens: int = option(8192, "held-out states per stage (from the validation split)", min=1)
    block_size: int = option(128, "tokens per window the teacher reads", min=1)
    batch_size: int = option(16, "windows per training step (batch_size x block_size states)", min=1)
    steps: int = option(500, "optimizer steps per stage (fewer if early stopping ends it)", min=1)
    lr: float = option(1e-2, "peak learning rate (the loss is scale-free, so it carries across teachers; "
                             "0 holds the weights)", min=0)
    warmup_steps: int = option(50, "linear warmup steps", min=0)
    lr_schedule: str = same_as(TrainConfig, "lr_schedule")
    min_lr: float = option(5e-4, "learning-rate floor of the decay", min=0)
    weight_decay: float = option(0.0, "AdamW weight decay of W (decay pulls W off the projection: keep 0)", min=0)
    beta1: float = same_as(TrainConfig, "beta1")
    beta2: float = same_as(TrainConfig, "beta2")
    eval_every: int = option(50, "steps between held-out evaluations (0: only at the end)", min=0)
    patience: int = option(3, "stop a stage after this many evaluations without a lower held-out loss (0: off)", min=0)
    log_every: int = same_as(TrainConfig, "log_every")
    seed: int = same_as(TrainConfig, "seed")
    device: str = same_as(TrainConfig, "device")
    parallel: str = same_as(TrainConfig, "parallel")
    compile: bool = option(False, "compile the train step (two matmuls: little to gain, a compile per width)")
    out: str = same_as(TrainConfig, "out")
    name: str = same_as(TrainConfig, "name")

    def __post_init__(self):
        if self.d_compressed and self.sweep:
            raise ConfigError("set d_compressed=D' (one run) or sweep=D'1,D'2,... (one run per width), not both")
        if self.d_compressed < 0 or any(d < 1 for d in self.sweep) or len(set(self.sweep)) != len(self.sweep):
            raise ConfigError(f"widths D' must be distinct and >= 1, got {','.join(map(str, self.widths))}")
        if not self.stage or any(s not in STAGES for s in self.stage) or list(self.stage) != sorted(set(self.stage)):
            raise ConfigError(f"bad value for 'stage': {','.join(self.stage)}; choose 1a, 1b or 1a,1b")
        if "1b" in self.stage and not self.data_1b:
            raise ConfigError("stage 1b needs data_1b= (text of a different domain than data=)")
        for key in ("steps", "train_tokens", "val_tokens", "block_size", "batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 1")

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(self.sweep) or (self.d_compressed,)


@dataclass
class StageData:
    """One stage's states and the statistics every width shares: moments, PCA, the loss scale."""
    name: str
    source: str
    train: object                    # a state set (recipes.compress.states)
    val: object
    moments: compressor.Moments
    pca: compressor.PCA
    scale: float


def run(cfg: Config) -> list[dict]:
    if not cfg.d_compressed and not cfg.sweep:
        raise ConfigError("set d_compressed=D' (one run) or sweep=D'1,D'2,... (one run per width)")
    refuse_mesh_parallel(cfg.parallel, "compress")
    dist, device = distributed.init(resolve_device(cfg.device), cfg.parallel)
    folder = run_folder(cfg, "compress")
    teacher = states.Teacher(cfg.teacher, cfg.layer, device, cfg.teacher_dtype)
    too_wide = [d for d in cfg.widths if d > teacher.d_model]
    if too_wide:
        raise UserError(f"D'={too_wide[0]} is wider than the teacher's hidden states (D={teacher.d_model})")
    subs = {d: folder / f"d{d}" if cfg.sweep else folder for d in cfg.widths}
    if cfg.stage[0] == "1b":
        missing = [subs[d] / "stage1a_best.msgpack" for d in cfg.widths
                   if not (subs[d] / "stage1a_best.msgpack").exists()]
        if missing:
            raise UserError(f"stage=1b fine-tunes {missing[0]}, which does not exist: run stage=1a (same out=) first")
    data = {"1a": cfg.data, "1b": cfg.data_1b}
    with dist.main_first():   # rank 0 computes (and caches) the teacher's states, the others then read them
        stage_data = {s: load_stage(cfg, s, data[s], teacher, device) for s in cfg.stage}
    # the first write: a second run on this folder stops here, naming this one (rank 0 writes for every rank)
    with claim(folder) if dist.is_main else nullcontext():
        rows = [train_stage(cfg, stage_data[s], d, subs[d], teacher, device, dist) for d in cfg.widths
                for s in cfg.stage]
        if dist.is_main:
            write_summary(folder, rows)
            click.echo(markdown(rows))
    distributed.shutdown(dist)
    return rows


def load_stage(cfg: Config, stage: str, data: str, teacher: states.Teacher, device) -> StageData:
    corpus = prepare_text(data, teacher.tokenizer)
    key = Path(corpus.path).name
    windows = {split: states.Windows.over(tokens, math.ceil(n / cfg.block_size), cfg.block_size, corpus.describe(split))
               for split, tokens, n in (("train", corpus.train, cfg.train_tokens), ("val", corpus.val, cfg.val_tokens))}
    train = states.open_states(teacher, windows["train"], key, cache=cfg.cache, device=device)
    val = states.open_states(teacher, windows["val"], key, cache=cfg.cache, device=device)
    if not cfg.cache:
        val = val.to_memory()       # read at every evaluation: computed once per run
    moments = states.moments(train)
    return StageData(stage, corpus.meta["source"], train, val, moments,
                     compressor.PCA(moments, center=cfg.center != "none"), moments.total_variance())


def signature(cfg: Config, data: StageData, d: int, teacher: states.Teacher) -> dict:
    """What a stage checkpoint must agree on to be resumed, skipped or fine-tuned from."""
    return {"teacher": teacher.fingerprint, "layer": teacher.layer, "data": data.source, "d_compressed": d,
            "center": cfg.center}


def train_stage(cfg: Config, data: StageData, d: int, sub: Path, teacher: states.Teacher, device,
                dist: Dist = Dist()) -> dict:
    """Train (or resume, or skip when finished) one stage at width ``d``; returns its summary row. Under torchrun
    every rank trains on its rows of each batch (parallel=fsdp: the compressor's params and moments sharded,
    ``core.parallel.shard``); rank 0 writes."""
    best_path, folder = sub / f"stage{data.name}_best.msgpack", sub / f"stage{data.name}"
    sig = signature(cfg, data, d, teacher)
    if best_path.exists():
        top = ckpt.read_meta(best_path)
        _check_signature(best_path, top, sig)
        progress(f"stage {data.name} at D'={d} is finished ({best_path}); skipping it")
        return top["metrics"]
    ccfg = compressor.CompressorConfig(teacher.d_model, d, cfg.center, cfg.weight_init)
    start, init_from = _start(cfg, data, ccfg, sub, sig, device)
    params, frozen = compressor.split(start, ccfg)
    # the loop's settings: this recipe's keys, the rest fixed; the run wiring every training recipe shares
    tcfg = train_config(cfg, clipping="none", health=False, save_every=0, keep_last=1, spike=SpikeConfig(enabled=False))
    run = setup.start(tcfg, folder, params, device=device, dist=dist,
                      check=lambda path, top: _check_signature(path, top, sig))
    template = init_state(params, run.optimizer, cfg.seed)   # what the best checkpoint (full leaves) loads into

    def loss_fn(params, batch, frozen):
        return compressor.loss({**params, **frozen}, batch["x"], data.scale)

    def held_out(params) -> dict:
        return compressor.evaluate({**params, **frozen}, states.chunks(data.val), data.scale)

    batches = states.Batches(data.train, cfg.batch_size, cfg.seed, rank=dist.rank, world_size=dist.world_size)
    steps = build_steps(tcfg, loss_fn, run.optimizer, params, batches, device, vocab_size=0, dist=dist,
                        layout=run.layout)
    extra = {"config": to_dict(cfg), "recipe": "compress", "stage": data.name, "compressor": dataclasses.asdict(ccfg),
             "frozen": frozen, "signature": sig, "teacher": teacher.identity(), "init": init_from}
    pca = compressor.evaluate(data.pca.params(d, device=device), states.chunks(data.val), data.scale)
    before = held_out(params)
    with run.writing(to_dict(cfg)) as (checkpoints, logger):
        logger.print(f"compress stage {data.name}: D'={d} of D={teacher.d_model} ({ccfg.ratio:.2f}x), "
                     f"{compressor.count_params(ccfg):,} params, center {cfg.center}; teacher {teacher.source} "
                     f"layer {teacher.layer}; {data.train.n * cfg.block_size:,} train / "
                     f"{data.val.n * cfg.block_size:,} held-out states of {data.source}; start: {init_from} "
                     f"(cosine {before['cosine']:.4f}); PCA: cosine {pca['cosine']:.4f}, keeps "
                     f"{data.pca.explained(d):.1%} of the training variance; run folder {folder}")
        if run.resume is not None:
            logger.print(f"resuming from {run.resume} at step {int(run.state.step)}")
        validation = Validation(lambda p: held_out(run.layout.gather(p) if run.layout else p)["unexplained"],
                                perplexity=False)
        with Loop(tcfg, run.state, steps, logger, checkpoints, counters=run.loop, frozen=frozen,
                  validation=validation, measures=Measures(tokens_per_step=cfg.batch_size * cfg.block_size
                                                           * dist.world_size), extra=lambda: extra, dist=dist) as loop:
            for batch in loop:
                loop.stepped(*steps.train(loop.state, batch, frozen))
        result = loop.result
        best = ckpt.load(folder / ckpt.BEST, template=template, device=device)   # every rank: the file rank 0 kept
        dist.barrier()   # read by all before rank 0 replaces it (_keep_only)
        ours = held_out(best["state"].params)
        row = {"stage": data.name, "d_compressed": d, "ratio": round(ccfg.ratio, 4),
               "params": compressor.count_params(ccfg), "steps": int(result.state.step), "best_step": best["step"],
               "start_cosine": before["cosine"], "cosine_gap": pca["cosine"] - ours["cosine"],
               **{m: ours[m] for m in METRICS}, **{f"pca_{m}": pca[m] for m in METRICS}}
        logger.scalars(best["step"], {f"best/{m}": ours[m] for m in METRICS} | {f"pca/{m}": pca[m] for m in METRICS})
        logger.print(f"stage {data.name} D'={d}: best step {best['step']} of {row['steps']}: " + ", ".join(
            f"{m.replace('_', ' ')} {ours[m]:.4g} (PCA {pca[m]:.4g})" for m in METRICS) + f"; kept {best_path}")
    if dist.is_main:
        _keep_only(best, best_path, folder, row)
    dist.barrier()   # the next stage (or width) starts from what rank 0 kept
    return row


def _start(cfg: Config, data: StageData, ccfg, sub: Path, sig: dict, device) -> tuple[dict, str]:
    """Initial params: stage 1a from ``weight_init`` (``mu`` at the training mean), 1b from 1a's best."""
    if data.name == "1a":
        return compressor.init(ccfg, cfg.seed, mean=data.moments.mean, device=device), f"{cfg.weight_init} init"
    path = sub / "stage1a_best.msgpack"
    top = ckpt.load(path, device=device)
    if {**top["signature"], "data": None} != {**sig, "data": None}:
        raise UserError(f"{path} was trained with another teacher, layer, width or centering ({top['signature']}); "
                        f"use another out= for this stage 1b")
    params = {**top["state"]["params"], **top.get("frozen", {})}
    return {k: v.to(device) for k, v in params.items()}, f"{path} (step {top['step']})"


def _check_signature(path: Path, top: dict, sig: dict) -> None:
    if top.get("signature") != sig:
        raise UserError(f"{path} holds a run with other settings ({top.get('signature')}, this run: {sig}); "
                        f"use another out= (or delete it)")


def _keep_only(best: dict, best_path: Path, folder: Path, row: dict) -> None:
    """Write the best checkpoint (with its metrics) as ``best_path``, then drop the stage's other checkpoints."""
    keep = {k: v for k, v in best.items() if k not in ("format", "step", "state")}
    ckpt.save(best_path, best["state"], step=best["step"], extra={**keep, "metrics": row})
    for p in folder.glob("*.msgpack"):
        p.unlink()


# -------------------------------------------------------------------------------------------------- summary

def _cell(key: str, v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if key.endswith("mse") else f"{v:.4f}"
    return str(v)


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(c, r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def write_summary(folder: Path, rows: list[dict]) -> None:
    """``summary.csv``, ``summary.md`` and, with matplotlib, ``summary.png`` (cosine and explained variance vs D')."""
    folder.mkdir(parents=True, exist_ok=True)
    write_csv(folder / "summary.csv", [COLUMNS, *([r[c] for c in COLUMNS] for r in rows)])
    write_text(folder / "summary.md", markdown(rows) + "\n")
    try:
        import matplotlib
    except ImportError:
        progress("matplotlib is not installed: no summary.png (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("cosine", "explained_variance")):
        for stage in dict.fromkeys(r["stage"] for r in rows):
            mine = [r for r in rows if r["stage"] == stage]
            x = [r["d_compressed"] for r in mine]
            ax.plot(x, [r[metric] for r in mine], "o-", label=f"compressor, stage {stage}")
            ax.plot(x, [r[f"pca_{metric}"] for r in mine], "x--", label=f"PCA, stage {stage}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("D'")
        ax.set_title(f"held-out {metric.replace('_', ' ')}")
        ax.legend()
    fig.tight_layout()
    write_file(folder / "summary.png", lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)
