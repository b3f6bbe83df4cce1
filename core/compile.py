"""The compile wrapper: ``torch.compile(fullgraph=True, dynamic=False)`` with its inductor options in one place
(:func:`inductor_options`), passed to each ``torch.compile``; nothing of torch is replaced or set globally (a
process that opted into ``core.cpu_compiles``, as the ``purestep`` program does, asks for more).

Compiling a small train step on a CPU is slow cold (docs/benchmarks.md, "Whole runs"); inductor's FX graph cache
and AOT-autograd cache (on disk, keyed by graph and environment, on by default) make the second process start in
seconds; graphs holding ``torch.cond`` join them through an option (``CACHEABLE``). ``compile_count()`` reads
dynamo's counter of compiled graphs, so tests and benchmarks can prove
that a changing learning rate (a 0-d tensor in the state) never recompiles.

Regional compilation (torchtitan's ``apply_compile`` compiles each ``TransformerBlock`` on its own, from outside
the model; PyTorch's "regional compilation" recipe): a :class:`BlockCompiler`, held by the step that owns it, is
handed to the model (``core.layers.Layers.block``), which runs its repeated block through it: one
``torch.compile`` of the block, shared by every layer (the layers' params have the same shapes, so one graph
serves them all), while the loop over layers runs in Python. Compile time then does not grow with depth.
Gradients flow through ``torch.autograd`` (each call's backward is the compiled block's backward).
"""
from __future__ import annotations

from typing import Callable

import torch

from purestep.core import cpu_compiles


# Graphs holding ``torch.cond`` (gradient health's gate in the one-graph train step) cached like any other: inductor
# bypasses its FX graph cache and AOT autograd's for a higher-order op not marked cacheable, and ``cond`` is not, so
# the train step compiled in full in every process, warm cache or not (``recipe=bench.wall``; docs/benchmarks.md,
# "Whole runs"). Its branches are traced subgraphs whose code is part of the cache key
# (``FxGraphCachePickler`` pickles submodules' code). Inductor's public config names such ops
# (``unsafe_marked_cacheable_functions``, keyed here by this torch's version); it is one of the options every graph
# here compiles with, never set in torch's own config.
CACHEABLE = {"torch.ops.higher_order.cond": torch.__version__}   # the name HigherOrderOperator.cacheable() looks up


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")

# inductor's mixed-order reduction fusion fails ``get_numel_rnumel``'s assertion ("2 v.s. 1") on a compiled Muon step
# on CUDA (torch 2.11, H100, bench.gpu's muon check). A step that runs Muon asks for it off on CUDA
# (``core.step.Compile(cuda_options=...)``; ``purestep``'s runs: ``recipes.train.backend.cuda_options``); every other
# step keeps it, as it lowers the peak memory of an AdamW step at the same speed (docs/gpu.md, "Measured: one H100,
# 2026-11-27 (the new features)").
NO_MIX_ORDER_REDUCTION = (("triton.mix_order_reduction", False),)


def cpp_wrapper(device_type: str, collectives: bool = False) -> bool:
    """Whether a graph on ``device_type`` runs through inductor's C++ wrapper (``cpp_wrapper``: the generated code
    that allocates buffers and calls the kernels is C++, not Python), taking the interpreter off the path between
    kernels (its self time in ``recipe=bench.speed``'s profile shrinks; docs/design.md, 'Measured choices').
    On the CPU, for graphs without ``collectives``: in torch 2.13 the C++ wrapper does not take the functional
    collectives' ops ("arg type Any is not yet supported by custom_op_wrapper"). On CUDA the Python wrapper stays
    (CUDA graphs, ``compile_mode=reduce-overhead``, remove the launch overhead there)."""
    return device_type == "cpu" and not collectives


# The C++ wrapper's two compiles (PyTorch #148773): the wrapper, which only allocates buffers and calls kernels, at -O0
# in a file of its own (less g++ time than at -O1, the step as fast: docs/design.md, 'Measured choices', and
# docs/benchmarks.md, "Whole runs"); the kernels at -O3 in another
SEPARATE_WRAPPER_BUILD = (("cpp_wrapper_build_separate", True), ("aot_inductor.compile_wrapper_opt_level", "O0"))


def inductor_options(device_type: str, cpp: bool = False, cuda: tuple = (), cache: bool = True) -> dict:
    """Inductor settings a graph on ``device_type`` compiles with (beyond its mode's), passed as ``torch.compile``'s
    ``options`` (inductor applies them while it compiles that graph; torch's global config stays as it was): ``cond``
    cacheable (``CACHEABLE``); the C++ wrapper with ``cpp`` (:func:`cpp_wrapper`), built apart from the kernels and
    at -O0 (``SEPARATE_WRAPPER_BUILD``; in one file g++ compiles all at -O3, and the one-graph step's 2,300-line
    wrapper function is most of that; two files take less g++ time and the step runs as fast: docs/design.md,
    'Measured choices'); on CUDA no loop reordering after fusion, whose scheduler fails an assertion on the
    one-graph train step (torch 2.11, H100: ``reorder_loops_by_dep_pair`` met a fused node inside a fused node;
    bench.gpu's report, docs/gpu.md), and the ``(name, value)`` pairs ``cuda`` asks for
    (``core.step.Compile.cuda_options``: ``NO_MIX_ORDER_REDUCTION`` for Muon), those this torch has. ``cache=False``:
    not through inductor's FX graph cache, for a graph over DTensors whose mesh's process groups differ between the
    ranks (``parallel=fsdp,tp``): the mesh enters the graph as an opaque object the cache key does not name, so the
    ranks that share a cache folder would load each other's graphs, collectives on the other's groups (torch 2.14:
    "Could not resolve the process group registered under the name 5")."""
    cacheable = _has_setting("unsafe_marked_cacheable_functions")
    options = {"unsafe_marked_cacheable_functions": dict(CACHEABLE)} if cacheable else {}
    if not cache:
        options["fx_graph_cache"] = False
    if cpp:
        options["cpp_wrapper"] = True
        options.update((name, value) for name, value in SEPARATE_WRAPPER_BUILD if _has_setting(name))
    if device_type == "cuda":
        options["loop_ordering_after_fusion"] = False
        options.update((name, value) for name, value in cuda if _has_setting(name))
    return options


