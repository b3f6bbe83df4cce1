"""The one optimizer factory: gradient clipping, then AdamW (or Muon for the hidden matrices and AdamW for the rest)
with a learning-rate schedule, from an :class:`OptimizerSpec`.

Every recipe's optimizer is built here: the training loop's (``optimizer_spec`` of its ``TrainConfig``), the
upcycle blockwise phase's and the learning-rate range test's; a layer that builds its own optimizers (a
``recipes.train.hooks.RunHook``) builds them from the same spec and the pieces below. AdamW is Loshchilov &
Hutter 2019 (``optim.adamw``), Muon is Keller Jordan's as ``torch.optim.Muon`` computes it (``optim.muon``), AdaGC
is Wang et al. 2025 (``optim.adagc``), AGC is Brock et al. 2021's unit-wise clipping (``optim.agc``); schedules are
``optim.schedules``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from purestep import optim
from purestep.core.config import option
from purestep.optim import schedules
from purestep.optim.base import GradientTransformation
from purestep.optim.muon import ADJUST_LR
from purestep.optim.schedules import Schedule


@dataclass
class AdaGCConfig:
    """The ``adagc.*`` keys of a run (``TrainConfig.adagc``)."""
    lambda_rel: float = option(1.04, "clip each tensor (each layer slice) at lambda_rel x its gamma", above=0)
    beta: float = option(0.99, "EMA decay of gamma, the clipped-norm history", min=0, below=1)
    warmup: int = option(100, "warm-up steps of global clipping at grad_clip while gamma is a running min", min=0)


OPTIMIZERS = ("adamw", "muon")


@dataclass
class MuonConfig:
    """The ``muon.*`` keys of a run (``TrainConfig.muon``; used with optimizer=muon). Defaults are Keller Jordan's
    (``optim.muon``); the run's ``lr_schedule``, warmup and decay scale ``muon.lr`` as they scale ``lr``."""
    lr: float = option(0.02, "Muon's peak learning rate for the hidden matrices (lr: AdamW's, for the rest; lr=0 "
                       "holds these too)", min=0)
    momentum: float = option(0.95, "Muon's momentum", min=0, below=1)
    nesterov: bool = option(True, "Nesterov momentum")
    ns_steps: int = option(5, "quintic Newton-Schulz steps per update", min=1, max=99)
    weight_decay: float = option(0.0, "decoupled weight decay of the hidden matrices (w *= 1 - muon.lr x this, as "
                                 "torch.optim.Muon)", min=0)
    adjust_lr: str = option("original", "lr per matrix shape (out, in): original sqrt(max(1, out/in)), "
                            "match_rms_adamw 0.2 sqrt(max(out, in)) (AdamW's update RMS), spectral_unclamped "
                            "sqrt(out/in)", choices=ADJUST_LR)


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
    optimizer: str = "adamw"             # OPTIMIZERS: muon takes the hidden matrices, AdamW the rest
    muon: MuonConfig = field(default_factory=MuonConfig)
    fused: bool = False                  # AdamW with an in-place eager step (optim.fused)


def optimizer_spec(cfg) -> OptimizerSpec:
    """The optimizer settings of a training run: its keys of the same names (``decay_steps`` 0 means the run's
    ``steps``)."""
    keys = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(OptimizerSpec)}
    return OptimizerSpec(**{**keys, "decay_steps": cfg.decay_steps or cfg.steps})


