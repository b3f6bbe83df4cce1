"""Buffer donation for the train step: the new params and optimizer state written into the old buffers.

JAX's ``jit(..., donate_argnums=...)`` lets XLA reuse an input's buffers for the outputs; the caller gives
the input up. ``make_train_step(..., donate=True)`` is the same contract: the step computes the new state
as the pure step does (same ops, same bits), then :func:`write_into` copies the new params and optimizer
state into the state it was given and returns those very tensors. Under ``torch.compile`` the copy is
part of the graph (AOTAutograd keeps input mutations in an inference graph), so inductor fuses each
leaf's update, the finite/skip select and the store into the input's buffer, and the step's peak memory
is params + grads + moments + activations, as with ``torch.optim``.

Eager mode has no compiler to plan buffers, so the donated step checks on the host whether the step is
finite (one sync, as ``torch.amp.GradScaler`` does) and then runs :func:`update_in_place`: the optimizer's
transforms write their moving averages into the donated moments and their intermediate results into the
donated gradients once spent, and the updates are added into the params, with the same kernels in the same
order as the pure step, hence the same bits: AdamW then keeps one full-size temporary live, as
``torch.optim``'s ``_multi_tensor_adam`` does. A non-finite step takes the pure path, whose select keeps the old
values.

What the transforms may overwrite travels with the call, as optax passes a transform's extra arguments:
``optimizer.update(grads, opt_state, params, donated=ids)``, ``ids`` the ids of the tensors the step gave up
(the moments, and the gradients unless something reads them later). ``optim.base.chain`` hands it to each
transform whose ``update`` takes ``donated``, and those pass it to the ``optim.foreach`` helpers, which write into
a list only when :func:`given_up` says every tensor of it is one of those (``optim.foreach`` says which helpers do).
A transform that does not take it (a user's, or one that calls another transform's update and reads the inputs
after, as SWATS does) gets nothing to overwrite and runs out of place: the same bits. The step passes one more
extra argument the same way, ``grad_norm`` (the global norm of the gradients it hands over, which it computed for
its metrics), which the chain gives its first transform: ``optim.clip_by_global_norm`` reuses it in eager steps
instead of reading every gradient again. :func:`updating` calls an optimizer with the extra arguments it takes.

The caller must not read the old state afterwards: it *is* the new one. :func:`owned` makes a state safe
to donate: a leaf that shares storage with another leaf or with the ``frozen`` inputs (a teacher the
student was copied from) is cloned first, so donation never writes through an alias.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import torch

from purestep.core.state import TrainState
from purestep.core.tree import apply_updates, leaves_of, tree_leaves, tree_map


def given_up(xs: list, donated: Optional[frozenset]) -> bool:
    """Every tensor of ``xs`` is one the running eager step gave up (``donated``: their ids, passed by
    :func:`update_in_place` through ``optimizer.update(..., donated=)``; None: nothing was). Eager only: under
    ``torch.compile`` the helpers stay out of place and the compiler reuses the buffers."""
    return donated is not None and not torch.compiler.is_compiling() and len(xs) > 0 and \
        all(id(x) in donated for x in xs)


def takes(update, keyword: str) -> bool:
    """Whether a transform's ``update`` takes the extra argument ``keyword`` (``donated``, ``grad_norm``; the chain
    and :func:`updating` pass one only then)."""
    try:
        return keyword in inspect.signature(update).parameters
    except (TypeError, ValueError):   # a builtin or C callable without a signature
        return False


def updating(optimizer) -> Callable:
    """``update(grads, opt_state, params, **extra)``: ``optimizer.update`` given those of the extra arguments
    (``donated``, ``grad_norm``) that it takes and that are not None (which ones is decided here, once, so a compiled
    step traces no signature)."""
    accepted = {k for k in ("donated", "grad_norm") if takes(optimizer.update, k)}

    def update(grads, opt_state, params, **extra):
        return optimizer.update(grads, opt_state, params,
                                **{k: v for k, v in extra.items() if k in accepted and v is not None})

    return update


def _trained(state: TrainState) -> list:
    return [t for t in leaves_of((state.params, state.opt_state)) if isinstance(t, torch.Tensor)]


def write_into(state: TrainState, new: TrainState) -> TrainState:
    """``new`` with its params and optimizer state copied into ``state``'s tensors (which it then holds)."""
    olds, news = _trained(state), _trained(new)
    if len(olds) != len(news):
        raise ValueError(f"the step changed the state's structure ({len(olds)} leaves in, {len(news)} out): "
                         f"cannot donate")
    pairs = [(o, n) for o, n in zip(olds, news) if o is not n]
    for o, n in pairs:
        if o.dtype != n.dtype or o.shape != n.shape:
            raise ValueError(f"the step changed a leaf from {o.dtype}{list(o.shape)} to {n.dtype}{list(n.shape)}: "
                             f"cannot donate")
    if pairs and torch.compiler.is_compiling():
        # One copy_ per leaf in a graph, not _foreach_copy_: inductor (torch 2.13, CPU) lowers _foreach_copy_ by
        # building every copy's loader first and writing the destinations after, one by one, so a later leaf whose
        # new value reads an earlier leaf's old value through an unrealized pointwise (AdaGC's gamma reads its step
        # count, written just before it, in the warm-up test) reads the new one. A copy_ is lowered after the old
        # value's readers are realized. Standalone repro: tests/test_donation.py (..._reads_an_overwritten_destination).
        for o, n in pairs:
            o.copy_(n)
    elif pairs:
        torch._foreach_copy_([o for o, _ in pairs], [n for _, n in pairs])
    # built field by field: torch 2.11's dynamo cannot return a NamedTuple made by _replace from a traced step
    return TrainState(*(getattr(state if f in ("params", "opt_state") else new, f) for f in TrainState._fields))