def describe_options(options: dict) -> str:
    """``options`` (:func:`inductor_options`) as a run's first lines print them: ``name=value`` pairs, a table's
    keys in braces."""
    shown = (f"{name}={{{', '.join(value)}}}" if isinstance(value, dict) else f"{name}={value}"
             for name, value in options.items())
    return ", ".join(shown) or "none"


def _has_setting(name: str) -> bool:
    """Whether this torch's inductor config has ``name`` (dotted: ``triton.mix_order_reduction``)."""
    import torch._inductor.config as inductor_config
    *parents, leaf = name.split(".")
    node = inductor_config
    for part in parents:
        node = getattr(node, part, None)
    return node is not None and hasattr(node, leaf)


def _compile_kwargs(mode: str | None, cpp: bool, device_type: str = "cpu", cuda: tuple = (),
                    cache: bool = True) -> dict:
    """``torch.compile``'s keywords for ``mode`` (``COMPILE_MODES``) with :func:`inductor_options`."""
    if mode not in (None, *COMPILE_MODES):
        raise ValueError(f"unknown compile mode {mode!r}; choose one of {', '.join(COMPILE_MODES)}")
    options = inductor_options(device_type, cpp, cuda, cache)
    if options:   # torch.compile takes a mode or options, not both: the mode's own options, plus these
        from torch._inductor import list_mode_options
        return {"options": {**list_mode_options(mode or "default"), **options}}
    return {} if mode in (None, "default") else {"mode": mode}


def maybe_compile(fn: Callable, enabled: bool = True, fullgraph: bool = True, mode: str | None = None,
                  cpp: bool = False, device_type: str = "cpu", cuda: tuple = (), cache: bool = True) -> Callable:
    """``torch.compile(fn, fullgraph=fullgraph, dynamic=False)`` for ``mode`` when enabled, else ``fn`` unchanged.
    ``mode`` is one of ``COMPILE_MODES`` (``reduce-overhead``: CUDA graphs; ``max-autotune``: kernel autotuning);
    ``cpp``: through inductor's C++ wrapper (:func:`cpp_wrapper` says where); ``cuda``: further inductor settings
    on CUDA and ``cache`` (:func:`inductor_options`)."""
    if not enabled:
        return fn
    _program_speed_ups(device_type, cpp)
    return torch.compile(fn, fullgraph=fullgraph, dynamic=False,
                         **_compile_kwargs(mode, cpp, device_type, cuda, cache))


def _program_speed_ups(device_type: str, cpp: bool) -> None:
    """``core.cpu_compiles``'s speed-ups before a CPU compile, where this process opted in (the ``purestep`` program
    does; a library user's process never has them unless it asks)."""
    if device_type == "cpu" and cpu_compiles.opted_in():
        cpu_compiles.speed_up_cpu_compiles(cpp)


def compile_count() -> int:
    """How many graphs dynamo has compiled in this process (recompiles included)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


COMPILE_TIMERS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")   # a frame's compile; a lazy backward's


def compile_seconds() -> float | None:
    """Seconds this process has spent compiling: dynamo's timers of every frame's compile (tracing, AOT autograd,
    inductor, a cache hit's load) and of the backward graphs AOT autograd compiles lazily at their first call
    (``torch._dynamo.utils.compilation_time_metrics``, private: None where this torch lacks it)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return None
    return float(sum(sum(compilation_time_metrics.get(name, ())) for name in COMPILE_TIMERS))


class BlockCompiler:
    """``compiler(fn)``: ``fn``'s one ``torch.compile(fn, fullgraph=True)`` for ``mode`` (and the C++ wrapper with
    ``cpp``), made on first use and kept here, so every layer, and every step the owner takes, calls the same
    compiled block. Called while something else is being compiled (a whole-step graph), it is ``fn`` itself: the
    outer graph traces straight through it."""

    def __init__(self, mode: str | None = None, cpp: bool = False, device_type: str = "cpu", cache: bool = True):
        self.kwargs = _compile_kwargs(mode, cpp, device_type, cache=cache)
        self.device_type, self.cpp = device_type, cpp
        self.compiled: dict = {}

    def __call__(self, fn: Callable) -> Callable:
        if torch.compiler.is_compiling():
            return fn
        if fn not in self.compiled:
            _program_speed_ups(self.device_type, self.cpp)
            self.compiled[fn] = torch.compile(fn, fullgraph=True, dynamic=False, **self.kwargs)
        return self.compiled[fn]
