"""How the run's kernels execute on its device: ``compile_mode`` and ``tf32`` (``TrainConfig``).

``tf32=true`` lets CUDA matmuls and cuDNN use TensorFloat-32 (``torch.backends.cuda.matmul.allow_tf32``,
``torch.backends.cudnn.allow_tf32``; Ampere and later); on a CUDA device ``tf32=false`` turns both off. Off
CUDA it is ignored with a warning (nothing else runs TF32; the run's numbers are full fp32), so one config
file serves a GPU box and a laptop. ``compile_mode`` is ``torch.compile``'s ``mode`` (through
``core.compile``); ``reduce-overhead`` (CUDA graphs) is ignored with a warning off CUDA and compiles with
the default mode; any mode other than ``default`` is ignored with a warning under ``compile=false``.
"""
from __future__ import annotations

import torch

from core.logging import progress


def compile_mode(cfg, device: torch.device) -> str:
    """The ``torch.compile`` mode the run's steps use (``default`` where ``cfg.compile_mode`` cannot apply)."""
    if not cfg.compile or (cfg.compile_mode == "reduce-overhead" and device.type != "cuda"):
        return "default"
    return cfg.compile_mode


def configure(cfg, device: torch.device) -> str:
    """Apply ``tf32`` on CUDA, warn (``core.logging.progress``) about settings this device ignores, and
    return :func:`compile_mode`. Called once per run (``recipes.train.setup.start``)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
    elif cfg.tf32:
        progress(f"warning: tf32=true is ignored on {device.type} (TensorFloat-32 is a CUDA matmul mode); "
                 f"matmuls stay full fp32")
    mode = compile_mode(cfg, device)
    if mode != cfg.compile_mode:
        why = "with compile=false" if not cfg.compile else f"on {device.type} (CUDA graphs are CUDA's)"
        progress(f"warning: compile_mode={cfg.compile_mode} is ignored {why}; "
                 f"{'compiling with the default mode' if cfg.compile else 'nothing is compiled'}")
    return mode