def update_in_place(update: Callable, state: TrainState, grads, keep: bool = False, grad_norm=None):
    """``(updates, opt_state, new_params)`` of an eager donated step (``update``: the optimizer's, from
    :func:`updating`; ``grad_norm``: the gradients' global norm, when known): the optimizer state's tensors are
    written in place; the params too, unless ``keep`` (someone reads the old params and the gradients after
    the update: health statistics), when the new params are computed apart and :func:`write_into` copies
    them. Without ``keep`` the gradients are donated as well (clipping scales them in place)."""
    given = leaves_of(state.opt_state) + ([] if keep else leaves_of(grads))
    updates, opt_state = update(grads, state.opt_state, state.params, donated=frozenset(id(t) for t in given),
                                grad_norm=grad_norm)
    params, steps = leaves_of(state.params), leaves_of(updates)
    if keep or any(p.dtype != u.dtype for p, u in zip(params, steps)):
        return updates, opt_state, apply_updates(state.params, updates)
    torch._foreach_add_(params, steps)
    return updates, opt_state, state.params


def donate(step: Callable) -> Callable:
    """``step(state, *args) -> (new_state, metrics)`` made to write the new params and optimizer state into
    ``state``'s buffers (:func:`write_into`), JAX's ``jit(step, donate_argnums=0)``: wrap a step before
    ``torch.compile``, which then stores each new leaf in its input's buffer inside the graph (``make_train_step(...,
    donate=True)`` is this plus the eager in-place update). The caller gives ``state`` up; its leaves must not alias
    each other (:func:`owned` makes them so)."""
    @functools.wraps(step)
    def donated_step(state: TrainState, *args, **kwargs):
        new, metrics = step(state, *args, **kwargs)
        return write_into(state, new), metrics

    return donated_step


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def owned(state: TrainState, frozen=None) -> TrainState:
    """``state`` with every params/optimizer leaf that shares storage with an earlier leaf or with ``frozen``
    replaced by a clone (the same objects when nothing is shared: the common case is a scan of pointers)."""
    seen = {_storage(t) for t in tree_leaves(frozen) if isinstance(t, torch.Tensor) and t.numel()}
    changed = False

    def own(t):
        nonlocal changed
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return t
        if _storage(t) in seen:
            changed = True
            return t.clone()
        seen.add(_storage(t))
        return t

    params, opt_state = tree_map(own, state.params), tree_map(own, state.opt_state)
    return state._replace(params=params, opt_state=opt_state) if changed else state
