"""Multi-tensor math for the optimizer transforms: one ``torch._foreach_*`` call per op over a list of
leaves instead of one kernel per leaf per op, as ``torch.optim``'s ``foreach=True`` implementations do
(``torch/optim/adam.py``, ``_multi_tensor_adam``).

Each helper takes the same elementwise ops in the same order as the per-leaf expression it replaces,
so every rounding, hence every bit, is the same (checked on CPU for float32, float64, bfloat16, float16
and mixed trees; torch's CUDA multi-tensor kernels may read a 0-d tensor at a wider precision). A
helper writes in place only into a list it has just allocated, or one an eager donated step gave up: the
helpers that may (:func:`rescale`, :func:`next_lerp`, :func:`add_scaled`, :func:`squares`, :func:`roots`) take
``donated``, the ids of the tensors the step gave up, which the transform received with its call
(``core.donate``), and write into a list only when every tensor of it is among them (:func:`squares` and
:func:`roots` are passed it only where the caller reads the list no more), and only where the in-place result
keeps the dtype the out-of-place op would give; otherwise they allocate. Scalars are 0-d tensors (the
hyperparameters in the states), never Python floats, so a compiled step does not specialise on them.
"""
from __future__ import annotations

from typing import Optional

import torch

from purestep.core.donate import given_up


def _into(in_place, out_of_place, owned: list, other: list) -> list:
    """``op(owned[i], other[i])``, written into ``owned`` (a list the caller allocated) when the result
    keeps each buffer's dtype, as the out-of-place op's type promotion would give it."""
    if not owned:
        return []
    if all(torch.promote_types(a.dtype, b.dtype) == a.dtype for a, b in zip(owned, other)):
        in_place(owned, other)
        return owned
    return out_of_place(owned, other)


def add_into(owned: list, other: list) -> list:
    """``owned[i] + other[i]``, in place into ``owned`` when exact (see :func:`_into`)."""
    return _into(torch._foreach_add_, torch._foreach_add, owned, other)


def div_into(owned: list, other: list) -> list:
    """``owned[i] / other[i]``, in place into ``owned`` when exact (see :func:`_into`)."""
    return _into(torch._foreach_div_, torch._foreach_div, owned, other)


def add_scalar_(xs: list, value: torch.Tensor) -> list:
    """``x + value`` into every ``x`` (a list the caller allocated; ``value`` a 0-d tensor, on the right).

    Eager takes the one multi-tensor kernel; dynamo (torch 2.13) reads a 0-d tensor passed to
    ``_foreach_add_`` with ``.item()`` (a graph break), so a compiled step passes it once per leaf.
    """
    if xs:
        torch._foreach_add_(xs, [value] * len(xs) if torch.compiler.is_compiling() else value)
    return xs


def scale(xs: list, factor: torch.Tensor) -> list:
    """``factor * x`` for every ``x`` (``factor`` a 0-d tensor, on the left).

    On the left of a bf16/fp16 tensor a 0-d float32 tensor is first cast to the tensor's dtype; on the
    right (which is how ``torch._foreach_mul`` takes it) it would enter the kernel at float32. Casting it
    to each leaf's dtype here keeps the per-leaf ``factor * x`` to the bit.
    """
    return torch._foreach_mul(xs, _per_leaf(xs, factor)) if xs else []


def rescale(xs: list, factor: torch.Tensor, donated: Optional[frozenset] = None) -> list:
    """:func:`scale`, written into ``xs`` when the step donated them (their ids in ``donated``): the same bits."""
    if not given_up(xs, donated):
        return scale(xs, factor)
    torch._foreach_mul_(xs, _per_leaf(xs, factor))
    return xs


def _per_leaf(xs: list, factor: torch.Tensor):
    """``factor`` cast to the leaves' dtype (one tensor when they share it, else one per leaf)."""
    if len({x.dtype for x in xs}) == 1:
        return factor.to(xs[0].dtype)
    return [factor.to(x.dtype) for x in xs]


def moving_average(old: list, new: list, decay: torch.Tensor) -> list:
    """``decay * old + (1 - decay) * new``, leaf by leaf (an exponential moving average)."""
    return add_into(scale(old, decay), scale(new, 1 - decay))


