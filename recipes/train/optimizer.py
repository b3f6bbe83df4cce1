"""The one optimizer factory: gradient clipping, then AdamW with a learning-rate schedule, from an
:class:`OptimizerSpec`.

Every recipe's optimizer is built here: the training loop's (``optimizer_spec`` of its ``TrainConfig``), the
upcycle blockwise phase's and the learning-rate range test's; a layer that builds its own optimizers (a
``recipes.train.hooks.RunHook``) builds them from the same spec and the pieces below. AdamW is Loshchilov &
Hutter 2019 (``optim.adamw``), AdaGC is Wang et al. 2025 (``optim.adagc``), AGC is Brock et al. 2021's
unit-wise clipping (``optim.agc``); schedules are ``optim.schedules``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import optim
from core.config import option
from optim import schedules
from optim.base import GradientTransformation
from optim.schedules import Schedule


@dataclass
class AdaGCConfig:
    """The ``adagc.*`` keys of a run (``TrainConfig.adagc``)."""
    lambda_rel: float = option(1.04, "clip each tensor (each layer slice) at lambda_rel x its gamma", above=0)
    beta: float = option(0.99, "EMA decay of gamma, the clipped-norm history", min=0, below=1)
    warmup: int = option(100, "warm-up steps of global clipping at grad_clip while gamma is a running min", min=0)


@dataclass(frozen=True)
class OptimizerSpec:
    """What an optimizer is built from. Keys are named as in ``TrainConfig``; the defaults are plain AdamW
    (Adam's betas, no weight decay) at a constant rate without clipping."""
    lr: float
    min_lr: float = 0.0                  # floor of the decay
    lr_schedule: str = "constant"        # optim.schedules.KINDS
    warmup_steps: int = 0
    decay_steps: int = 1                 # step at which the decay reaches min_lr
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    clipping: str = "none"               # global | adagc | agc | none
    grad_clip: float = 1.0               # global-norm threshold; AdaGC's absolute cap
    adagc: AdaGCConfig = field(default_factory=AdaGCConfig)
    agc_clip: float = 0.01


def optimizer_spec(cfg) -> OptimizerSpec:
    """The optimizer settings of a training run (``decay_steps`` 0 means the run's ``steps``)."""
    return OptimizerSpec(lr=cfg.lr, min_lr=cfg.min_lr, lr_schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                         decay_steps=cfg.decay_steps or cfg.steps, beta1=cfg.beta1, beta2=cfg.beta2,
                         weight_decay=cfg.weight_decay, clipping=cfg.clipping, grad_clip=cfg.grad_clip,
                         adagc=cfg.adagc, agc_clip=cfg.agc_clip)


def make_schedule(spec: OptimizerSpec) -> Schedule:
    """``lr_schedule`` over ``decay_steps`` after ``warmup_steps`` of warmup, down to ``min_lr``."""
    total = spec.decay_steps
    return schedules.make(spec.lr_schedule, warmup=spec.warmup_steps, total=total,
                          floor=spec.min_lr / spec.lr if spec.lr > 0 else 0.0, every=max(total // 3, 1))


def warmup_schedule(spec: OptimizerSpec) -> Schedule:
    """The spec's warmup, then a flat rate (no decay)."""
    return schedules.make("constant", warmup=spec.warmup_steps)


def adagc_transform(spec: OptimizerSpec, psum=None) -> GradientTransformation:
    """AdaGC configured by ``spec.adagc``, its absolute cap ``spec.grad_clip``."""
    return optim.adagc(lambda_rel=spec.adagc.lambda_rel, beta=spec.adagc.beta, t_start=spec.adagc.warmup,
                       lambda_abs=spec.grad_clip, psum=psum)


def clip_transform(spec: OptimizerSpec, psum=None) -> Optional[GradientTransformation]:
    """The gradient clipping ``spec.clipping`` names (global | adagc | agc | none), or None. ``psum``: the norms
    are over sharded gradients (``core.parallel.shard.Layout.psum``); AGC's unit norms are not wired for that."""
    if spec.clipping == "global":
        return optim.clip_by_global_norm(spec.grad_clip, psum)
    if spec.clipping == "adagc":
        return adagc_transform(spec, psum)
    if spec.clipping == "agc" and psum is not None:
        raise ValueError("clipping=agc is not supported on sharded gradients")
    if spec.clipping == "agc":
        return optim.agc(spec.agc_clip)
    return None


def make_optimizer(spec: OptimizerSpec, psum=None) -> GradientTransformation:
    """Clipping (``spec.clipping``), then AdamW with the spec's schedule (no decay on norms/embeddings); ``psum``
    as in :func:`clip_transform` (parallel=fsdp)."""
    adamw = optim.adamw(lr=spec.lr, b1=spec.beta1, b2=spec.beta2, weight_decay=spec.weight_decay,
                        schedule=make_schedule(spec))
    clip = clip_transform(spec, psum)
    return adamw if clip is None else optim.chain(clip, adamw)
