"""Multi-tensor math for the optimizer transforms: one ``torch._foreach_*`` call per op over a list of
leaves instead of one kernel per leaf per op, as ``torch.optim``'s ``foreach=True`` implementations do
(``torch/optim/adam.py``, ``_multi_tensor_adam``).

Each helper takes the same elementwise ops in the same order as the per-leaf expression it replaces,
so every rounding, hence every bit, is the same (checked on CPU for float32, float64, bfloat16, float16
and mixed trees; torch's CUDA multi-tensor kernels may read a 0-d tensor at a wider precision). A
helper writes in place only into a list it has just allocated, or one an eager donated step gave up
(:func:`rescale`, ``core.donate``), and only where the in-place result keeps the dtype the out-of-place op
would give; otherwise it allocates. Scalars are 0-d tensors (the
hyperparameters in the states), never Python floats, so a compiled step does not specialise on them.
"""
from __future__ import annotations

import torch

from core.donate import donated


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


def mul_into(owned: list, other: list) -> list:
    """``owned[i] * other[i]``, in place into ``owned`` when exact (see :func:`_into`)."""
    return _into(torch._foreach_mul_, torch._foreach_mul, owned, other)


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


def rescale(xs: list, factor: torch.Tensor) -> list:
    """:func:`scale`, written into ``xs`` when the step donated them (``core.donate.donating``): the same bits."""
    if not xs or not donated(xs):
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


def next_moving_average(old: list, new: list, decay: torch.Tensor) -> list:
    """:func:`moving_average` for a state's next value: written into ``old`` when the step donated it, so the
    caller must not read ``old`` afterwards."""
    return add_into(rescale(old, decay), scale(new, 1 - decay))


def next_moving_average_of_squares(old: list, new: list, decay: torch.Tensor) -> list:
    """``decay * old + (1 - decay) * new * new``, leaf by leaf (Adam's second moment), written into ``old``
    when the step donated it (as :func:`next_moving_average`)."""
    return add_into(rescale(old, decay), mul_into(scale(new, 1 - decay), new))


def add_scaled(xs: list, ys: list, factor: torch.Tensor) -> list:
    """``x + factor * y`` for every pair (``factor`` a 0-d tensor); the sum is taken as ``factor * y + x``,
    the same to the bit (floating-point addition commutes)."""
    return add_into(scale(ys, factor), xs)
