"""The compile wrapper: ``torch.compile(fullgraph=True)`` with inductor's on-disk caches switched on.

Compiling a small train step on a 2-core CPU takes one to two minutes cold; inductor's FX graph cache
and AOT-autograd cache (on disk, keyed by graph and environment) make the second process start in
seconds. ``compile_count()`` reads dynamo's counter of compiled graphs, so tests and benchmarks can prove
that a changing learning rate (a 0-d tensor in the state) never recompiles.
"""
from __future__ import annotations

import os
from typing import Callable

import torch


def enable_caches() -> None:
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    import torch._inductor.config as inductor_config
    inductor_config.fx_graph_cache = True
    if hasattr(inductor_config, "autograd_cache"):
        inductor_config.autograd_cache = True


def maybe_compile(fn: Callable, enabled: bool = True, fullgraph: bool = True) -> Callable:
    """``torch.compile(fn, fullgraph=fullgraph, dynamic=False)`` when enabled, else ``fn`` unchanged."""
    if not enabled:
        return fn
    enable_caches()
    return torch.compile(fn, fullgraph=fullgraph, dynamic=False)


def compile_count() -> int:
    """How many graphs dynamo has compiled in this process (recompiles included)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])
