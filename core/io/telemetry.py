"""Run telemetry: model FLOPs utilization, a cost meter, and preemption signals.

- **MFU** (Chowdhery et al. 2022, PaLM, appendix B): training FLOPs per token = ``6 N + 12 L T d``
  (N non-embedding parameters... here all matrix parameters, L layers, T context, d width: the second
  term is attention's score and value products); MFU = achieved FLOP/s / the device's peak. The peak is
  ``peak_flops`` when given, else looked up for known GPUs by name (dense bf16 tensor-core numbers from
  the vendors' data sheets), and unknown on CPU (then MFU is not reported rather than invented).
- **Cost**: wall-clock hours x ``cost_per_hour``; a ``budget`` stops the run cleanly.
- **Preemption**: SIGTERM (a spot instance's notice) and SIGINT set a flag that the loop checks after
  each step; a second SIGINT interrupts at once.
"""
from __future__ import annotations

import signal
import threading
from typing import Optional

import torch

# Dense bf16 peak FLOP/s (no sparsity) by a substring of torch.cuda.get_device_name().
GPU_PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "A10G": 125e12, "A10": 125e12, "L40S": 362e12,
    "L4": 121e12, "V100": 125e12, "T4": 65e12, "RTX 4090": 165e12, "RTX 3090": 71e12,
}


def peak_flops(device: torch.device, configured: float = 0.0) -> Optional[float]:
    """The device's peak FLOP/s: ``configured`` if > 0, a known GPU's figure, else None (CPU, unknown GPU)."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_FLOPS.items():
            if key in name:
                return value
    return None


def flops_per_token(n_params: int, n_layers: int, context: int, d_model: int) -> float:
    """PaLM's training FLOPs per token: 6 N (forward + backward matmuls) + 12 L T d (attention)."""
    return 6.0 * n_params + 12.0 * n_layers * context * d_model


class Preemption:
    """A context manager that turns SIGTERM/SIGINT into a flag (``requested``) for the loop to honour."""

    def __init__(self):
        self.signal: Optional[str] = None
        self._old = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _handle(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt          # a second Ctrl-C: stop now
        self.signal = signal.Signals(signum).name

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
