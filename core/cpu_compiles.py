"""The ``purestep`` program's compile speed-ups for its own process on the CPU; the library never turns them on.

Importing purestep (``make_train_step``, ``maybe_compile``) leaves torch as it is (``tests/test_torch_api.py``). The
program (``purestep/__main__.py``) and the test session (``tests/conftest.py``), which own their processes, opt in by
setting ``PURESTEP_CPU_COMPILES=1`` (``ENV``); then ``core.compile`` calls :func:`speed_up_cpu_compiles` before each
CPU ``torch.compile``. ``PURESTEP_CPU_COMPILES=0`` before ``purestep`` opts its process out. Both speed-ups use
private parts of inductor (``tests/test_torch_api.py`` pins them); they shorten a cold compile on a CPU with few
cores (docs/benchmarks.md, "Whole runs").
"""
from __future__ import annotations

import os
import threading


ENV = "PURESTEP_CPU_COMPILES"   # "1": this process opted in (the purestep program sets it for itself)


def opted_in() -> bool:
    """Whether this process asked for the speed-ups (``ENV`` is ``1``)."""
    return os.environ.get(ENV) == "1"


def speed_up_cpu_compiles(cpp: bool) -> None:
    """The vector-ISA probes started on the side (:func:`probe_vector_isa`) and, for a graph through the C++ wrapper
    (``cpp``), its two object files built at once (:func:`build_objects_together`)."""
    probe_vector_isa()
    if cpp:
        build_objects_together()


VECTOR_ISA_PROBE = "purestep-vector-isa-probe"   # the probing thread's name


def probe_vector_isa() -> threading.Thread | None:
    """Start inductor's CPU vector-ISA probes (``torch._inductor.cpu_vec_isa.valid_vec_isa_list``) in a daemon
    thread, so that they run on a second core while dynamo traces and AOT autograd partitions the graph, instead of
    after it. Inductor asks which vector instructions the CPU can build and load before it generates its first C++
    kernel: it compiles a small program per candidate (AVX-512 VNNI, AVX-512, AVX2) with g++ and loads each in a
    child Python, one after another, a large part of a cold compile into an empty inductor cache on a CPU with few
    cores (docs/design.md, 'Measured choices'). Inductor keeps the answer (``functools.cache``) and each build under
    a file lock, so when the compile asks before the probes are done it waits for the build under way and reuses it.
    Returns the thread, or None where this process already knows the answer, a probe is already running, or this
    torch lacks the probe."""
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
    a precompiled header) goes to inductor's own. Side by side, the two g++ runs take about as long as the longer
    one instead of their sum (docs/benchmarks.md, "Whole runs"). Returns whether it is installed (False where this
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
