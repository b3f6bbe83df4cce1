"""The bridge from ``nn.Module`` to the functional world: ``params, apply = from_module(module)``.

``params`` is a nested dict of the module's parameters (detached copies, keyed by their dotted names),
``apply(params, *args, **kwargs)`` runs ``module.forward`` with those tensors through
``torch.func.functional_call``. Tied weights (e.g. ``head.weight is embed.weight``) appear once in
``params`` (``named_parameters`` de-duplicates them) and ``tie_weights=True`` re-ties them in the call,
so a tied matrix receives the sum of both uses' gradients exactly as ``.backward()`` gives it. Buffers
stay with the module and are read, not trained.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from purestep.core.tree import flatten_dict, unflatten_dict


def from_module(module: nn.Module) -> tuple[dict, Callable]:
    params = unflatten_dict({name: p.detach().clone() for name, p in module.named_parameters()})

    def apply(params: dict, *args, **kwargs):
        return torch.func.functional_call(module, flatten_dict(params), args, kwargs, tie_weights=True,
                                          strict=False)

    return params, apply


def to_module(module: nn.Module, params: dict) -> nn.Module:
    """Copy a params pytree back into ``module`` in place (for interop with ordinary PyTorch code)."""
    flat = flatten_dict(params)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(flat[name])
    return module
