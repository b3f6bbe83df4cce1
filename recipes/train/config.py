"""The keys every training recipe takes (names fixed so scripts and docs can rely on them).

Recipe configs subclass ``TrainConfig`` and add their own keys. Defaults live here, once; the key table
of docs/configuration.md is generated from these declarations (``purestep recipe=standard --help`` prints the same).
A config that adds a layer with its own section (a strategy layer, say) lists it in :meth:`TrainConfig.run_hooks`
(``recipes.train.hooks.RunHook``): that is all the shared trainer knows of it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from purestep.core.compile import COMPILE_MODES
from purestep.core.config import ConfigError, option
from purestep.core.device import DEVICES
from purestep.core.parallel.distributed import MESH_DIMS, PARALLEL, SHARDED
from purestep.core.host_memory import MODES as HOST_MEMORY
from purestep.core.spike import SpikeConfig
from purestep.core.gradients import PRECISIONS
from purestep.optim.schedules import KINDS
from purestep.recipes.train.backend import EVAL_COMPILES, GRAD_MODES, SCOPES
from purestep.recipes.train.faults import FaultConfig
from purestep.recipes.train.optimizer import OPTIMIZERS, AdaGCConfig, MuonConfig   # declared with the optimizer factory

CLIPPING = ("global", "adagc", "agc", "none")


@dataclass
class TrainConfig:
    steps: int = option(1000, "optimizer steps to train for (the run's length)", min=1)
    epochs: float = option(0.0, "train for this many passes over the data instead (sets steps; 0: use steps)",
                           min=0)
    out: str = option("", "run folder (default runs/<recipe>-<name or timestamp>)")
    name: str = option("", "run name; names the default run folder")
    seed: int = option(1337, "seed for init, data order and dropout: same seed, same run", min=0)
    device: str = option("auto", "where to train", choices=DEVICES)
    dtype: str = option("fp32", "compute precision (bf16/fp16 autocast, fp32 master weights)",
                        choices=tuple(PRECISIONS))
    batch_size: int = option(16, "sequences per micro-batch", min=1)
    block_size: int = option(128, "tokens per sequence (context length)", min=1)
    grad_accum: int = option(1, "micro-batches averaged per optimizer step", min=1)
    optimizer: str = option("adamw", "adamw, or muon: Muon (Newton-Schulz orthogonalised momentum) for the hidden "
                            "matrices, AdamW (lr, beta1, beta2, weight_decay) for embeddings, head, norms; not with "
                            "parallel=fsdp", choices=OPTIMIZERS)
    lr: float = option(1e-3, "peak learning rate (0 holds the weights: an evaluation-only run)", min=0)
    warmup_steps: int = option(100, "linear warmup steps", min=0)
    lr_schedule: str = option("cosine", "decay after warmup", choices=KINDS)
    decay_steps: int = option(0, "step at which the decay reaches min_lr (0: steps)", min=0)
    min_lr: float = option(1e-4, "learning-rate floor of the cosine/linear decay", min=0)
    weight_decay: float = option(0.1, "AdamW decoupled weight decay (not on norms, biases, embeddings)", min=0)
    beta1: float = option(0.9, "AdamW beta1", min=0, below=1)
    beta2: float = option(0.99, "AdamW beta2", min=0, below=1)
    muon: MuonConfig = option(MuonConfig, "Muon settings (optimizer=muon; Keller Jordan's Muon, torch.optim.Muon)")
    clipping: str = option("global", "gradient clipping: global norm, AdaGC (per tensor and layer), AGC "
                           "(unit-wise), none", choices=CLIPPING)
    grad_clip: float = option(1.0, "global-norm clip threshold (clipping=global; AdaGC's warm-up lambda_abs)", min=0)
    adagc: AdaGCConfig = option(AdaGCConfig, "AdaGC settings (clipping=adagc; Wang et al. 2025)")
    agc_clip: float = option(0.01, "AGC threshold on |grad| / |weight| per unit (clipping=agc; NFNets)", above=0)
    health: bool = option(True, "gradient health statistics per tensor and layer, logged every log_every")
    remat: bool = option(False, "activation checkpointing: recompute block activations in backward")
    grad_mode: str = option("auto", "how the step differentiates: func (torch.func in the one compiled graph: "
                            "forward, backward and update fused) or autograd (the loss a graph of its own, whose "
                            "backward AOTAutograd splits off, recomputing cheap activations instead of keeping them: "
                            "a lower peak; the update a graph of its own); auto: func where the whole step compiles "
                            "up to 4 layers, else autograd", choices=GRAD_MODES)
    spike: SpikeConfig = option(SpikeConfig, "loss-spike detection and rollback (PaLM/OPT practice)")
    skip_nonfinite: bool = option(True, "a step whose gradients are not finite leaves the params and optimizer "
                                  "state as they were (false: it writes its NaNs, one select per leaf less)")
    max_skipped_steps: int = option(25, "stop without finishing (exit 4, stopped.msgpack) once this many steps in a "
                                        "row were non-finite and skipped, checked every log_every (0: never)", min=0)
    peak_flops: float = option(0.0, "device peak FLOP/s for MFU (0: known GPUs by name; none on CPU)", min=0)
    cost_per_hour: float = option(0.0, "price of the machine per hour, for the cost meter (0: off)", min=0)
    budget: float = option(0.0, "stop cleanly with a checkpoint once the cost reaches this (0: no limit)", min=0)
    fault: FaultConfig = option(FaultConfig, "deliberate faults, for testing the stability machinery")
    log_every: int = option(10, "steps between metric pulls to TensorBoard/JSONL/console", min=1)
    eval_every: int = option(250, "steps between validation runs (0: only at the end)", min=0)
    eval_batches: int = option(20, "validation batches per evaluation (fixed windows)", min=1)
    patience: int = option(0, "stop after this many evaluations without a better val loss (0: off)", min=0)
    save_every: int = option(500, "steps between checkpoints (0: only final/best)", min=0)
    save_every_minutes: float = option(0.0, "also a checkpoint once this much wall time has passed since the "
                                       "last one (0: off; under torchrun agreed at log steps)", min=0)
    keep_last: int = option(3, "step checkpoints to keep (0: all; best and final are kept besides)", min=0)
    checkpoint_shards: bool = option(False, "parallel=fsdp, fsdp,tp, hsdp: every rank writes its own pieces of the "
                                     "state at once (step_N.shard-I-of-K.msgpack) beside rank 0's index; a resumed rank reads "
                                     "only its own rows of them (false: rank 0 writes one file, the leaves gathered to it one at a time)")
    resume: str = option("auto", "auto (newest good checkpoint in out), never, or a checkpoint PATH")
    parallel: str = option("auto", "several ranks under torchrun: ddp (replicated state, gradients averaged), fsdp "
                           "(params, gradients and optimizer state sharded), fsdp,tp (fsdp over the dp ranks of "
                           "mesh=, each block tensor parallel over its tp ranks; standard and distill), hsdp (fsdp "
                           "within each dp group of mesh=, replicated across its rep groups), auto (ddp under "
                           "torchrun, else none), none (one process)", choices=PARALLEL)
    mesh: str = option("", "parallel=fsdp,tp: the ranks as data-parallel x tensor-parallel, dp:D,tp:T; "
                       "parallel=hsdp: as replicas x shards, rep:R,dp:D (the product = the ranks torchrun starts)")
    compile: bool = option(True, "compile the train step (and the eval step: eval_compile) with torch.compile")
    fused: bool = option(False, "eager steps (compile=false): AdamW, its clipping and the non-finite skip in place "
                         "by torch's fused kernel (torch.optim.AdamW(fused=True)), the same numbers at torch.optim's "
                         "memory; with optimizer=adamw, clipping=global or none, one process")
    eval_compile: str = option("auto", "compile the eval step too (auto: when the run evaluates at least "
                               "1000 batches, eval_batches x evaluations; below that the compile costs more than it "
                               "saves); ignored under compile=false", choices=EVAL_COMPILES)
    compile_scope: str = option("auto", "what one compiled graph covers: the whole step, or the model's block, "
                                "compiled once for every layer (compile time flat in depth), its loss tail (final "
                                "norm, head, cross entropy) a graph of its own; auto: step up to 4 layers and on CUDA "
                                "unless parallel=fsdp, block beyond", choices=SCOPES)
    compile_mode: str = option("default", "torch.compile mode (reduce-overhead: CUDA graphs, ignored with a warning "
                               "off CUDA; max-autotune: kernel autotuning)", choices=COMPILE_MODES)
    tf32: bool = option(False, "TensorFloat-32 CUDA matmuls and cuDNN (Ampere+); ignored with a warning off CUDA")
    host_memory: str = option("auto", "host memory freed by a step: keep it in the process for the next step (no "
                              "page faults, a higher resident peak), or leave glibc's malloc as it is (system); "
                              "auto: keep when training on the CPU; keep is ignored with a warning off glibc",
                              choices=("auto", *HOST_MEMORY))
    data: str = option("stdlib", "text: a file, folder, glob, or 'stdlib' (this Python's own source); or JSONL "
                       "(.jsonl, .jsonl.gz: a file, folder or glob) of {\"text\"} or {\"messages\"} records")
    text_field: str = option("text", "JSONL: the field holding a text record's document")
    loss_on: str = option("all", "JSONL: train on every token, or only the assistant's tokens of chats",
                          choices=("all", "assistant"))
    pack: bool = option(True, "JSONL: pack documents into block_size rows (attention and RoPE positions per "
                        "document); false: one document per row, padded, long ones split")
    val_fraction: float = option(0.1, "fraction held out for validation: documents by line hash (JSONL), files by "
                                 "path hash, or the end of a single text file", above=0, below=1)
    val_data: str = option("", "JSONL: a separate validation file, folder or glob (instead of val_fraction)")
    tokenizer: str = option("byte", "byte, char, or a tokenizer.json PATH")
    fim_rate: float = option(0.0, "fill-in-the-middle: fraction of windows rearranged prefix/suffix/middle "
                                  "(code corpora; Bavarian et al. 2022); 0: off", min=0, max=1)
    init: str = option("", "start from this checkpoint's weights (fine-tuning) instead of random init")

    def __post_init__(self):
        if self.clipping in ("global", "adagc") and self.grad_clip <= 0:
            raise ConfigError(f"grad_clip={self.grad_clip} must be > 0 with clipping={self.clipping} "
                              f"(use clipping=none to turn clipping off)")
        if self.budget > 0 and self.cost_per_hour <= 0:
            raise ConfigError(f"budget={self.budget} needs cost_per_hour > 0 to meter the cost")
        _check_paths(self.out, self.resume)
        if self.parallel in SHARDED and self.clipping == "agc":
            raise ConfigError(f"clipping=agc with parallel={self.parallel}: AGC's unit norms are not wired for "
                              f"sharded gradients; use clipping=global or clipping=adagc")
        if self.parallel in SHARDED and self.optimizer == "muon":
            raise ConfigError(f"optimizer=muon with parallel={self.parallel}: Newton-Schulz orthogonalises whole "
                              f"matrices and fsdp shards them; use parallel=ddp or optimizer=adamw")
        _check_tensor_parallel(self)
        _check_grad_mode(self)
        if self.checkpoint_shards and self.parallel not in SHARDED:
            raise ConfigError(f"checkpoint_shards=true with parallel={self.parallel}: only a sharded run's ranks hold "
                              f"pieces to write (parallel={', '.join(SHARDED)})")
        for hook in self.run_hooks():
            hook.check()

        refusal = fused_refusal(self) if self.fused else None
        if refusal:
            raise ConfigError(refusal)

    def run_hooks(self) -> tuple:
        """The layers this config's sections add to a run (``recipes.train.hooks.RunHook``): a recipe's config opts
        into a layer by declaring its section, whose ``run_hook(cfg)`` answers, switched on or off by the section;
        the shared trainer never names one."""
        sections = (getattr(self, f.name) for f in dataclasses.fields(self))
        return tuple(section.run_hook(self) for section in sections if hasattr(section, "run_hook"))


def _check_grad_mode(cfg: TrainConfig) -> None:
    """ConfigErrors for ``grad_mode=func`` where the keys alone rule it out (``remat``, the block graph, tensor
    parallel); ``compile_scope=auto`` choosing the block graph is told when the step is built
    (``backend.grad_mode``)."""
    if cfg.grad_mode != "func":
        return
    for bad, why in ((cfg.remat, "remat=true (activation checkpointing needs torch.autograd)"),
                     (cfg.compile and cfg.compile_scope == "block", "compile_scope=block"),
                     (cfg.parallel == "fsdp,tp", "parallel=fsdp,tp (torch.func.grad cannot take DTensors)")):
        if bad:
            raise ConfigError(f"grad_mode=func differentiates the whole step in one torch.func graph, which {why} "
                              f"rules out: use grad_mode=autograd or auto")


def _check_tensor_parallel(cfg: TrainConfig) -> None:
    """ConfigErrors for ``parallel=fsdp,tp`` keys that cannot hold (``core.parallel.tensor``): ``mesh=`` without
    it, a whole-step graph (tensor parallel compiles the block), dropout (its masks are drawn whole)."""
    if cfg.parallel != "fsdp,tp":
        if cfg.mesh and cfg.parallel not in MESH_DIMS:
            raise ConfigError(f"mesh={cfg.mesh} lays out the ranks of parallel=fsdp,tp or hsdp; add one of them or "
                              f"drop mesh=")
        return
    if cfg.compile_scope == "step":
        raise ConfigError("compile_scope=step with parallel=fsdp,tp: tensor parallel runs every block on DTensors, "
                          "which torch.func.grad's one-graph step cannot take; use compile_scope=block (or auto)")
    model = getattr(cfg, "model", None)
    if (getattr(model, "dropout", 0) or 0) > 0:
        raise ConfigError("model.dropout > 0 with parallel=fsdp,tp: dropout's masks are not drawn per tensor-parallel "
                          "piece; use model.dropout=0")


def refuse_mesh_parallel(parallel: str, recipe: str) -> None:
    """A ConfigError for the 2-D modes (``parallel=fsdp,tp``, ``hsdp``: ``mesh=``) in a recipe they do not run: they
    are wired through the shared train loop (standard, distill); upcycle's blockwise step and compress's compressor
    have steps and keys of their own."""
    if parallel in MESH_DIMS:
        raise ConfigError(f"parallel={parallel} runs recipe=standard and recipe=distill; recipe={recipe} takes "
                          f"parallel=fsdp or ddp")


def fused_refusal(cfg: TrainConfig, ranks: int = 1) -> str:
    """Why ``fused=true`` cannot apply to a run of ``cfg`` over ``ranks`` processes ("" when it can): the fused step is
    AdamW's (``optim.fused``) with global-norm clipping at most, eager and donated (``core.update.apply_in_place``),
    in one process."""
    kept = [h.loop_key for h in cfg.run_hooks() if h.keeps_states]
    reasons = [(cfg.compile, "compile=true (a compiled step's update is fused by inductor already; the fused step is "
                             "the eager one, compile=false)"),
               (cfg.optimizer != "adamw", f"optimizer={cfg.optimizer} (the kernel is AdamW's)"),
               (cfg.clipping not in ("global", "none"),
                f"clipping={cfg.clipping} (the kernel folds in global-norm clipping only)"),
               (cfg.parallel in ("ddp", *SHARDED) or ranks > 1, f"parallel={cfg.parallel} over several ranks (one "
                                                              f"process only)"),
               (bool(kept), f"{kept[0] if kept else ''}.* switched on (it steps one state more than once, so the step "
                            f"cannot write into it)")]
    found = [why for refused, why in reasons if refused]
    return f"fused=true cannot apply with {found[0]}: drop fused=true" if found else ""


def _check_paths(out: str, resume: str) -> None:
    """Refuse at once (before any tokenizing or loading) a run folder that can never be created because a
    file stands in its path, and a ``resume=PATH`` that does not exist."""
    if out:
        for parent in [Path(out), *Path(out).parents]:
            if parent.exists():
                if not parent.is_dir():
                    raise ConfigError(f"out={out}: {parent} is a file, not a folder; choose another out=")
                break
    if resume not in ("auto", "never") and not Path(resume).exists():
        raise ConfigError(f"resume={resume}: no such checkpoint file or run folder (use resume=auto, "
                          f"resume=never or an existing PATH)")


def train_config(section, cls: type = TrainConfig, **overrides) -> TrainConfig:
    """The config (``cls``: TrainConfig or a subclass) a recipe's own config ``section`` (a dataclass) runs
    ``recipes.train.loop.Loop`` with: every key of ``section`` that ``cls`` also has, then ``overrides``; the rest
    ``cls``'s defaults."""
    names = {f.name for f in dataclasses.fields(cls)}
    shared = {f.name: getattr(section, f.name) for f in dataclasses.fields(section) if f.name in names}
    return cls(**{**shared, **overrides})
