"""The learning-rate range test (Smith 2017, "Cyclical Learning Rates"; fastai's ``lr_find``).

An exponential sweep from ``start_lr`` to ``end_lr`` over ``num_steps`` steps on a *copy* of the train
state (the real state, and any checkpoint, stay untouched), recording the loss and its bias-corrected
EMA (beta 0.98). It stops early when the smoothed loss exceeds 4x its best or turns non-finite. The
suggestion is fastai's classic one: the LR at the minimum of the smoothed loss divided by 10; the LR of
the steepest descent is reported too. The curve goes to ``lr_find.csv`` and TensorBoard.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from purestep import optim
from purestep.core.config import UserError, option, same_as, to_dict
from purestep.core.data.documents import prepare_text
from purestep.core.device import resolve_device
from purestep.core.io.cache import write_csv
from purestep.core.io.logging import Logger
from purestep.core.cli.runs import claim
from purestep.core.state import init_state
from purestep.core.step import Gradients, make_train_step
from purestep.core.tree import cast, clone
from purestep.models import llama
from purestep.models.loading import load_model, require_llama
from purestep.recipes.standard import _model_config
from purestep.recipes.train.config import AdaGCConfig, TrainConfig
from purestep.recipes.train.optimizer import OptimizerSpec, make_optimizer
from purestep.recipes.train.setup import run_folder

DESCRIPTION = "exponential learning-rate range test on a copy of the state; suggests an LR"


@dataclass
class Config:
    start_lr: float = option(1e-7, "first learning rate of the sweep", above=0)
    end_lr: float = option(10.0, "last learning rate of the sweep", above=0)
    num_steps: int = option(100, "sweep length in steps", min=1)
    model: llama.LlamaConfig = option(llama.LlamaConfig, "model shape (vocab_size 0: the tokenizer's)")
    init: str = option("", "sweep from this checkpoint's weights instead of a random init")
    data: str = same_as(TrainConfig, "data")
    tokenizer: str = same_as(TrainConfig, "tokenizer")
    batch_size: int = same_as(TrainConfig, "batch_size")
    block_size: int = same_as(TrainConfig, "block_size")
    grad_accum: int = same_as(TrainConfig, "grad_accum")
    weight_decay: float = same_as(TrainConfig, "weight_decay")
    beta1: float = same_as(TrainConfig, "beta1")
    beta2: float = same_as(TrainConfig, "beta2")
    clipping: str = same_as(TrainConfig, "clipping")
    grad_clip: float = same_as(TrainConfig, "grad_clip")
    adagc: AdaGCConfig = same_as(TrainConfig, "adagc")
    agc_clip: float = same_as(TrainConfig, "agc_clip")
    seed: int = same_as(TrainConfig, "seed")
    device: str = same_as(TrainConfig, "device")
    dtype: str = same_as(TrainConfig, "dtype")
    compile: bool = option(False, "compile the step (pays off only for long sweeps)")
    out: str = same_as(TrainConfig, "out")
    name: str = same_as(TrainConfig, "name")


def sweep(start_lr: float, end_lr: float, n: int) -> list[float]:
    """``n`` learning rates from ``start_lr`` to ``end_lr``, evenly spaced in log space (computed from the logs, so
    a ratio beyond float range, 1e-300 to 1e300, does not overflow to inf)."""
    low, high = math.log(start_lr), math.log(end_lr)
    return [math.exp(low + (high - low) * i / max(n - 1, 1)) for i in range(n)]


def lr_range_test(state, train_step, batches, lrs: list[float], beta: float = 0.98):
    """(lr, loss, smoothed loss) rows; ``state`` itself is never modified (the sweep runs on a clone)."""
    sweep = clone(state)
    rows, avg, best = [], 0.0, math.inf
    for i, lr in enumerate(lrs):
        opt_state = optim.replace_states(sweep.opt_state, optim.common.LearningRateState,
                                         lambda s: s._replace(lr=torch.full_like(s.lr, lr)))
        sweep, metrics = train_step(sweep._replace(opt_state=opt_state), batches.get(i))
        loss = metrics["loss"].item()
        avg = beta * avg + (1 - beta) * loss
        smooth = avg / (1 - beta ** (i + 1))
        rows.append((lr, loss, smooth))
        if not math.isfinite(smooth) or smooth > 4 * best:
            break
        best = min(best, smooth)
    return rows


def suggest(rows) -> tuple[float, float]:
    """(LR at the smoothed minimum / 10, LR of the steepest smoothed descent)."""
    finite = [r for r in rows if math.isfinite(r[2])]
    if len(finite) < 3:
        raise UserError("lr_find: the loss diverged immediately; lower start_lr")
    at_min = min(finite, key=lambda r: r[2])[0] / 10
    slopes = [(finite[i + 1][2] - finite[i][2]) / (math.log(finite[i + 1][0]) - math.log(finite[i][0]))
              for i in range(len(finite) - 1)]
    steepest = finite[min(range(len(slopes)), key=slopes.__getitem__)][0]
    return at_min, steepest


def run(cfg: Config) -> dict:
    if not 0 < cfg.start_lr < cfg.end_lr:
        raise UserError(f"lr_find needs 0 < start_lr < end_lr, got {cfg.start_lr} and {cfg.end_lr}")
    device = resolve_device(cfg.device)
    folder = run_folder(cfg, "lr_find")
    start = require_llama(load_model(cfg.init, device=device), "init", "lr_find") if cfg.init else None
    corpus = prepare_text(cfg.data, start.tokenizer if start and start.tokenizer else cfg.tokenizer)
    model_cfg = start.config if start else _model_config(cfg.model, corpus.tokenizer.vocab_size)
    batches = corpus.batches(cfg.batch_size, cfg.block_size, cfg.seed, grad_accum=cfg.grad_accum, device=device)
    # the swept lr is set in the state at every step: base lr 1, constant schedule
    opt = make_optimizer(OptimizerSpec(lr=1.0, beta1=cfg.beta1, beta2=cfg.beta2, weight_decay=cfg.weight_decay,
                                       clipping=cfg.clipping, grad_clip=cfg.grad_clip, adagc=cfg.adagc,
                                       agc_clip=cfg.agc_clip))
    params = cast(start.params, device=device) if start else llama.init(model_cfg, cfg.seed, device=device)
    state = init_state(params, opt, cfg.seed, cfg.dtype)
    step = make_train_step(lambda p, b, layers=None: llama.loss(p, b, model_cfg, layers=layers), opt,
                           precision=cfg.dtype, compile=cfg.compile,
                           gradients=Gradients(accum=cfg.grad_accum))
    n = cfg.num_steps
    lrs = sweep(cfg.start_lr, cfg.end_lr, n)
    rows = lr_range_test(state, step, batches, lrs)
    at_min, steepest = suggest(rows)
    with claim(folder):   # a second run on this folder stops here, naming this one
        _write(folder, cfg, rows, at_min, steepest)
    return {"suggested_lr": at_min, "steepest_lr": steepest, "rows": rows}


def _write(folder, cfg: Config, rows: list, at_min: float, steepest: float) -> None:
    """``lr_find.csv``, the curve on TensorBoard and the suggestion."""
    write_csv(folder / "lr_find.csv", [["lr", "loss", "smoothed_loss"], *rows])
    with Logger(folder) as logger:
        logger.hparams(to_dict(cfg))
        for i, (lr, loss, smooth) in enumerate(rows):
            logger.scalars(i, {"lr_find/lr": lr, "lr_find/loss": loss, "lr_find/smoothed_loss": smooth,
                               "lr_find/log10_lr": math.log10(lr)})
        logger.print(f"lr_find: {len(rows)} steps from {rows[0][0]:.2e} to {rows[-1][0]:.2e}; suggested lr "
                     f"{at_min:.2e} (minimum / 10), steepest descent at {steepest:.2e}; curve in {folder / 'lr_find.csv'}")