def make_schedule(spec: OptimizerSpec) -> Schedule:
    """``lr_schedule`` over ``decay_steps`` after ``warmup_steps`` of warmup, down to ``min_lr``."""
    total = spec.decay_steps
    return schedules.make(spec.lr_schedule, warmup=spec.warmup_steps, total=total,
                          floor=spec.min_lr / spec.lr if spec.lr > 0 else 0.0, every=max(total // 3, 1))


def warmup_schedule(spec: OptimizerSpec) -> Schedule:
    """The spec's warmup, then a flat rate (no decay)."""
    return schedules.make("constant", warmup=spec.warmup_steps)


def adagc_transform(spec: OptimizerSpec) -> GradientTransformation:
    """AdaGC configured by ``spec.adagc``, its absolute cap ``spec.grad_clip``."""
    return optim.adagc(lambda_rel=spec.adagc.lambda_rel, beta=spec.adagc.beta, t_start=spec.adagc.warmup,
                       lambda_abs=spec.grad_clip)


def clip_transform(spec: OptimizerSpec, sharded: bool = False) -> Optional[GradientTransformation]:
    """The gradient clipping ``spec.clipping`` names (global | adagc | agc | none), or None. ``sharded``: the
    gradients are shards (parallel=fsdp; DTensors to the transforms, ``core.parallel.shard.Layout.on_dtensors``);
    AGC on them is untested, so refused."""
    if spec.clipping == "global":
        return optim.clip_by_global_norm(spec.grad_clip)
    if spec.clipping == "adagc":
        return adagc_transform(spec)
    if spec.clipping == "agc" and sharded:
        raise ValueError("clipping=agc is not supported on sharded gradients")
    if spec.clipping == "agc":
        return optim.agc(spec.agc_clip)
    return None


def make_optimizer(spec: OptimizerSpec, sharded: bool = False) -> GradientTransformation:
    """Clipping (``spec.clipping``), then AdamW with the spec's schedule (no decay on norms/embeddings), or with
    ``optimizer=muon`` Muon for the hidden matrices (``optim.muon.muon_mask``) and that AdamW for the rest, both
    on the schedule; ``sharded`` as in :func:`clip_transform` (parallel=fsdp). Muon needs whole matrices, so it is
    refused on sharded gradients (``TrainConfig`` refuses optimizer=muon with parallel=fsdp first). ``spec.fused``:
    the same AdamW and clipping carrying torch's fused in-place step for eager donated steps (:func:`fused_adamw`)."""
    schedule = make_schedule(spec)
    if spec.fused:
        return fused_adamw(spec, schedule, sharded)
    body = optim.adamw(lr=spec.lr, b1=spec.beta1, b2=spec.beta2, weight_decay=spec.weight_decay, schedule=schedule)
    if spec.optimizer == "muon":
        if sharded:
            raise ValueError("optimizer=muon is not supported on sharded gradients (Newton-Schulz needs whole "
                             "matrices)")
        m = spec.muon
        # the schedule's floor is min_lr / lr: a ratio, so Muon's rate decays by the same factor as AdamW's
        body = optim.muon(lr=m.lr if spec.lr > 0 else 0.0, momentum=m.momentum, nesterov=m.nesterov,
                          ns_steps=m.ns_steps, weight_decay=m.weight_decay, adjust_lr=m.adjust_lr, schedule=schedule,
                          aux=body)
    elif spec.optimizer != "adamw":
        raise ValueError(f"optimizer={spec.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    clip = clip_transform(spec, sharded)
    return body if clip is None else optim.chain(clip, body)


def fused_adamw(spec: OptimizerSpec, schedule: Schedule, sharded: bool = False) -> optim.FusedAdamW:
    """``make_optimizer``'s AdamW and global clipping with the in-place eager step of torch's fused kernel
    (``optim.fused``; ``fused=true``, which ``TrainConfig`` refuses where it cannot apply)."""
    if spec.optimizer != "adamw" or spec.clipping not in ("global", "none") or sharded:
        raise ValueError(f"fused=true is AdamW with clipping=global or none in one process, not optimizer="
                         f"{spec.optimizer}, clipping={spec.clipping}{' on sharded gradients' if sharded else ''}")
    return optim.fused_adamw(lr=spec.lr, b1=spec.beta1, b2=spec.beta2, weight_decay=spec.weight_decay,
                             schedule=schedule, max_norm=spec.grad_clip if spec.clipping == "global" else None)
