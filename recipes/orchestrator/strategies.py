"""Training strategies as data, and what a switch between two of them carries over.

A strategy is a named bundle (family, learning-rate multiplier relative to the run's ``lr``, schedule,
clipping) that builds an ordinary optax-shaped transform chain. Every chain starts with a
:class:`StrategyTag` whose 0-d state names the strategy, so a state pytree (a snapshot, a branch, a
checkpoint) always says which strategy's step function it belongs to.

The portfolio:

====================  ======  =========  =========  ==========  =====================================
name                  family  lr x run   schedule   clipping    notes
====================  ======  =========  =========  ==========  =====================================
adamw                 Adam    1          run        run's       the run's own optimizer, unchanged
conservative_adamw    Adam    0.1        run        global 0.5  the safety strategy by default
aggressive_adamw      Adam    2          flat       global 1.0  no decay after warm-up
sgd_escape            SGD     SGD_LR     run        global 1.0  Nesterov momentum 0.9, no weight decay
spike_resistant       Adam    0.3        run        AdaGC       per-tensor adaptive clipping
lion                  Lion    0.1        run        global 1.0  weight decay x3 (Chen et al. 2023)
swats                 SWATS   1          run        global 1.0  AdamW, then SGD at the estimated rate
====================  ======  =========  =========  ==========  =====================================

``run`` schedule: the run's own (warm-up, decay to ``min_lr`` over the run); ``flat``: the run's warm-up,
then no decay. Learning rates live in each strategy's own state, so candidates are evaluated at their
own rates. A switch (:func:`transfer`) never restarts the schedule: the new chain's step counter
continues from the old one's, so ``lr(t)`` continues from the current step. It carries over what is
the same statistic on both sides:

- Adam moments (``m``, ``v`` and their count) between Adam-family strategies (adamw variants, SWATS; a
  SWATS group that switched to SGD at step ``s`` froze its moments there while its count went on to ``k``,
  so they are rescaled by ``(1 - b**k) / (1 - b**s)``: at count ``k`` they correct to ``m_hat``, ``v_hat`` of
  step ``s``, see :func:`_adam_moments`);
- into SGD: the momentum buffer ``b`` (``b <- mu*b + g``, steady state ``g / (1 - mu)``) is seeded with
  ``E[g] / (1 - mu)`` where ``E[g]`` is the old first moment made unbiased (Adam's ``m / (1 - b1**t)``,
  Lion's ``m``, SGD's ``b * (1 - mu)``). Adam's raw ``exp_avg`` copied as it is would be
  ``1 - mu`` times too small and biased towards zero early on;
- into Lion: ``m <- E[g]`` (Lion's ``m`` is an EMA of g);
- into Adam from SGD or Lion: nothing. No second moment exists there, and Adam's bias correction
  assumes zero-initialized moments: a fresh Adam state with the continued schedule is the honest start;
- AdaGC's per-tensor gammas when both sides clip with AdaGC.

Hyperparameters (lr, betas, weight decay, clip thresholds) always come from the new strategy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from purestep.core.tree import clone, tree_flatten, tree_map, tree_unflatten
from purestep.optim.adagc import AdaGCState
from purestep.optim.adamw import ScaleByAdamState, adamw
from purestep.optim.base import GradientTransformation, chain, find_state, hparam_device, replace_states
from purestep.optim.clip import clip_by_global_norm
from purestep.optim.common import LearningRateState, decay_mask, scale_by_learning_rate
from purestep.optim.lion import ScaleByLionState, lion
from purestep.optim.sgd import TraceState, trace
from purestep.optim.swats import SwatsState, swats
from purestep.recipes.train.optimizer import (OptimizerSpec, adagc_transform, clip_transform, make_schedule, optimizer_spec,
                                     warmup_schedule)

SGD_LR = 30.0          # SGD's step is lr * |g| (clipped to 1), Adam's ~ lr per coordinate: it needs a larger lr
SGD_MOMENTUM = 0.9


@dataclass(frozen=True)
class Strategy:
    name: str
    family: str          # adam | sgd | lion | swats
    lr_mult: float       # x the run's lr
    schedule: str        # run | flat
    clipping: str        # run (the run's own clipping) | global | adagc
    clip_norm: float = 1.0
    wd_mult: float = 1.0


PORTFOLIO = {s.name: s for s in (
    Strategy("adamw", "adam", 1.0, "run", "run"),
    Strategy("conservative_adamw", "adam", 0.1, "run", "global", 0.5),
    Strategy("aggressive_adamw", "adam", 2.0, "flat", "global", 1.0),
    Strategy("sgd_escape", "sgd", SGD_LR, "run", "global", 1.0, wd_mult=0.0),
    Strategy("spike_resistant", "adam", 0.3, "run", "adagc"),
    Strategy("lion", "lion", 0.1, "run", "global", 1.0, wd_mult=3.0),
    Strategy("swats", "swats", 1.0, "run", "global", 1.0),
)}
NAMES = tuple(PORTFOLIO)


@dataclass(frozen=True)
class StrategySpec(OptimizerSpec):
    """What every strategy is built relative to: the run's optimizer settings (``recipes.train.optimizer``) plus
    the SWATS strategy's own (``orchestrator.swats_*``, ``optim.swats``)."""
    swats_eps: float = 1e-5
    swats_scope: str = "global"


