"""Device selection: ``device=auto|cpu|cuda|mps`` resolved once at start-up."""
from __future__ import annotations

import torch

from core.config import ConfigError

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
