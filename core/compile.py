"""The compile wrapper: ``torch.compile(fullgraph=True)`` with inductor's on-disk caches switched on.

Compiling a small train step on a 2-core CPU takes one to two minutes cold; inductor's FX graph cache
and AOT-autograd cache (on disk, keyed by graph and environment) make the second process start in
seconds. ``compile_count()`` reads dynamo's counter of compiled graphs, so tests and benchmarks can prove
that a changing learning rate (a 0-d tensor in the state) never recompiles.

Regional compilation (torchtitan's ``apply_compile`` compiles each ``TransformerBlock`` on its own, from outside
the model; PyTorch's "regional compilation" recipe): a :class:`BlockCompiler`, held by the step that owns it, is
handed to the model (``core.layers.Layers.block``), which runs its repeated block through it: one
``torch.compile`` of the block, shared by every layer (the layers' params have the same shapes, so one graph
serves them all), while the loop over layers runs in Python. Compile time then does not grow with depth.
Gradients flow through ``torch.autograd`` (each call's backward is the compiled block's backward).
"""
from __future__ import annotations

import os
import threading
from typing import Callable

import torch


def enable_caches() -> None:
    """Inductor's FX graph cache on (the AOT-autograd cache, ``torch._functorch.config.enable_autograd_cache``, is
    on by default in every torch this supports; ``tests/test_torch_api.py`` checks both), and graphs holding
    ``torch.cond`` (gradient health's gate in the one-graph train step) cached too: inductor bypasses both caches
    for any higher-order op not marked cacheable, and ``cond`` is not, so the train step compiled in full in every
    process (20 s of a 2000-step run's 118 s on this CPU with a warm cache, ``recipe=bench.wall``). Its branches
    are traced subgraphs whose code is part of the cache key (``FxGraphCachePickler`` pickles submodules' code), so
    ``unsafe_marked_cacheable_functions`` (keyed by this torch's version) marks it."""
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    import torch._inductor.config as inductor_config
    inductor_config.fx_graph_cache = True
    marked = getattr(inductor_config, "unsafe_marked_cacheable_functions", None)
    if marked is not None:
        marked.setdefault(CACHEABLE_COND, torch.__version__)


CACHEABLE_COND = "torch.ops.higher_order.cond"   # the name HigherOrderOperator.cacheable() looks up


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


def cpp_wrapper(device_type: str, collectives: bool = False) -> bool:
    """Whether a graph on ``device_type`` runs through inductor's C++ wrapper (``cpp_wrapper``: the generated code
    that allocates buffers and calls the kernels is C++, not Python), taking the interpreter off the path between
    kernels (its self time in ``recipe=bench.speed``'s profile: 3.3 ms a step, then 2.4; docs/benchmarks.md).
    On the CPU, for graphs without ``collectives``: in torch 2.13 the C++ wrapper does not take the functional
    collectives' ops ("arg type Any is not yet supported by custom_op_wrapper"). On CUDA the Python wrapper stays
    (CUDA graphs, ``compile_mode=reduce-overhead``, remove the launch overhead there)."""
    return device_type == "cpu" and not collectives


# The C++ wrapper's two compiles (PyTorch #148773): the wrapper, which only allocates buffers and calls kernels, at -O0
# in a file of its own (nanoGPT's shakespeare-char step: g++ 6 s against 9.5 at -O1, the same 39.5 ms a step, A/B
# interleaved in one process; the 100M Llama's block graphs 0.992x); the kernels at -O3 in another
SEPARATE_WRAPPER_BUILD = (("cpp_wrapper_build_separate", True), ("aot_inductor.compile_wrapper_opt_level", "O0"))


def inductor_options(device_type: str, cpp: bool = False, cuda: tuple = ()) -> dict:
    """Inductor settings a graph on ``device_type`` compiles with (beyond its mode's): the C++ wrapper with ``cpp``
    (:func:`cpp_wrapper`), built apart from the kernels and at -O0 (``SEPARATE_WRAPPER_BUILD``; in one file g++
    compiles all at -O3, and the one-graph step's 2,300-line wrapper function is most of that: nanoGPT's
    shakespeare-char step, bf16, took 23.4 s of g++ in one file, 8.3 + 6.1 s in two at -O1, and the same 42.2 ms a
    step, A/B interleaved in one process; docs/benchmarks.md); on CUDA no loop reordering after fusion, whose scheduler
    fails an assertion on the one-graph train step (torch 2.11, H100: ``reorder_loops_by_dep_pair`` met a fused node
    inside a fused node; bench.gpu's report, docs/gpu.md), and the ``(name, value)`` pairs ``cuda`` asks for (an
    optimizer's ``GradientTransformation.cuda_inductor``), those this torch has."""
    options = {"cpp_wrapper": True} if cpp else {}
    if cpp:
        options.update((name, value) for name, value in SEPARATE_WRAPPER_BUILD if _has_setting(name))
    if device_type == "cuda":
        options["loop_ordering_after_fusion"] = False
        options.update((name, value) for name, value in cuda if _has_setting(name))
    return options


def _has_setting(name: str) -> bool:
    """Whether this torch's inductor config has ``name`` (dotted: ``triton.mix_order_reduction``)."""
    import torch._inductor.config as inductor_config
    *parents, leaf = name.split(".")
    node = inductor_config
    for part in parents:
        node = getattr(node, part, None)
    return node is not None and hasattr(node, leaf)