def strategy_spec(cfg) -> StrategySpec:
    """The :class:`StrategySpec` of a run of ``cfg`` (a config with the ``orchestrator.*`` keys)."""
    return StrategySpec(**vars(optimizer_spec(cfg)), swats_eps=cfg.orchestrator.swats_eps,
                        swats_scope=cfg.orchestrator.swats_scope)


class StrategyTag(NamedTuple):
    index: torch.Tensor   # int64 0-d: position of the strategy in NAMES


def tag(name: str) -> GradientTransformation:
    index = NAMES.index(name)
    return GradientTransformation(
        lambda params: StrategyTag(torch.tensor(index, dtype=torch.int64, device=hparam_device(params))),
        lambda updates, state, params=None: (updates, state))


def strategy_of(opt_state) -> str:
    """The strategy an optimizer state belongs to (one host read)."""
    t = find_state(opt_state, StrategyTag)
    if t is None:
        raise ValueError("this optimizer state has no strategy tag (not built by recipes.orchestrator.strategies)")
    return NAMES[int(t.index)]


def build(name: str, spec: StrategySpec) -> GradientTransformation:
    """The transform chain of strategy ``name`` relative to the run's optimizer settings ``spec`` (its lr,
    schedule, betas, weight decay, clipping, and the SWATS settings)."""
    if name not in PORTFOLIO:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(NAMES)}")
    s = PORTFOLIO[name]
    lr = spec.lr * s.lr_mult
    schedule = make_schedule(spec) if s.schedule == "run" else warmup_schedule(spec)
    wd = spec.weight_decay * s.wd_mult
    if s.clipping == "run":
        clip = clip_transform(spec)
    elif s.clipping == "adagc":
        clip = adagc_transform(spec)
    else:
        clip = clip_by_global_norm(s.clip_norm)
    if s.family == "adam":
        body = adamw(lr=lr, b1=spec.beta1, b2=spec.beta2, weight_decay=wd, schedule=schedule)
    elif s.family == "lion":
        body = lion(lr=lr, b1=0.9, b2=0.99, weight_decay=wd, schedule=schedule)
    elif s.family == "sgd":
        body = chain(trace(SGD_MOMENTUM, nesterov=True), scale_by_learning_rate(lr, schedule))
    else:
        body = swats(lr=lr, b1=spec.beta1, b2=spec.beta2, switch_eps=spec.swats_eps, scope=spec.swats_scope,
                     schedule=schedule, weight_decay=wd, mask=decay_mask)
    parts = [tag(name)] + ([clip] if clip is not None else []) + [body]
    return chain(*parts)


