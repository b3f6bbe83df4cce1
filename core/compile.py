"""The compile wrapper: ``torch.compile(fullgraph=True)`` with inductor's on-disk caches switched on.

Compiling a small train step on a 2-core CPU takes one to two minutes cold; inductor's FX graph cache
and AOT-autograd cache (on disk, keyed by graph and environment) make the second process start in
seconds. ``compile_count()`` reads dynamo's counter of compiled graphs, so tests and benchmarks can prove
that a changing learning rate (a 0-d tensor in the state) never recompiles.

Regional compilation (torchtitan compiles each ``TransformerBlock`` on its own; PyTorch's "regional
compilation" recipe): a model marks its repeated block with :func:`region`; inside :func:`regions` the block
runs as one ``torch.compile`` of it, shared by every layer (the layers' params have the same shapes, so one
graph serves them all), while the loop over layers runs in Python. Compile time then does not grow with
depth. Gradients flow through ``torch.autograd`` (each call's backward is the compiled block's backward).
"""
from __future__ import annotations

import contextlib
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


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


def _mode(mode: str | None) -> dict:
    """``torch.compile``'s ``mode=`` keyword for ``mode`` (none for ``default``: torch's own default)."""
    if mode in (None, "default"):
        return {}
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {mode!r}; choose one of {', '.join(COMPILE_MODES)}")
    return {"mode": mode}


def maybe_compile(fn: Callable, enabled: bool = True, fullgraph: bool = True, mode: str | None = None) -> Callable:
    """``torch.compile(fn, fullgraph=fullgraph, dynamic=False, mode=mode)`` when enabled, else ``fn`` unchanged.
    ``mode`` is one of ``COMPILE_MODES`` (``reduce-overhead``: CUDA graphs; ``max-autotune``: kernel autotuning)."""
    if not enabled:
        return fn
    enable_caches()
    return torch.compile(fn, fullgraph=fullgraph, dynamic=False, **_mode(mode))


def compile_count() -> int:
    """How many graphs dynamo has compiled in this process (recompiles included)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


_regions = {"active": False, "mode": None}
_compiled_regions: dict = {}


@contextlib.contextmanager
def regions(enabled: bool = True, mode: str | None = None):
    """Inside, functions passed through :func:`region` run compiled with ``mode`` (nested uses keep the outer
    setting on)."""
    was = dict(_regions)
    _regions["active"] = was["active"] or enabled
    if enabled and not was["active"]:
        _regions["mode"] = mode
    try:
        yield
    finally:
        _regions.update(was)


def region(fn: Callable) -> Callable:
    """``fn`` itself, or inside :func:`regions` its one shared ``torch.compile(fn, fullgraph=True)``.

    A region called while something else is being compiled (a whole-step graph) is ``fn`` as well: the outer
    graph traces straight through it."""
    if not _regions["active"] or torch.compiler.is_compiling():
        return fn
    key = (fn, _regions["mode"])
    if key not in _compiled_regions:
        enable_caches()
        _compiled_regions[key] = torch.compile(fn, fullgraph=True, dynamic=False, **_mode(_regions["mode"]))
    return _compiled_regions[key]
