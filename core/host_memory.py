"""Host memory: keep what the process frees for its next allocation, as PyTorch's CUDA caching allocator does.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves a request above its mmap threshold (128
KiB, rising to at most 32 MiB) with a fresh ``mmap`` and unmaps it on ``free``, so the next tensor of that size is
faulted in and zeroed page by page. A training step frees and reallocates the same large tensors every step
(gradients, the update's temporaries, a stacked leaf is every layer of one weight): kept, ``recipe=standard``'s CPU
steps run faster at a somewhat higher peak resident size (docs/benchmarks.md, "Host memory"). ``keep`` serves every
request from the heap (``mallopt(M_MMAP_MAX, 0)``) and never trims it (``M_TRIM_THRESHOLD``), so freed memory is
reused without faults and the resident size stays at its high-water mark: the trade jemalloc makes with
``dirty_decay_ms:-1`` in Intel's PyTorch CPU tuning guide. ``system`` leaves glibc as it starts, or after ``keep``
in the same process sets its documented defaults again (mallopt(3); the mmap threshold no longer adapts once set).
"""
from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache
from typing import Optional

MODES = ("keep", "system")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4     # <malloc.h>
_SETTINGS = {
    "keep": ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2 ** 31 - 1)),
    "system": ((_M_MMAP_MAX, 65536), (_M_TRIM_THRESHOLD, 128 * 1024), (_M_MMAP_THRESHOLD, 128 * 1024)),
}


@lru_cache(maxsize=1)
def _glibc() -> Optional[ctypes.CDLL]:
    """The process's glibc, or None (another C library, or not Linux)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version     # glibc only (musl has mallopt as a no-op stub and no such symbol)
        return libc
    except (OSError, AttributeError, TypeError):
        return None


# Process state, not a call's: the mode this process's malloc was last set to here (glibc has no getter for its
# settings). Listed as an exception in tests/test_no_module_state.py.
_process = {"mode": "system"}


def set_host_memory(mode: str) -> bool:
    """Apply ``mode`` (``keep`` or ``system``) to this process's allocator; False where ``keep`` cannot apply
    (not glibc)."""
    if mode not in MODES:
        raise ValueError(f"host memory mode {mode!r}: one of {', '.join(MODES)}")
    if mode == "system" and _process["mode"] == "system":
        return True                     # glibc's own behaviour, untouched
    libc = _glibc()
    if libc is None:
        return mode == "system"
    _process["mode"] = mode
    return all(libc.mallopt(param, value) == 1 for param, value in _SETTINGS[mode])


def release_free_memory() -> bool:
    """Give the free memory of the heap back to the system (glibc's ``malloc_trim(0)``), so that the resident
    high-water mark, reset after this, measures what runs next rather than what was freed before (a compile's
    memory); False where it cannot (not glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