def _adam_moments(opt_state):
    """``(count, mu, nu)`` of the Adam state in ``opt_state`` (new tensors), or None if it has none.

    A SWATS group that switched to SGD at step ``s`` keeps the moments of step ``s`` while the count goes
    on to ``k``; its ``mu`` is rescaled by ``(1 - b1**k) / (1 - b1**s)`` and ``nu`` by
    ``(1 - b2**k) / (1 - b2**s)``, so that bias correction at ``k`` gives the ``m_hat``, ``v_hat`` of step ``s``.
    Groups as in :mod:`optim.swats`: one for every leaf (``global``) or leaf ``i`` is group ``i``
    (``per_group``, ``tree_flatten`` order). Groups still in their Adam phase are multiplied by exactly 1.
    """
    adam = find_state(opt_state, ScaleByAdamState)
    if adam is None:
        return None
    sw = find_state(opt_state, SwatsState)
    if sw is None or sw.adam is not adam:
        return adam.count.clone(), clone(adam.mu), clone(adam.nu)
    k, s = adam.count, sw.switch_step.clamp(min=1)

    def factor(beta):
        return torch.where(sw.phase, (1 - beta ** k) / (1 - beta ** s), 1.0)

    f1, f2 = factor(adam.hparams["b1"]), factor(adam.hparams["b2"])
    group = (lambda i: 0) if sw.phase.numel() == 1 else (lambda i: i)  # noqa: E731

    def rescale(tree, f):
        leaves, spec = tree_flatten(tree)
        return tree_unflatten(spec, [x * f[group(i)].to(x.dtype) for i, x in enumerate(leaves)])

    return k.clone(), rescale(adam.mu, f1), rescale(adam.nu, f2)


def _first_moment(opt_state):
    """An unbiased estimate of E[g] held by ``opt_state`` (a params-shaped tree), or None."""
    moments = _adam_moments(opt_state)
    if moments is not None:
        count, mu, _ = moments
        correction = 1 - find_state(opt_state, ScaleByAdamState).hparams["b1"] ** count.clamp(min=1)
        return tree_map(lambda m: m / correction.to(m.dtype), mu)
    lion_state = find_state(opt_state, ScaleByLionState)
    if lion_state is not None:
        return lion_state.mu
    sgd = find_state(opt_state, TraceState)
    if sgd is not None:
        mu = sgd.hparams["momentum"]
        return tree_map(lambda b: b * (1 - mu).to(b.dtype), sgd.trace)
    return None


def transfer(old_state, name: str, spec: StrategySpec, params):
    """The optimizer state of strategy ``name`` continuing from ``old_state`` (see the module docstring)."""
    new = build(name, spec).init(params)
    family = PORTFOLIO[name].family
    old_lr = find_state(old_state, LearningRateState)
    if old_lr is not None:
        new = replace_states(new, LearningRateState, lambda s: s._replace(count=old_lr.count.clone()))
    old_adam = _adam_moments(old_state)
    if family in ("adam", "swats") and old_adam is not None:
        count, mu, nu = old_adam
        new = replace_states(new, ScaleByAdamState, lambda s: s._replace(count=count, mu=mu, nu=nu))
    elif family == "sgd":
        mean = _first_moment(old_state)
        if mean is not None:
            new = replace_states(new, TraceState, lambda s: s._replace(
                trace=tree_map(lambda m: m / (1 - s.hparams["momentum"]).to(m.dtype), mean)))
    elif family == "lion":
        mean = _first_moment(old_state)
        if mean is not None:
            new = replace_states(new, ScaleByLionState, lambda s: s._replace(mu=clone(mean)))
    old_gc = find_state(old_state, AdaGCState)
    if old_gc is not None and find_state(new, AdaGCState) is not None:
        new = replace_states(new, AdaGCState, lambda s: s._replace(
            count=old_gc.count.clone(), gamma=clone(old_gc.gamma)))
    return new


__all__ = ["Strategy", "PORTFOLIO", "NAMES", "StrategySpec", "StrategyTag", "build", "strategy_of", "strategy_spec",
           "transfer"]
