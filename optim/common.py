"""Transforms every optimizer shares: weight decay, the learning rate, and the decay mask.

``add_decayed_weights`` adds ``wd * p`` to the updates (optax); placed *after* a preconditioner it is
AdamW's decoupled decay (Loshchilov & Hutter, 2019), placed *before* it is SGD's coupled L2 term, the
way ``torch.optim.SGD`` applies ``weight_decay``. ``scale_by_learning_rate`` multiplies by
``-lr * schedule(t)`` with ``lr`` a 0-d tensor in the state: a rollback or a strategy switch edits it
(:func:`scale_lr`) without touching the compiled graph.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from purestep.core.tree import Tree, leaves_of, like, tree_map_with_name, zip_leaves
from purestep.optim import foreach
from purestep.optim.base import (GradientTransformation, counter, find_state, hparams, replace_states,
                        resolve_mask)
from purestep.optim.schedules import Schedule, constant

NO_DECAY_WORDS = ("norm", "bias", "embed")


def decay_mask(params: Tree) -> Tree:
    """True for matrices that should decay; False for norms, biases and embeddings (by name), and vectors.

    Names are checked because stacked per-layer norm weights are 2-d ([n_layers, d]).
    """
    return tree_map_with_name(
        lambda name, p: p.ndim >= 2 and not any(w in name.split(".")[-1].lower() for w in NO_DECAY_WORDS),
        params)


def decay_weights(updates: Tree, params: Tree, rate: torch.Tensor, mask=None) -> Tree:
    """``u + rate * p`` on the leaves ``mask`` keeps (every leaf if None): the term of
    :func:`add_decayed_weights`, shared with transforms that decay inside their own update (SWATS)."""
    keep = resolve_mask(mask, params)
    if keep is None:
        us, ps = zip_leaves(updates, params)
        chosen = list(range(len(us)))
    else:
        us, ps, kept = zip_leaves(updates, params, keep)
        chosen = [i for i, k in enumerate(kept) if k]
    decayed = foreach.add_scaled([us[i] for i in chosen], [ps[i] for i in chosen], rate)
    for i, u in zip(chosen, decayed):
        us[i] = u
    return like(updates, us)


class DecayState(NamedTuple):
    hparams: dict


def add_decayed_weights(weight_decay: float, mask=None) -> GradientTransformation:
    def init(params):
        return DecayState(hparams(params, weight_decay=weight_decay))

    def update(updates, state, params=None):
        return decay_weights(updates, params, state.hparams["weight_decay"], mask), state

    return GradientTransformation(init, update)


class LearningRateState(NamedTuple):
    count: torch.Tensor    # optimizer steps taken (int64, 0-d)
    lr: torch.Tensor       # base learning rate (0-d); the schedule multiplies it
    current: torch.Tensor  # the learning rate the last update used, for metrics


def scale_by_learning_rate(lr: float, schedule: Schedule | None = None) -> GradientTransformation:
    schedule = schedule or constant()

    def init(params):
        h = hparams(params, lr=lr)
        return LearningRateState(counter(params), h["lr"], torch.zeros_like(h["lr"]))

    def update(updates, state, params=None):
        count = state.count + 1
        current = state.lr * schedule(count).to(state.lr.dtype)
        steps = foreach.scale(leaves_of(updates), -current)
        return like(updates, steps), LearningRateState(count, state.lr, current)

    return GradientTransformation(init, update, lambda state: {"lr": state.current.float()})


def current_lr(opt_state) -> torch.Tensor:
    """The learning rate used by the last update (0-d tensor; no host sync)."""
    s = find_state(opt_state, LearningRateState)
    if s is None:
        raise ValueError("this optimizer has no learning-rate transform")
    return s.current


def base_lr(opt_state) -> torch.Tensor:
    s = find_state(opt_state, LearningRateState)
    if s is None:
        raise ValueError("this optimizer has no learning-rate transform")
    return s.lr


def scale_lr(opt_state, factor: float):
    """A copy of ``opt_state`` whose base learning rate is multiplied by ``factor``."""
    return replace_states(opt_state, LearningRateState, lambda s: s._replace(lr=s.lr * factor))
