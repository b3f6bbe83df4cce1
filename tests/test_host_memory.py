"""``host_memory`` (``core.host_memory``): kept host memory is reused without page faults; ``system`` is glibc's
own behaviour; a C library other than glibc gets a warning, not an error."""
import subprocess
import sys
import textwrap

import pytest
import torch

from purestep.core import host_memory
from purestep.recipes.train import backend
from purestep.recipes.train.config import TrainConfig

PROBE = textwrap.dedent("""
    import resource, sys, torch
    from purestep.core.host_memory import set_host_memory
    assert set_host_memory(sys.argv[1])
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(16):   # 64 MiB: above glibc's largest mmap threshold (32 MiB); kept, the heap grows until
        torch.ones(2 ** 24)   # a freed block fits the next (torch asks for 64-byte aligned blocks)
    start = faults()
    for _ in range(5):
        torch.ones(2 ** 24)   # allocated, written, freed
    print((faults() - start) * resource.getpagesize() / 5 / 2 ** 20)
""")


@pytest.mark.skipif(host_memory._glibc() is None, reason="host_memory applies to glibc's malloc; this is not glibc")
def test_kept_memory_is_reused_without_page_faults():
    faulted = {}
    for mode in ("system", "keep"):
        out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                             check=True).stdout
        faulted[mode] = float(out)          # MiB faulted in per 64 MiB tensor
    assert faulted["system"] > 60 and faulted["keep"] < 1, faulted


def test_a_c_library_other_than_glibc_is_a_warning(monkeypatch, capsys):
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    assert host_memory.set_host_memory("keep") is False and host_memory.set_host_memory("system") is True
    backend.configure(TrainConfig(), torch.device("cpu"))
    assert "host_memory=auto is ignored: this process's C library is not glibc" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'bogus'"):
        host_memory.set_host_memory("bogus")


def test_auto_keeps_host_memory_when_training_on_the_cpu():
    assert backend.host_memory(TrainConfig(), torch.device("cpu")) == "keep"
    assert backend.host_memory(TrainConfig(), torch.device("cuda")) == "system"
    assert backend.host_memory(TrainConfig(host_memory="system"), torch.device("cpu")) == "system"


def test_free_heap_memory_goes_back_to_the_system_where_glibc_runs():
    """``release_free_memory`` (glibc's ``malloc_trim``), before a resident peak is reset (``recipe=bench.step``)."""
    from purestep.core.host_memory import _glibc, release_free_memory
    assert release_free_memory() is (_glibc() is not None)