def next_moving_average(old: list, new: list, decay: torch.Tensor, donated: Optional[frozenset] = None) -> list:
    """:func:`moving_average` for a state's next value: written into ``old`` when the step donated it (``donated``),
    so the caller must not read ``old`` afterwards."""
    return add_into(rescale(old, decay, donated), scale(new, 1 - decay))


def add_scaled(xs: list, ys: list, factor: torch.Tensor, donated: Optional[frozenset] = None) -> list:
    """``x + factor * y`` for every pair (``factor`` a 0-d tensor), written into ``xs`` when the step donated
    them (``donated``).

    Eager on the CPU: one pass, ``torch._foreach_add(xs, ys, alpha=factor)`` (``torch.optim``'s form; the
    0-d tensor read on the host is free there). Elsewhere (compiled, or on an accelerator, where reading it
    would sync) ``factor * y + x`` in two tensor ops, which the compiler fuses.
    """
    if not xs:
        return []
    if not torch.compiler.is_compiling() and factor.device.type == "cpu":
        alpha = factor.item()
        if given_up(xs, donated) and all(torch.promote_types(x.dtype, y.dtype) == x.dtype for x, y in zip(xs, ys)):
            torch._foreach_add_(xs, ys, alpha=alpha)
            return xs
        return torch._foreach_add(xs, ys, alpha=alpha)
    return add_into(xs, scale(ys, factor)) if given_up(xs, donated) else add_into(scale(ys, factor), xs)


def next_lerp(old: list, new: list, weight: torch.Tensor, donated: Optional[frozenset] = None) -> list:
    """``old + weight * (new - old)`` leaf by leaf (``torch.lerp``: an exponential moving average with decay
    ``1 - weight`` in one pass, as ``torch.optim.Adam`` keeps its first moment), written into ``old`` when
    the step donated it (``donated``). One kernel per leaf: ``torch.lerp`` takes a 0-d tensor weight, the
    multi-tensor form only a Python number."""
    if given_up(old, donated):
        for o, n in zip(old, new):
            o.lerp_(n, weight)
        return old
    return [torch.lerp(o, n, weight) for o, n in zip(old, new)]


def squares(xs: list, donated: Optional[frozenset] = None) -> list:
    """``x * x`` for every ``x``; written into ``xs`` when the step donated them (``donated``: pass it only where
    the caller reads ``xs`` no more)."""
    if given_up(xs, donated):
        torch._foreach_mul_(xs, xs)
        return xs
    return torch._foreach_mul(xs, xs) if xs else []


def _fits(spare: list, xs: list, donated: Optional[frozenset]) -> bool:
    """``spare`` was given up by the running eager step (``donated``) and has ``xs``'s shapes and dtypes."""
    return given_up(spare, donated) and all(s.dtype == x.dtype and s.shape == x.shape
                                                  for s, x in zip(spare, xs))


def roots(xs: list, spare: list, donated: Optional[frozenset] = None) -> list:
    """``sqrt(x)`` for every ``x``, written into ``spare`` (tensors of the same shapes and dtypes the step donated,
    ``donated``, and the caller reads no more): the same kernel without a fresh temporary. A fresh full-size
    tensor costs more than the kernel on the CPU: its pages are faulted in and zeroed on first touch (a 400 MB
    one: 116 ms against 36 ms for ``sqrt`` into an existing buffer, measured here)."""
    if not _fits(spare, xs, donated):
        return torch._foreach_sqrt(xs) if xs else []
    for x, s in zip(xs, spare):
        torch.sqrt(x, out=s)
    return spare


def over(xs: list, owned: list) -> list:
    """``x / o`` for every pair, written into ``owned`` (a list the caller allocated or was given) when the quotient
    keeps its dtype; eager only: a compiled step takes the multi-tensor op and lets the compiler place it."""
    exact = all(torch.promote_types(x.dtype, o.dtype) == o.dtype for x, o in zip(xs, owned))
    if not xs or torch.compiler.is_compiling() or not exact:
        return torch._foreach_div(xs, owned) if xs else []
    for x, o in zip(xs, owned):
        torch.div(x, o, out=o)
    return owned
