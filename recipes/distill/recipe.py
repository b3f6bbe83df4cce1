"""Knowledge distillation: ``purestep recipe=distill teacher=PATH``: a frozen teacher teaches a smaller student.

The objective is Hinton's ``alpha * T**2 * KL_T(teacher || student) + (1 - alpha) * CE`` (Hinton, Vinyals &
Dean 2015) with forward, reverse or DistiLLM's symmetric KL, or GKD's generalized JSD (``kl=jsd beta=``, Agarwal
et al. 2024; ``models.losses``). The teacher is anything
``models.loading.load_model`` reads (a purestep checkpoint or run folder, a Hugging Face folder, a GGUF
file, the name ``smollm2``); its params are an input of the train step (``frozen``), not a trained leaf
and not a baked-in constant, and its forward runs under ``torch.no_grad`` (never ``inference_mode``: the
learnable temperature differentiates through the teacher's softened distribution).

Students (``student=``):

- ``config``: a fresh Llama of the ``model.*`` shape (unset keys take ``LlamaConfig``'s defaults, exactly
  as ``recipe=standard``), vocabulary = the teacher's;
- ``drop_layers``: the teacher with every other layer kept (0, 2, 4, ...), initialized from those layers'
  weights and the teacher's embeddings and norms (DistilBERT, Sanh et al. 2019);
- ``shrink``: the teacher's architecture with the ``model.*`` keys that are set replacing its widths
  (heads, head and MLP widths follow unless set), randomly initialized;
- ``init=CHECKPOINT`` instead: start from that model (e.g. to continue distilling a student).

Temperatures (``temperature_mode=``): ``fixed``; ``scheduled`` (linear from ``temperature`` to
``temperature_end`` over the run); ``learnable`` (CTKD, Li et al. AAAI 2023: ``T`` in
``(temperature_min, temperature_max)`` through a gradient-reversal layer ramped in over
``temperature_ramp_steps``; its parameter ``kd_temperature`` sits in the params pytree, so the same AdamW
trains it, and as a 0-d leaf it is not weight-decayed). The step reaches the schedules through the batch:
``batch["step"]`` is the data cursor, which is the optimizer step (after a spike rollback, which skips
batches, the schedules follow the data).

``on_policy=`` (GKD's ``lmbda``, ``recipes/distill/on_policy.py``) lets the student continue that fraction of the
sequences itself (its KV-cache decode, outside the compiled step) and the teacher score them: the KL on the states
the student visits when it generates.

``cache=PATH`` trains from teacher outputs cached offline by ``recipe=distill_cache`` (top-k with an
"other" bucket, or Random-Sampling KD) with no teacher forward at all. Validation reports the student's
CE loss and perplexity (and the teacher's once, for reference). Checkpoints hold the student as a plain
Llama (``model`` entry, tokenizer), so ``recipe=generate init=`` and ``recipe=standard init=`` take them.
Data parallel (torchrun) works online, each rank running the teacher on its own rows; ``fim_rate``,
which cannot apply here, is refused. ``orchestrator.enabled=true`` (``recipes/orchestrator/driver.py``) works as in
``recipe=standard``: its branches train the student against the same teacher (online or cached) on the same
batches, and its probe is the student's CE on held-out windows.

``preset=smollm2`` is the short SmolLM2-135M-Instruct configuration::

    purestep recipe=distill preset=smollm2 data=/path/to/tinyshakespeare.txt

(100 steps of 4 x 64 tokens into a 16M-parameter student; its wall time and the student's and teacher's val loss
are in docs/distill.md, "Measured".)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from purestep.core.parallel import distributed
from purestep.core.parallel.shard import Layout
from purestep.core.config import ConfigError, UserError, option, same_as, to_dict
from purestep.core.device import resolve_device
from purestep.core.step import Compile, make_eval_step, per_block
from purestep.core.data.documents import DocCorpus
from purestep.core.io.telemetry import flops_per_token
from purestep.core.tree import size
from purestep.models import llama, losses
from purestep.models.loading import LoadedModel, model_entry, require_llama
from purestep.recipes import standard
from purestep.recipes.distill.cache import TeacherCache
from purestep.recipes.distill.objective import DistillBatches, check_temperature, make_loss
from purestep.recipes.distill.on_policy import OnPolicy, on_policy_step
from purestep.recipes.distill import hidden as hidden_targets
from purestep.recipes.distill.student import NOT_STUDENT, STUDENTS, THETA, StudentModel, build_student
from purestep.recipes.distill.teacher import (data_identity, held_dtype_hint, load_teacher, shard_teacher,
                                     teacher_data, teacher_dtype_option, teacher_identity, teacher_option)
from purestep.recipes.orchestrator.config import OrchestratorConfig, orchestrator_option
from purestep.recipes.train.config import TrainConfig
from purestep.recipes.orchestrator.driver import orchestrate
from purestep.recipes.train import backend, plan, setup
from purestep.recipes.train.data import check_batch, describe, with_epochs
from purestep.recipes.train.loop import Loop, Measures, Steps, Validation, build_steps, evaluate
from purestep.recipes.train.setup import RunSetup, run_folder

DESCRIPTION = "distill a frozen teacher (checkpoint, HF folder, GGUF, smollm2) into a smaller student"
GRID = True                 # seed=1,2 and grid.KEY=A,B run it per cell (core.cli.grid)

TEMPERATURE_MODES = ("fixed", "scheduled", "learnable")


@dataclass
class Config(TrainConfig):
    orchestrator: OrchestratorConfig = orchestrator_option()
    teacher: str = teacher_option()
    teacher_dtype: str = teacher_dtype_option()
    teacher_shard: bool = option(False, "parallel=fsdp: shard the frozen teacher across the ranks too (1/N of it "
                                 "held at rest, gathered a block at a time for every step's forward, whole where the "
                                 "step is one graph); false: each rank holds it whole")
    student: str = option("config", "student: config (model.*), drop_layers (every other teacher layer), "
                                    "shrink (teacher shape, model.* widths)", choices=STUDENTS)
    model: StudentModel = option(StudentModel, "student shape for student=config/shrink")
    alpha: float = option(0.5, "weight of the KD term: alpha*T^2*KL + (1-alpha)*CE", min=0, max=1)
    temperature: float = option(1.0, "softmax temperature T (the start value when scheduled or learnable)", above=0)
    temperature_mode: str = option("fixed", "fixed, scheduled (linear to temperature_end), learnable (CTKD)",
                                   choices=TEMPERATURE_MODES)
    temperature_end: float = option(1.0, "scheduled: the temperature at the last step", above=0)
    temperature_min: float = option(1.0, "learnable: lower bound of T (CTKD: 1)", above=0)
    temperature_max: float = option(21.0, "learnable: upper bound of T (CTKD: 1 + 20)", above=0)
    temperature_ramp_steps: int = option(200, "learnable: steps of the cosine ramp of the gradient reversal (0: none)",
                                         min=0)
    kl: str = option("forward", "KL direction: forward KL(p||q), reverse KL(q||p), symmetric (DistiLLM), jsd (GKD's "
                     "generalized Jensen-Shannon, with beta)", choices=losses.DIRECTIONS)
    symmetric_lambda: float = option(0.9, "kl=symmetric: weight of the reverse KL", min=0, max=1)
    beta: float = option(0.5, "kl=jsd: beta*KL(p||m) + (1-beta)*KL(q||m), m = beta*p + (1-beta)*q (GKD, TRL); "
                         "0: forward KL, 1: reverse KL", min=0, max=1)
    cache: str = option("", "train from this offline teacher cache (recipe=distill_cache); empty: online teacher")
    on_policy: float = option(0.0, "GKD's lmbda: the fraction of sequences the student continues itself (its KV-cache "
                              "decode) for the teacher to score, the KL on its tokens; 0: off-policy only", min=0, max=1)
    on_policy_prompt: int = option(0, "on_policy: the window's first tokens kept as the prompt; the student generates "
                                   "the other block_size - on_policy_prompt (0: half the window)", min=0)
    on_policy_temperature: float = option(1.0, "on_policy: the student's sampling temperature (0: greedy)", min=0)
    hidden: str = option("", "hidden-state targets: student:teacher pairs of residual streams after that many blocks "
                         "(0: the embeddings), e.g. 2:4,4:8; projected when the widths differ")
    hidden_weight: float = option(1.0, "hidden: weight of the hidden-state term added to the KD objective", min=0)
    hidden_loss: str = option("mse", "hidden: the distance, mse or cosine (1 - cosine similarity per position)",
                              choices=hidden_targets.LOSSES)
    sample_tokens: int = same_as(standard.Config, "sample_tokens")
    sample_prompt: str = same_as(standard.Config, "sample_prompt")
    sample_temperature: float = same_as(standard.Config, "sample_temperature")


PRESETS = {
    # SmolLM2-135M-Instruct into a 16M-param student (49k-vocab embeddings + 4 blocks of d=256), 100 x 256 tokens;
    # the teacher's forward dominates the step (docs/design.md, 'Measured choices'; the run: docs/distill.md).
    "smollm2": {"teacher": "smollm2", "student": "config", "model": {"d_model": 256, "n_layers": 4, "n_heads": 4},
                "block_size": 64, "batch_size": 4, "steps": 100, "warmup_steps": 10, "lr": 2e-3, "min_lr": 2e-4,
                "eval_every": 50, "eval_batches": 8, "save_every": 0, "log_every": 5, "sample_tokens": 48,
                "compile": False},
}


# ---------------------------------------------------------------------------------------------- the step

# ---------------------------------------------------------------------------------------------- the run

class Teacher(NamedTuple):
    """The run's frozen teacher: the loaded model (``teacher_shard=true``: its params' shapes only), its identity
    (``teacher.teacher_identity``, what a resumed run and a cache are checked against), the train step's frozen
    inputs (``{"teacher": params}``, this rank's shards under ``layout``; None with a cache) and, with ``cache=``,
    the cache of its outputs that replaces its forward."""
    model: LoadedModel
    identity: dict
    frozen: Optional[dict]
    layout: Optional[Layout]          # teacher_shard=true: where the teacher's shards live (core.parallel.shard)
    cache: Optional[TeacherCache]


@dataclass
class Prepared:
    """A run built and checked by :func:`prepare_run` before its folder is touched."""
    cfg: Config                  # the run's config, ``steps`` set from ``epochs`` when given
    student: llama.LlamaConfig
    how: str                     # how the student was built (``student.build_student``)
    teacher: Teacher
    data: standard.Data          # the corpus (tokenized with the teacher's tokenizer), train and validation batches
    run: RunSetup                # the (resumed) state and optimizer, the ranks (``run.dist``), the layout


def check_keys(cfg: Config, world_size: int):
    """The common training keys this recipe cannot honour are refused, never ignored."""
    if cfg.fim_rate > 0:
        raise UserError(f"fim_rate={cfg.fim_rate}: fill-in-the-middle adds sentinel ids the teacher never saw; "
                        f"distill without it")
    if cfg.teacher_shard and cfg.cache:
        raise UserError("teacher_shard=true with cache=: a cached run reads the teacher's outputs, not the teacher; "
                        "drop one of them")
    if cfg.cache and world_size > 1:
        raise UserError("cache= is keyed by the single-process batch; run data-parallel distillation online")
    if cfg.hidden and cfg.cache:
        raise ConfigError(f"hidden={cfg.hidden} with cache={cfg.cache}: a cache holds the teacher's output "
                          f"distributions, not its hidden states; distill online (drop cache=) or drop hidden=")
    if cfg.on_policy > 0:
        if cfg.cache:
            raise ConfigError(f"on_policy={cfg.on_policy:g} with cache={cfg.cache}: a cache holds the teacher's outputs "
                              f"on the data's windows, not on the student's own continuations; distill on-policy "
                              f"online (drop cache=) or set on_policy=0")
        if not 0 < on_policy_prompt(cfg) < cfg.block_size:
            raise ConfigError(f"bad value for 'on_policy_prompt': {cfg.on_policy_prompt}; the prompt must leave the "
                              f"student tokens to write in block_size={cfg.block_size}: 1 to {cfg.block_size - 1}")


def check_tensor_parallel(cfg: Config) -> None:
    """What ``parallel=fsdp,tp`` cannot do here, refused before any rank joins: a sharded teacher (the teacher is
    whole on every rank and its blocks run as they are) and on-policy rollouts (they decode whole params)."""
    if cfg.parallel == "fsdp,tp" and cfg.teacher_shard:
        raise ConfigError("teacher_shard=true with parallel=fsdp,tp: the teacher is held whole on every rank there "
                          "(its blocks run as they are, not tensor parallel); drop teacher_shard")
    if cfg.parallel == "fsdp,tp" and cfg.on_policy > 0:
        raise ConfigError(f"on_policy={cfg.on_policy:g} with parallel=fsdp,tp: the student's rollouts decode whole "
                          f"params, which fsdp,tp holds split; use parallel=fsdp or on_policy=0")


def on_policy_prompt(cfg: Config) -> int:
    """The prompt length of an on-policy row (``on_policy_prompt``, 0: half the window)."""
    return cfg.on_policy_prompt or cfg.block_size // 2


def prepare_run(cfg: Config, folder: Optional[Path] = None) -> Prepared:
    """The run in ``folder`` (resumed from its checkpoint, ``recipes.train.setup.start``), or with ``folder`` None a
    fresh state and nothing to write (``dry_run``, benchmarks). Everything that can fail on bad input happens here."""
    check_tensor_parallel(cfg)
    dist, device = distributed.init(resolve_device(cfg.device), cfg.parallel, mesh=cfg.mesh)
    check_keys(cfg, dist.world_size)
    theta0 = check_temperature(cfg)
    teacher = require_llama(load_teacher(cfg.teacher, device, cfg.teacher_dtype), "teacher", "distill")
    with dist.main_first():   # rank 0 tokenizes into the cache, the others then read it
        corpus, tok = teacher_data(teacher, cfg.tokenizer, cfg.data, cfg)
    student_cfg, params, how = build_student(cfg, teacher, device)
    teacher_id = teacher_identity(teacher)
    cache = open_cache(cfg, corpus, teacher_id)
    if cfg.on_policy > 0 and isinstance(corpus, DocCorpus):
        raise UserError(f"on_policy={cfg.on_policy:g}: the student continues a text stream's windows, not the packed "
                        f"documents of JSONL data={cfg.data}; distill it off-policy (on_policy=0)")
    if theta0 is not None:
        params[THETA] = torch.tensor(theta0, dtype=torch.float32, device=device)
    layer_pairs = hidden_targets.pairs(cfg.hidden, student_cfg, teacher.config)
    projections = hidden_targets.init_projections(layer_pairs, student_cfg, teacher.config, cfg.seed, device)
    if projections:
        params[hidden_targets.PROJ] = projections
    check_batch(cfg, max(student_cfg.vocab_size, teacher.config.vocab_size), device, dist.data_world)
    batches = corpus.batches(cfg.batch_size, cfg.block_size, cfg.seed, grad_accum=cfg.grad_accum, device=device,
                             rank=dist.data_rank, world_size=dist.data_world)
    val_batches = corpus.eval_batches(cfg.batch_size * dist.data_world, cfg.block_size, cfg.eval_batches,
                                      device=device)
    cfg = with_epochs(cfg, corpus, batches)
    run_setup = setup.start(cfg, folder, params, device=device, dist=dist, tokenizer=tok)
    check_resumed_teacher(run_setup, teacher_id)
    frozen, teacher_layout = (None, None) if cache else shard_teacher(cfg.teacher_shard, dist, teacher)
    if teacher_layout is not None:
        teacher = replace(teacher, params=teacher_layout.full_shapes())    # only the shards stay alive
    return Prepared(cfg, student_cfg, how, Teacher(teacher, teacher_id, frozen, teacher_layout, cache),
                    standard.Data(corpus, batches, val_batches, student_cfg.vocab_size), run_setup)


def open_cache(cfg: Config, corpus, teacher_id: dict) -> Optional[TeacherCache]:
    """The offline teacher cache of ``cache=``, checked against this run's teacher and data (None without one)."""
    if not cfg.cache:
        return None
    if isinstance(corpus, DocCorpus):
        raise UserError(f"cache={cfg.cache}: cached teacher targets follow a text stream's windows, not the rows "
                        f"of JSONL data={cfg.data} (loss_on, pack); distill it online (drop cache=)")
    cache = TeacherCache.open(cfg.cache)
    cache.check_run(cfg, teacher_id, data_identity(corpus))
    return cache


def check_resumed_teacher(run: RunSetup, teacher_id: dict) -> None:
    """A resumed run continues with the teacher it was distilled from (held in the same dtype)."""
    old = run.resumed.get("teacher") or {}
    if old.get("fingerprint") and old["fingerprint"] != teacher_id["fingerprint"]:
        held = held_dtype_hint(old, teacher_id)
        raise UserError(f"{run.resume}: its teacher was {held}; give that teacher_dtype or use another out=" if held
                        else f"{run.resume}: it was distilled from another teacher ({old['source']}); use another out=")


def rollout(p: Prepared) -> Optional[OnPolicy]:
    """The student's continuations of ``on_policy=`` (``recipes.distill.on_policy``), None when it is 0."""
    cfg = p.cfg
    if cfg.on_policy == 0:
        return None
    return OnPolicy(cfg.on_policy, on_policy_prompt(cfg), cfg.on_policy_temperature, cfg.seed, p.run.dist.rank,
                    p.student, p.data.corpus.tokenizer.eos_id, cfg.dtype, p.run.layout)


def train_steps(p: Prepared, optimizer) -> Steps:
    """The run's steps (``recipes.train.loop.build_steps``) for ``optimizer``: the run's own (``p.run.optimizer``),
    or a strategy's when the orchestrator switches. The train step rolls out the on-policy rows first
    (:func:`rollout`) and, with ``teacher_shard``, gathers the teacher from its shards (one block at a time where
    it gathers the student's so, ``core.step.Parallel``); the eval step is the
    student's CE; the batches carry the cursor (and the cached targets) for the objective."""
    cfg, teacher, layout = p.cfg, p.teacher, p.run.layout
    device, params = p.run.state.step.device, standard.full_params(p)
    tcfg = teacher.model.config
    loss_fn = make_loss(cfg, p.student, tcfg, teacher.cache.mode if teacher.cache else "",
                        hidden_targets.pairs(cfg.hidden, p.student, tcfg))
    steps = build_steps(cfg, loss_fn, optimizer, params, p.data.train, device, p.data.vocab, p.run.dist, layout,
                        frozen_shards={"teacher": teacher.layout} if teacher.layout else None)
    train = on_policy_step(steps.train, rollout(p))
    eval_step = make_eval_step(lambda prm, b, layers=None: llama.loss(prm, b, p.student, layers=layers),
                               precision=cfg.dtype,
                               compile=Compile(backend.eval_compiled(cfg), backend.compile_scope(cfg, params),
                                               backend.compile_mode(cfg, device)),
                               shard=layout)
    return replace(steps, train=train, eval=eval_step, batches=DistillBatches(steps.batches, teacher.cache))


def train_flops_per_token(p: Prepared) -> float:
    """The student's training FLOPs per token plus, online, the teacher's forward (a third of its training), and
    with ``on_policy`` that fraction of a student forward (the rollouts: the prompt's prefill, one per new token)."""
    cfg, s, t = p.cfg, p.student, p.teacher.model.config
    student = student_params(p)
    flops = flops_per_token(llama.matmul_params(student), s.n_layers, cfg.block_size, s.d_model)
    if p.teacher.cache is None:
        flops += flops_per_token(llama.matmul_params(p.teacher.model.params), t.n_layers, cfg.block_size,
                                 t.d_model) / 3
    student_forward = flops_per_token(llama.matmul_params(student), s.n_layers, cfg.block_size, s.d_model) / 3
    return flops + cfg.on_policy * student_forward


def student_params(p: Prepared) -> dict:
    """The student's own params whole (``standard.full_params``), without the learnable temperature and the
    hidden-state projections the state also trains."""
    return {k: v for k, v in standard.full_params(p).items() if k not in NOT_STUDENT}


def describe_teacher(p: Prepared) -> str:
    """Where the student's targets come from: the teacher's forward online, or the cache of its outputs."""
    if p.teacher.cache:
        return f"outputs from the {p.teacher.cache.describe()}"
    if p.teacher.layout is None:
        return "forward online (frozen, no_grad)"
    by_block = per_block(p.run.layout, p.cfg.compile, backend.compile_scope(p.cfg, standard.full_params(p)))
    return (f"forward online (frozen, no_grad); teacher sharded across {p.run.dist.world_size} ranks, gathered "
            + ("one block at a time as it runs" if by_block else "whole for every step"))


def dry_run(cfg: Config) -> str:
    """``dry_run=true``: the plan of this run (``recipes.train.plan``), the teacher's forward in the probed step
    (online) or the cache's reads; no run folder is created."""
    p = prepare_run(plan.probe_config(cfg), None)
    s, teacher, corpus = p.student, p.teacher.model, p.data.corpus
    t = teacher.config
    held = (f"{teacher.format} {teacher.source}, {size(teacher.params):,} params, {t.n_layers} layers, "
            f"d={t.d_model} ({plan.megabytes(plan.tree_bytes(teacher.params))} held, frozen); "
            + (f"outputs from the {p.teacher.cache.describe()}" if p.teacher.cache else "forward online"))
    return plan.describe(replace(cfg, steps=p.cfg.steps), recipe="distill", folder=run_folder(cfg, "distill"),
                         model=f"student ({'init' if cfg.init else cfg.student}: {p.how}), {s.n_layers} "
                               f"layers, d={s.d_model}, vocab {s.vocab_size} ({corpus.tokenizer.name})",
                         data=describe(corpus), train_tokens=corpus.meta["train_tokens"], state=p.run.state,
                         steps=train_steps(p, p.run.optimizer), device=p.run.state.step.device,
                         world_size=p.run.dist.data_world, frozen=p.teacher.frozen, extra=(f"teacher: {held}",))


def run(cfg: Config):
    folder = run_folder(cfg, "distill")
    p = prepare_run(cfg, folder)
    cfg, run, dist, teacher, corpus = p.cfg, p.run, p.run.dist, p.teacher, p.data.corpus
    device = run.state.step.device
    steps = train_steps(p, run.optimizer)
    extra = {"config": to_dict(cfg), "model": model_entry(p.student), "tokenizer": corpus.tokenizer.to_dict(),
             "recipe": "distill", "teacher": teacher.identity}
    measures = Measures(cfg.batch_size * cfg.block_size * cfg.grad_accum * dist.data_world, train_flops_per_token(p))
    with run.writing(to_dict(cfg)) as (checkpoints, logger):
        announce(logger, p, folder)
        if run.resume is not None:
            logger.print(f"resuming from {run.resume} at step {int(run.state.step)}")
        else:
            teacher_baseline(logger, p)
        orchestrator, steps = orchestrate(
            cfg, steps, val_tokens=corpus.val, device=device, logger=logger, folder=folder, resumed=run.resumed,
            make_step=lambda optimizer: train_steps(p, optimizer).train, main_process=dist.is_main)
        validation = Validation(lambda params: evaluate(steps.eval, params, p.data.val, dist=dist),
                                standard.on_main(standard.sampler(cfg, p.student, corpus.tokenizer, corpus.val, device),
                                                 dist, run.layout))
        with Loop(cfg, run.state, steps, logger, checkpoints, counters=run.loop, frozen=teacher.frozen,
                  hooks=[orchestrator], validation=validation, measures=measures, extra=lambda: extra,
                  dist=dist) as loop:
            for batch in loop:
                loop.stepped(*steps.train(loop.state, batch, teacher.frozen))
        learned = f", final T {learned_temperature(loop.result.state.params, cfg):.3f}" \
            if cfg.temperature_mode == "learnable" else ""
        standard.report(logger, loop.result, folder, label="student val loss", suffix=learned)
    distributed.shutdown(dist)
    return loop.result


def announce(logger, p: Prepared, folder: Path) -> None:
    """The run log's first lines: the teacher, the student, the data, where it runs, the objective."""
    cfg, s, teacher, dist = p.cfg, p.student, p.teacher.model, p.run.dist
    t, tok, device = teacher.config, p.data.corpus.tokenizer, p.run.state.step.device
    logger.print(f"distill: teacher {teacher.format}: {teacher.source} ({size(teacher.params) / 1e6:.2f}M "
                 f"params, {t.n_layers} layers, d={t.d_model})")
    logger.print(f"student ({'init' if cfg.init else cfg.student}: {p.how}): "
                 f"{size(student_params(p)) / 1e6:.2f}M params, {s.n_layers} layers, d={s.d_model}; "
                 f"vocab {t.vocab_size} ({tok.name}); data {describe(p.data.corpus)}; device {device}, {cfg.dtype}, "
                 f"{backend.describe_compile(cfg, device.type, dist.world_size > 1)}; run folder {folder}")
    divergence = f"generalized JSD (beta={cfg.beta:g})" if cfg.kl == "jsd" else f"{cfg.kl} KL"
    logger.print(f"objective: {cfg.alpha:g} * T^2 * {divergence} + {1 - cfg.alpha:g} * CE, temperature "
                 f"{_describe_temperature(cfg)}; teacher {describe_teacher(p)}")
    if cfg.hidden:
        logger.print(f"hidden-state targets: + {cfg.hidden_weight:g} * {cfg.hidden_loss} of student:teacher "
                     f"states {cfg.hidden}" + (f" (through learned {s.d_model}x{t.d_model} projections)"
                                               if s.d_model != t.d_model else ""))
    if cfg.on_policy > 0:
        prompt = on_policy_prompt(cfg)
        logger.print(f"on-policy (GKD): each sequence with probability {cfg.on_policy:g} is the first {prompt} "
                     f"tokens of its window continued by the student for {cfg.block_size - prompt} (KV-cache "
                     f"decode at temperature {cfg.on_policy_temperature:g}, outside the compiled step), the "
                     f"{divergence} on its tokens")


def teacher_baseline(logger, p: Prepared) -> None:
    """A fresh run's reference line: the teacher's validation loss and perplexity on the run's validation batches."""
    cfg, teacher = p.cfg, p.teacher
    tcfg = teacher.model.config
    teacher_eval = make_eval_step(lambda prm, b, layers=None: llama.loss(prm, b, tcfg, layers=layers),
                                  precision=cfg.dtype, shard=teacher.layout)
    loss = evaluate(teacher_eval, teacher.frozen["teacher"] if teacher.layout else teacher.model.params, p.data.val,
                    dist=p.run.dist)
    logger.scalars(0, {"val/teacher_loss": loss})
    logger.print(f"teacher: val loss {loss:.4f}, perplexity {math.exp(min(loss, 50.0)):.2f}")


def learned_temperature(params, cfg: Config) -> float:
    """The learnable temperature's current value (host float, for messages)."""
    u = torch.sigmoid(params[THETA].float()).item()
    return cfg.temperature_min + (cfg.temperature_max - cfg.temperature_min) * u


def _describe_temperature(cfg: Config) -> str:
    if cfg.temperature_mode == "scheduled":
        return f"{cfg.temperature:g} -> {cfg.temperature_end:g} (linear)"
    if cfg.temperature_mode == "learnable":
        return (f"learnable from {cfg.temperature:g} in ({cfg.temperature_min:g}, {cfg.temperature_max:g}), "
                f"gradient reversal ramped over {cfg.temperature_ramp_steps} steps")
    return f"{cfg.temperature:g}"