def _compile_kwargs(mode: str | None, cpp: bool, device_type: str = "cpu", cuda: tuple = ()) -> dict:
    """``torch.compile``'s keywords for ``mode`` (``COMPILE_MODES``) with :func:`inductor_options`."""
    if mode not in (None, *COMPILE_MODES):
        raise ValueError(f"unknown compile mode {mode!r}; choose one of {', '.join(COMPILE_MODES)}")
    options = inductor_options(device_type, cpp, cuda)
    if options:   # torch.compile takes a mode or options, not both: the mode's own options, plus these
        from torch._inductor import list_mode_options
        return {"options": {**list_mode_options(mode or "default"), **options}}
    return {} if mode in (None, "default") else {"mode": mode}


def maybe_compile(fn: Callable, enabled: bool = True, fullgraph: bool = True, mode: str | None = None,
                  cpp: bool = False, device_type: str = "cpu", cuda: tuple = ()) -> Callable:
    """``torch.compile(fn, fullgraph=fullgraph, dynamic=False)`` for ``mode`` when enabled, else ``fn`` unchanged.
    ``mode`` is one of ``COMPILE_MODES`` (``reduce-overhead``: CUDA graphs; ``max-autotune``: kernel autotuning);
    ``cpp``: through inductor's C++ wrapper (:func:`cpp_wrapper` says where); ``cuda``: further inductor settings
    on CUDA (:func:`inductor_options`)."""
    if not enabled:
        return fn
    prepare(device_type, cpp)
    return torch.compile(fn, fullgraph=fullgraph, dynamic=False, **_compile_kwargs(mode, cpp, device_type, cuda))


def prepare(device_type: str, cpp: bool) -> None:
    """What every ``torch.compile`` here is preceded by: the on-disk caches (:func:`enable_caches`); on the CPU the
    vector-ISA probes started on the side (:func:`probe_vector_isa`) and, for the C++ wrapper, its two object files
    built at once (:func:`build_objects_together`)."""
    enable_caches()
    if device_type == "cpu":
        probe_vector_isa()
        if cpp:
            build_objects_together()


VECTOR_ISA_PROBE = "purestep-vector-isa-probe"   # the probing thread's name


def probe_vector_isa() -> threading.Thread | None:
    """Start inductor's CPU vector-ISA probes (``torch._inductor.cpu_vec_isa.valid_vec_isa_list``) in a daemon
    thread, so that they run on a second core while dynamo traces and AOT autograd partitions the graph, instead of
    after it. Inductor asks which vector instructions the CPU can build and load before it generates its first C++
    kernel: it compiles a small program per candidate (AVX-512 VNNI, AVX-512, AVX2) with g++ and loads each in a
    child Python, one after another; with an empty inductor cache that took 10.9 s of a 2-core VM's cold compile
    (docs/benchmarks.md). Inductor keeps the answer (``functools.cache``) and each build under a file lock, so when
    the compile asks before the probes are done it waits for the build under way and reuses it. Returns the thread,
    or None where this process already knows the answer, a probe is already running, or this torch lacks the
    probe."""
    try:
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    except ImportError:
        return None
    cached = getattr(valid_vec_isa_list, "cache_info", None)
    if cached is not None and cached().currsize:
        return None
    if any(thread.name == VECTOR_ISA_PROBE for thread in threading.enumerate()):
        return None
    thread = threading.Thread(target=valid_vec_isa_list, name=VECTOR_ISA_PROBE, daemon=True)
    thread.start()
    return thread


def build_objects_together() -> bool:
    """Have inductor compile a C++-wrapper graph's two object files at once, then link them: the wrapper (-O0, a
    file of its own: ``SEPARATE_WRAPPER_BUILD``) and the kernels (-O3) are independent until the link, but inductor
    builds its list of compiles one after another (``torch._inductor.codecache._worker_compile_cpp``, torch 2.11 to
    2.14), on one core while the others wait. Installed once per process in place of that function, the same
    work under the same file lock, the files that exist skipped as before; a list of fewer than three (one object,
    a precompiled header) goes to inductor's own. nanoGPT's shakespeare-char step: g++ 6.5 s for the kernels and
    6 s for the wrapper, one after another (docs/benchmarks.md). Returns whether it is installed (False where this
    torch has no such function)."""
    from torch._inductor import codecache
    original = getattr(codecache, "_worker_compile_cpp", None)
    if original is None:
        return False
    if getattr(original, "builds_objects_together", False):
        return True

    def worker_compile_cpp(lock_path, cpp_builders):
        *objects, linker = cpp_builders
        if len(objects) < 2:
            return original(lock_path, cpp_builders)
        from concurrent.futures import ThreadPoolExecutor
        from torch.utils._filelock import FileLock
        with FileLock(lock_path, timeout=codecache.LOCK_TIMEOUT):
            missing = [builder for builder in objects if not os.path.exists(builder.get_target_file_path())]
            if missing:
                with ThreadPoolExecutor(len(missing), thread_name_prefix="purestep-g++") as pool:
                    for built in [pool.submit(builder.build) for builder in missing]:
                        built.result()
            if not os.path.exists(linker.get_target_file_path()):
                linker.build()
        return None

    worker_compile_cpp.builds_objects_together = True
    codecache._worker_compile_cpp = worker_compile_cpp
    return True


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

    def __init__(self, mode: str | None = None, cpp: bool = False, device_type: str = "cpu"):
        self.kwargs = _compile_kwargs(mode, cpp, device_type)
        self.device_type, self.cpp = device_type, cpp
        self.compiled: dict = {}

    def __call__(self, fn: Callable) -> Callable:
        if torch.compiler.is_compiling():
            return fn
        if fn not in self.compiled:
            prepare(self.device_type, self.cpp)
            self.compiled[fn] = torch.compile(fn, fullgraph=True, dynamic=False, **self.kwargs)
        return self.compiled[fn]
