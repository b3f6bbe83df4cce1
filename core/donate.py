"""Buffer donation for the train step: the new params and optimizer state written into the old buffers.

JAX's ``jit(..., donate_argnums=...)`` lets XLA reuse an input's buffers for the outputs; the caller gives
the input up. ``make_train_step(..., donate=True)`` is the same contract: the step computes the new state
as the pure step does (same ops, same bits), then :func:`write_into` copies the new params and optimizer
state into the state it was given and returns those very tensors. Under ``torch.compile`` the copy is
part of the graph (AOTAutograd keeps input mutations in an inference graph), so inductor fuses each
leaf's update, the finite/skip select and the store into the input's buffer, and the step's peak memory
is params + grads + moments + activations, as with ``torch.optim``.

Eager mode has no compiler to plan buffers: the eager donated step computes the new state out of place, exactly
as the pure step does, and copies it into the old buffers, so eager peak memory is the pure step's (the
transforms hold no in-place mode: ``optim`` is pure, whatever runs it). The one eager in-place update is an
optimizer's own: one that carries ``in_place`` (``optim.fused``, torch's fused AdamW kernel) is run by
``core.update.apply_in_place`` instead, for an eager donated step only (``core.step``).

The caller must not read the old state afterwards: it *is* the new one. :func:`owned` makes a state safe
to donate: a leaf that shares storage with another leaf or with the ``frozen`` inputs (a teacher the
student was copied from) is cloned first, so donation never writes through an alias.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from purestep.core.state import TrainState
from purestep.core.tree import leaves_of, tree_leaves, tree_map


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
    # One copy_ per leaf, not _foreach_copy_: inductor (torch 2.13, CPU) lowers _foreach_copy_ by building every
    # copy's loader first and writing the destinations after, one by one, so a later leaf whose new value reads an
    # earlier leaf's old value through an unrealized pointwise (AdaGC's gamma reads its step count, written just
    # before it, in the warm-up test) reads the new one. A copy_ is lowered after the old value's readers are
    # realized. Standalone repro: tests/test_donation.py (..._reads_an_overwritten_destination).
    for o, n in pairs:
        o.copy_(n)
    # built field by field: torch 2.11's dynamo cannot return a NamedTuple made by _replace from a traced step
    return TrainState(*(getattr(state if f in ("params", "opt_state") else new, f) for f in TrainState._fields))


def donate(step: Callable) -> Callable:
    """``step(state, *args) -> (new_state, metrics)`` made to write the new params and optimizer state into
    ``state``'s buffers (:func:`write_into`), JAX's ``jit(step, donate_argnums=0)``: wrap a step before
    ``torch.compile``, which then stores each new leaf in its input's buffer inside the graph (``make_train_step(...,
    donate=True)`` applies it). The caller gives ``state`` up; its leaves must not alias
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
