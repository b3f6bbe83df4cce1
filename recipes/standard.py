"""The standard recipe: train a Llama language model on text, from scratch or from a checkpoint.

``purestep recipe=standard`` with no keys trains a small byte-level model on this Python's own standard
library source (a real corpus on every machine) and finishes in minutes on a laptop CPU. Presets follow
FundamentaLLM's sizes (small 128d/4h/2L, medium 512/8/6, large 768/12/12) plus ``tiny`` for a quick
look. nanoGPT's char-level shakespeare CPU configuration is::

    purestep recipe=standard data=shakespeare.txt tokenizer=char model.n_layers=4 model.n_heads=4 \\
        model.d_model=128 block_size=64 batch_size=12 lr=1e-3 beta2=0.99 warmup_steps=100 \\
        steps=2000 min_lr=1e-4 optimizer=muon muon.lr=0.01 muon.momentum=0.9 dtype=bf16

with Muon (``NANOGPT_MUON``), which passes nanoGPT's final val loss in about a quarter of the run
(docs/benchmarks.md gives the figures). bf16 autocast: nanoGPT computes fp32 on the CPU; ``dtype=fp32`` is nanoGPT's
precision, ``optimizer=adamw`` its algorithm (docs/training.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from purestep.core.parallel import distributed
from purestep.core.config import UserError, option, to_dict
from purestep.core.device import resolve_device
from purestep.core.data.fim import FIM, fim_ids
from purestep.core.io.telemetry import flops_per_token
from purestep.core.tree import cast, size
from purestep.models import llama
from purestep.models.loading import load_model, model_entry, require_llama
from purestep.models.sampling import generate
from purestep.recipes.orchestrator.config import OrchestratorConfig, orchestrator_option
from purestep.recipes.orchestrator.driver import orchestrate
from purestep.recipes.train import backend, plan, setup
from purestep.recipes.train.config import TrainConfig
from purestep.recipes.train.data import check_batch, describe, open_data, with_epochs
from purestep.recipes.train.loop import Loop, Measures, Steps, Validation, build_steps, evaluate
from purestep.recipes.train.setup import run_folder

DESCRIPTION = "train a Llama language model on text (from scratch or init=CHECKPOINT)"
GRID = True                 # seed=1,2 and grid.KEY=A,B run it per cell (core.cli.grid)


# The Muon keys of nanoGPT's shakespeare-char configuration's command above (bench.wall's optimizer=muon runs them)
NANOGPT_MUON = ("optimizer=muon", "muon.lr=0.01", "muon.momentum=0.9")

@dataclass
class Config(TrainConfig):
    orchestrator: OrchestratorConfig = orchestrator_option()
    model: llama.LlamaConfig = option(llama.LlamaConfig, "model shape (vocab_size 0: the tokenizer's)")
    sample_tokens: int = option(200, "tokens generated as a sample at each evaluation (0: no samples)", min=0)
    sample_prompt: str = option("", "prompt for samples (default: the start of the validation text)")
    sample_temperature: float = option(0.8, "sampling temperature for the samples", min=0)


PRESETS = {
    "tiny": {"model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4, "block_size": 64, "batch_size": 16,
             "steps": 300, "warmup_steps": 30, "eval_every": 100, "save_every": 100, "eval_batches": 10},
    "small": {"model.d_model": 128, "model.n_layers": 2, "model.n_heads": 4, "block_size": 128,
              "batch_size": 16, "steps": 2000},
    "medium": {"model.d_model": 512, "model.n_layers": 6, "model.n_heads": 8, "block_size": 256,
               "batch_size": 16, "steps": 5000, "lr": 6e-4, "min_lr": 6e-5},
    "large": {"model.d_model": 768, "model.n_layers": 12, "model.n_heads": 12, "block_size": 512,
              "batch_size": 16, "steps": 10000, "lr": 6e-4, "min_lr": 6e-5},
}


class Data(NamedTuple):
    """A run's data: the corpus (its tokenizer, validation tokens and sizes), the train batches this rank reads,
    the fixed validation batches, and the ids the model must embed (the tokenizer's and the FIM sentinels)."""
    corpus: object
    train: object
    val: object
    vocab: int


@dataclass
class Prepared:
    """A run built and checked by :func:`prepare_run` before its folder is touched."""
    cfg: Config              # the run's config, ``steps`` set from ``epochs`` when given
    folder: Path             # the run folder (``run_folder``: out=, or runs/standard-<name or timestamp>)
    start: object            # models.loading.LoadedModel of init=, or None
    model_cfg: llama.LlamaConfig
    data: Data
    run: setup.RunSetup      # the (resumed) state and optimizer, the ranks (``run.dist``), the layout


def prepare_run(cfg: Config, write: bool = True) -> Prepared:
    """The run of ``cfg`` in its run folder (resumed from its checkpoint), or with ``write`` false a fresh state
    and nothing to write (``dry_run``, benchmarks). Everything that can fail on bad input happens here."""
    folder = run_folder(cfg, "standard")
    dist, device = distributed.init(resolve_device(cfg.device), cfg.parallel, mesh=cfg.mesh)
    start = require_llama(load_model(cfg.init, device=device), "init", "standard") if cfg.init else None
    with dist.main_first():   # rank 0 tokenizes into the cache, the others then read it
        corpus = open_data(cfg, start.tokenizer if start and start.tokenizer else cfg.tokenizer)
    tok = corpus.tokenizer
    (fim_pre, fim_suf, fim_mid), fim_extra = fim_ids(tok) if cfg.fim_rate > 0 else ((0, 0, 0), 0)
    vocab = tok.vocab_size + fim_extra
    model_cfg = start.config if start else _model_config(cfg.model, vocab)
    if start and model_cfg.vocab_size < vocab:
        raise UserError(f"init={cfg.init}: its vocabulary ({model_cfg.vocab_size}) is smaller than the "
                        f"{vocab} ids this run needs (tokenizer {tok.vocab_size} + {fim_extra} FIM sentinels)")
    check_batch(cfg, vocab, device, dist.data_world)
    batches = corpus.batches(cfg.batch_size, cfg.block_size, cfg.seed, grad_accum=cfg.grad_accum, device=device,
                             rank=dist.data_rank, world_size=dist.data_world,
                             fim=FIM(cfg.fim_rate, fim_pre, fim_suf, fim_mid) if cfg.fim_rate > 0 else None)
    val_batches = corpus.eval_batches(cfg.batch_size * dist.data_world, cfg.block_size, cfg.eval_batches,
                                      device=device)
    cfg = with_epochs(cfg, corpus, batches)
    params = cast(start.params, device=device) if start else llama.init(model_cfg, cfg.seed, device=device)
    run_setup = setup.start(cfg, folder if write else None, params, device=device, dist=dist, tokenizer=tok)
    if start and run_setup.layout is not None:    # parallel=fsdp: only the shards stay alive
        start = replace(start, params=run_setup.layout.full_shapes())
    return Prepared(cfg, folder, start, model_cfg, Data(corpus, batches, val_batches, vocab), run_setup)


def full_params(p) -> dict:
    """The params of a prepared run ``p`` (a recipe's ``Prepared``: its ``RunSetup`` as ``p.run``) whole; under
    parallel=fsdp their shapes only (the state holds this rank's shards)."""
    return p.run.layout.full_shapes() if p.run.layout else p.run.state.params


def train_steps(p: Prepared, optimizer) -> Steps:
    """The run's train and eval steps (``recipes.train.loop.build_steps``) for ``optimizer``: the run's own
    (``p.run.optimizer``), or a strategy's when the orchestrator switches."""
    cfg, model_cfg = p.cfg, p.model_cfg

    def loss_fn(params, batch, key, layers=None):
        return llama.loss(params, batch, model_cfg, key if model_cfg.dropout > 0 else None, remat=cfg.remat,
                          layers=layers)

    return build_steps(cfg, loss_fn, optimizer, full_params(p), p.data.train, p.run.state.step.device,
                       p.data.vocab, p.run.dist, p.run.layout)


def dry_run(cfg: Config) -> str:
    """``dry_run=true``: the plan of this run (``recipes.train.plan``); no run folder is created."""
    p = prepare_run(plan.probe_config(cfg), write=False)
    m, tok = p.model_cfg, p.data.corpus.tokenizer
    return plan.describe(replace(cfg, steps=p.cfg.steps), recipe="standard", folder=p.folder,
                         model=f"llama, {m.n_layers} layers, d={m.d_model}, {m.n_heads} heads, vocab {m.vocab_size} "
                               f"({tok.name})" + (f"; init from {p.start.source}" if p.start else ""),
                         data=describe(p.data.corpus), train_tokens=p.data.corpus.meta["train_tokens"],
                         state=p.run.state, steps=train_steps(p, p.run.optimizer),
                         device=p.run.state.step.device, world_size=p.run.dist.data_world)


def run(cfg: Config):
    p = prepare_run(cfg)
    cfg, run, dist, model_cfg, corpus = p.cfg, p.run, p.run.dist, p.model_cfg, p.data.corpus
    device = run.state.step.device
    steps = train_steps(p, run.optimizer)
    extra = {"config": to_dict(cfg), "model": model_entry(model_cfg), "tokenizer": corpus.tokenizer.to_dict(),
             "recipe": "standard"}
    measures = Measures(cfg.batch_size * cfg.block_size * cfg.grad_accum * dist.data_world,
                        flops_per_token(llama.matmul_params(full_params(p)), model_cfg.n_layers, cfg.block_size,
                                        model_cfg.d_model),
                        None if (p.start or run.resume) else math.log(model_cfg.vocab_size))
    with run.writing(to_dict(cfg)) as (checkpoints, logger):
        announce(logger, p)
        orchestrator, steps = orchestrate(
            cfg, steps, val_tokens=corpus.val, device=device, logger=logger, folder=p.folder, resumed=run.resumed,
            make_step=lambda optimizer: train_steps(p, optimizer).train, main_process=dist.is_main)
        validation = Validation(lambda params: evaluate(steps.eval, params, p.data.val, dist=dist),
                                on_main(sampler(cfg, model_cfg, corpus.tokenizer, corpus.val, device), dist,
                                        steps.layout))
        with Loop(cfg, run.state, steps, logger, checkpoints, counters=run.loop, hooks=[orchestrator],
                  validation=validation, measures=measures, extra=lambda: extra, dist=dist) as loop:
            for batch in loop:
                loop.stepped(*steps.train(loop.state, batch))
        report(logger, loop.result, p.folder)
    distributed.shutdown(dist)
    return loop.result


def announce(logger, p: Prepared) -> None:
    """The run log's first lines: the model, the data, where it runs, what it starts from."""
    cfg, m, state, corpus = p.cfg, p.model_cfg, p.run.state, p.data.corpus
    device = state.step.device
    compiles = backend.describe_compile(cfg, device.type, collectives=p.run.dist.world_size > 1)
    logger.print(f"standard: {size(full_params(p)) / 1e6:.2f}M params, {m.n_layers} layers, d={m.d_model}, "
                 f"vocab {corpus.tokenizer.vocab_size} ({corpus.tokenizer.name}); data {describe(corpus)}; "
                 f"device {device}, {cfg.dtype}, {compiles}; run folder {p.folder}")
    if p.start:
        logger.print(f"init from {p.start.source} ({p.start.format})")
    if p.run.resume is not None:
        logger.print(f"resuming from {p.run.resume} at step {int(state.step)}")


def report(logger, result, folder, label: str = "val loss", suffix: str = "") -> None:
    """The run's last line: its validation loss and perplexity, or that there was nothing to do (when it
    stopped early, the loop has already said why and how to resume)."""
    if result.stop_reason:
        return
    step = int(result.state.step)
    if result.val_loss is None:
        logger.print(f"nothing to do: {folder} is already trained to step {step} (raise steps= to continue)")
        return
    perplexity = math.exp(min(result.val_loss, 50.0))
    logger.print(f"done: step {step}, {label} {result.val_loss:.4f}, perplexity {perplexity:.2f} "
                 f"(best {result.loop.best_val:.4f}){suffix}; tensorboard --logdir {folder}")


def on_main(sample: Optional[Callable[[dict], str]], dist: distributed.Dist, layout) -> Optional[Callable]:
    """``sample`` for rank 0 alone; under parallel=fsdp every rank takes part in gathering the params first."""
    if sample is None or (layout is None and not dist.is_main):
        return None
    if layout is None:
        return sample

    def gathered(params) -> str:
        full = layout.gather_whole(params)
        return sample(full) if dist.is_main else ""
    return gathered


def sampler(cfg, model_cfg: llama.LlamaConfig, tok, val_tokens, device) -> Optional[Callable[[dict], str]]:
    """``params -> text``: ``sample_tokens`` tokens after ``sample_prompt`` (default: the start of the
    validation text), seeded by ``seed``, for the loop's samples at evaluations; None when sampling is off."""
    if cfg.sample_tokens <= 0:
        return None
    prompt = tok.encode(cfg.sample_prompt) if cfg.sample_prompt else val_tokens[:32].tolist()

    def sample(params) -> str:
        decode = llama.decoder(params, model_cfg, 1, len(prompt) + cfg.sample_tokens)
        out = generate(decode, torch.tensor([prompt], device=device), cfg.sample_tokens,
                       temperature=cfg.sample_temperature, generator=torch.Generator(device).manual_seed(cfg.seed))
        return tok.decode(prompt + out[0].tolist())

    return sample


def _model_config(model: llama.LlamaConfig, vocab_size: int) -> llama.LlamaConfig:
    if model.vocab_size == 0:
        return replace(model, vocab_size=vocab_size)
    if model.vocab_size < vocab_size:
        raise UserError(f"model.vocab_size={model.vocab_size} is smaller than the tokenizer's vocabulary "
                        f"({vocab_size}); leave it at 0 to use the tokenizer's")
    return model
