"""AdamW whose eager donated step runs torch's fused kernel in place (``torch.optim.AdamW(fused=True)``).

:func:`fused_adamw` is ``chain(clip_by_global_norm(max_norm), adamw(...))`` (``adamw(...)`` alone without
``max_norm``): the same ``init``, the same pure ``update`` and the same state, so a compiled step runs the pure
transforms (inductor fuses them and stores into the donated buffers, ``core.donate``) and a checkpoint of one loads
into the other. It also carries ``in_place``, which ``core.step`` runs instead of ``update`` for an eager donated
step (``core.update.apply_in_place``): torch's own fused AdamW kernel through the public functional API
(``torch.optim.adamw.adamw(..., fused=True)``, on the CPU and on CUDA), one kernel per leaf that reads a gradient,
its param and its moments once and writes the param and the moments where they are. The pure update computes every
intermediate and the new state out of place, and the eager donated step then copies them into the old buffers.

What the kernel computes is the run's AdamW as the state holds it (Loshchilov & Hutter 2019, as ``optim.adamw``): the
learning rate ``lr * schedule(t)`` as a 0-d tensor, betas and eps from the Adam state, the bias corrections of the
Adam state's step count, weight decay (``p *= 1 - lr * wd`` before the step, torch's form of the decoupled term) only
on the leaves ``mask`` keeps, as a second call with ``weight_decay=0`` for the rest (torch.optim's param groups).
Global-norm clipping is the kernel's ``grad_scale``: the gradients divided by ``1 / factor``, ``factor`` the clip's
``min(1, max_norm / (norm + 1e-6))`` of the norm the step computed (``optim.clip``). The non-finite skip is its
``found_inf``, as ``torch.amp.GradScaler`` skips a step: a step whose loss or gradient norm is not finite leaves the
params, the moments and the counts as they were, as the pure step's select does. The kernel takes betas, eps and
the weight decay as Python numbers: they are read from the state each step (on CUDA each read waits for the device,
as an eager step's host reads do), so an edit of the state's hyperparameters is honoured as in the pure update.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch.optim.adamw import adamw as torch_adamw

from purestep.core.tree import Tree, tree_map, zip_leaves
from purestep.optim.adamw import ScaleByAdamState, adamw
from purestep.optim.base import chain, find_state, replace_states, resolve_mask
from purestep.optim.clip import ClipState, clip_by_global_norm, clip_factor
from purestep.optim.common import DecayState, LearningRateState, decay_mask
from purestep.optim.schedules import Schedule, constant


class FusedAdamW(NamedTuple):
    """A ``GradientTransformation`` (``init``, ``update``, ``metrics``: the pure chain's) that also carries
    ``in_place(grads, opt_state, params, *, grad_norm, finite) -> metrics``: the same step written into ``params``
    and ``opt_state``'s tensors by torch's fused kernel (the gradients are given up: the kernel writes the clipped
    ones into them), returning what ``metrics`` reports of the pure update's new state (the learning rate).
    ``grad_norm``: the gradients' global norm (the clip's); ``finite``: a 0-d bool tensor, the step is skipped where
    it is False (None: never skipped)."""
    init: Callable
    update: Callable
    metrics: Optional[Callable]
    in_place: Callable


def fused_adamw(lr: float = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.01,
                mask=decay_mask, schedule: Schedule | None = None, max_norm: float | None = None) -> FusedAdamW:
    """``optim.adamw`` (after ``optim.clip_by_global_norm(max_norm)`` when ``max_norm`` is given), with the in-place
    step of torch's fused AdamW kernel for an eager donated step (module docstring)."""
    schedule = schedule or constant()
    pure = adamw(lr, b1, b2, eps, weight_decay, mask, schedule)
    if max_norm is not None:
        pure = chain(clip_by_global_norm(max_norm), pure)

    def in_place(grads, opt_state, params, *, grad_norm: torch.Tensor, finite: Optional[torch.Tensor] = None):
        adam, rate = find_state(opt_state, ScaleByAdamState), find_state(opt_state, LearningRateState)
        clip = find_state(opt_state, ClipState)
        current = rate.lr * schedule(rate.count + 1).to(rate.lr.dtype)   # as scale_by_learning_rate
        grad_scale = None if clip is None else (1 / clip_factor(grad_norm, clip.hparams["max_norm"])).float()
        found_inf = None if finite is None else (~finite).float()
        h = adam.hparams
        for group, decay in _groups(params, grads, adam, mask, find_state(opt_state, DecayState).hparams):
            ps, gs, mus, nus = group
            torch_adamw(ps, gs, mus, nus, [], [adam.count.float() for _ in ps], fused=True, grad_scale=grad_scale,
                        found_inf=found_inf, amsgrad=False, beta1=float(h["b1"]), beta2=float(h["b2"]), lr=current,
                        weight_decay=decay, eps=float(h["eps"]), maximize=False)
        took = torch.ones((), dtype=torch.bool, device=current.device) if finite is None else finite
        adam.count.add_(took.long())
        rate.count.add_(took.long())
        rate.current.copy_(torch.where(took, current, rate.current))
        # what the pure update reports: its new state's, before the skip's select
        return pure.metrics(replace_states(opt_state, LearningRateState, lambda s: s._replace(current=current)))

    return FusedAdamW(pure.init, pure.update, pure.metrics, in_place)


def _groups(params: Tree, grads: Tree, adam: ScaleByAdamState, mask, decay: dict) -> list:
    """``([params], [grads], [mu], [nu])`` of the leaves ``mask`` decays, with the weight decay as a float, and of the
    rest with 0 (torch.optim's two param groups); a group without leaves is left out."""
    keep = resolve_mask(mask, params)
    if keep is None:
        keep = tree_map(lambda _: True, params)
    ps, gs, mus, nus, kept = zip_leaves(params, grads, adam.mu, adam.nu, keep)
    rate = float(decay["weight_decay"])
    out = []
    for chosen, wd in ((True, rate), (False, 0.0)):
        index = [i for i, k in enumerate(kept) if bool(k) == chosen]
        if index:
            out.append(([[column[i] for i in index] for column in (ps, gs, mus, nus)], wd))
    return out
