"""Device selection: ``device=auto|cpu|cuda|mps`` resolved once at start-up, and how much memory it has
(``check_fits``: a size key whose lower bound of memory exceeds the device's whole memory is a one-line error before
anything is allocated, not a traceback from the allocator)."""
from __future__ import annotations

import os

import torch

from purestep.core.config import ConfigError

DEVICES = ("auto", "cpu", "cuda", "mps")


def mps_available() -> bool:
    """Whether this torch build has the MPS backend and it is usable here."""
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA, then MPS, then CPU; asking for an absent accelerator is a user error."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but torch sees no CUDA device; use device=auto or device=cpu")
    if name == "mps" and not mps_available():
        raise ConfigError("device=mps but MPS is not available here; use device=auto or device=cpu")
    if name not in DEVICES:
        raise ConfigError(f"bad value for 'device': {name!r}; choose one of {', '.join(DEVICES)}")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (for honest timings); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def memory_bytes(device: torch.device) -> int | None:
    """The device's whole memory: a CUDA card's, else the machine's physical RAM; None when unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def check_fits(what: str, nbytes: int, device: torch.device) -> None:
    """A ConfigError naming ``what`` (the keys and how the bytes follow from them) when ``nbytes``, a lower bound of
    what they need, exceeds ``device``'s whole memory."""
    total = memory_bytes(device)
    if total is not None and nbytes > total:
        need = nbytes / 2**30
        need = f"{need:,.1f}" if need < 1e6 else f"{need:.3g}"
        raise ConfigError(f"{what} needs at least {need} GiB, more than the {total / 2**30:,.1f} GiB of {device.type} "
                          f"memory here; lower it")
