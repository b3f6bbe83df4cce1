"""Multi-tensor math for the optimizer transforms: one ``torch._foreach_*`` call per op over a list of
leaves instead of one kernel per leaf per op, as ``torch.optim``'s ``foreach=True`` implementations do
(``torch/optim/adam.py``, ``_multi_tensor_adam``).

Each helper takes the same elementwise ops in the same order as the per-leaf expression it replaces,
so every rounding, hence every bit, is the same (checked on CPU for float32, float64, bfloat16, float16
and mixed trees; torch's CUDA multi-tensor kernels may read a 0-d tensor at a wider precision). The helpers are
out of place: a helper writes in place only into a list it has just allocated itself (``_into``), never into its
inputs, so a transform built on them is a pure function of its arguments (buffer reuse is the compiler's, under a
donated compiled step: ``core.donate``). Scalars are 0-d tensors (the hyperparameters in the states), never Python
floats, so a compiled step does not specialise on them.
"""
from __future__ import annotations

import torch


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


def add_scalar_(xs: list, value: torch.Tensor) -> list:
    """``x + value`` into every ``x`` (a list the caller allocated; ``value`` a 0-d tensor, on the right), passed
    once per leaf: dynamo reads a lone 0-d tensor given to ``_foreach_add_`` with ``.item()`` (a graph break)."""
    if xs:
        torch._foreach_add_(xs, [value] * len(xs))
    return xs


def scale(xs: list, factor: torch.Tensor) -> list:
    """``factor * x`` for every ``x`` (``factor`` a 0-d tensor, on the left).

    On the left of a bf16/fp16 tensor a 0-d float32 tensor is first cast to the tensor's dtype; on the
    right (which is how ``torch._foreach_mul`` takes it) it would enter the kernel at float32. Casting it
    to each leaf's dtype here keeps the per-leaf ``factor * x`` to the bit.
    """
    return torch._foreach_mul(xs, _per_leaf(xs, factor)) if xs else []


def _per_leaf(xs: list, factor: torch.Tensor):
    """``factor`` cast to the leaves' dtype (one tensor when they share it, else one per leaf)."""
    if len({x.dtype for x in xs}) == 1:
        return factor.to(xs[0].dtype)
    return [factor.to(x.dtype) for x in xs]


def moving_average(old: list, new: list, decay: torch.Tensor) -> list:
    """``decay * old + (1 - decay) * new``, leaf by leaf (an exponential moving average)."""
    return add_into(scale(old, decay), scale(new, 1 - decay))


def add_scaled(xs: list, ys: list, factor: torch.Tensor) -> list:
    """``x + factor * y`` for every pair (``factor`` a 0-d tensor).

    Eager on the CPU: one pass, ``torch._foreach_add(xs, ys, alpha=factor)``, ``torch.optim``'s form (its weight
    decay and Nesterov terms), whose one rounding the eager runs keep; the 0-d tensor read on the host is free there.
    In a graph (or on an accelerator, where reading it would sync) ``factor * y + x`` in two tensor ops, which the
    compiler fuses: ``.item()`` would break the graph. One of the two ``is_compiling`` branches of the library.
    """
    if not xs:
        return []
    if not torch.compiler.is_compiling() and factor.device.type == "cpu":
        return torch._foreach_add(xs, ys, alpha=factor.item())
    return add_into(scale(ys, factor), xs)


def lerp(old: list, new: list, weight: torch.Tensor) -> list:
    """``old + weight * (new - old)`` leaf by leaf (``torch.lerp``: an exponential moving average with decay
    ``1 - weight`` in one pass, as ``torch.optim.Adam`` keeps its first moment). One kernel per leaf: ``torch.lerp``
    takes a 0-d tensor weight, the multi-tensor form only a Python number."""
    return [torch.lerp(o, n, weight) for o, n in zip(old, new)]


def squares(xs: list) -> list:
    """``x * x`` for every ``x``."""
    return torch._foreach_mul(xs, xs) if xs else []


def roots(xs: list) -> list:
    """``sqrt(x)`` for every ``x``."""
    return torch._foreach_sqrt(xs) if xs else []


def over(xs: list, ys: list) -> list:
    """``x / y`` for every pair."""
    return torch._foreach_div(xs, ys) if xs else []
