"""How the run's kernels execute on its device: ``compile_mode``, ``tf32`` and ``host_memory`` (``TrainConfig``).

``tf32=true`` lets CUDA matmuls and cuDNN use TensorFloat-32 (``torch.backends.cuda.matmul.allow_tf32``,
``torch.backends.cudnn.allow_tf32``; Ampere and later); on a CUDA device ``tf32=false`` turns both off. Off
CUDA it is ignored with a warning (nothing else runs TF32; the run's numbers are full fp32), so one config
file serves a GPU box and a laptop. A compiled fp32 run on CUDA leaves SDPA's memory-efficient kernel out
(:func:`efficient_attention`). ``compile_scope=auto`` (the default) compiles the whole
step as one graph (``core.step``: forward, backward and update fused, fewest kernels) on CUDA and for models of at
most ``AUTO_STEP_LAYERS`` layers, and one block graph shared by every layer beyond (compile time flat in depth): at
nanoGPT's 4-layer shakespeare-char shape the one graph runs well ahead of the block graphs (``recipe=bench.speed``),
while at 12 layers the unrolled graph takes far longer to compile (``recipe=bench.step``; docs/design.md, 'Measured
choices'). ``compile_mode`` is ``torch.compile``'s ``mode`` (through
``core.compile``); ``reduce-overhead`` (CUDA graphs) is ignored with a warning off CUDA and compiles with
the default mode; any mode other than ``default`` is ignored with a warning under ``compile=false``.
``host_memory`` sets how the process's C library treats freed host memory (``core.host_memory``): ``keep``
reuses it without page faults, at a higher resident peak; ``auto`` keeps it when the run trains on the CPU
(docs/benchmarks.md: "Host memory" has the figures at 100M). ``eval_compile`` says whether the eval step compiles
beside the train step (:func:`eval_compiled`), and a run at ``dtype=bf16``/``fp16`` on a CPU without those
instructions warns (:func:`native_cpu_matmul`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from purestep.core.compile import NO_MIX_ORDER_REDUCTION, cpp_wrapper, describe_options, inductor_options
from purestep.core.host_memory import set_host_memory
from purestep.core.io.logging import progress
from purestep.core.parallel.distributed import SHARDED
from purestep.core.config import UserError
from purestep.core.step import COMPILE_SCOPES, GRAD_MODES as STEP_GRAD_MODES
from purestep.core.tree import named_leaves

SCOPES = ("auto", *COMPILE_SCOPES)
GRAD_MODES = ("auto", *STEP_GRAD_MODES)
AUTO_STEP_LAYERS = 4
EVAL_COMPILES = ("auto", "true", "false")
EVAL_COMPILE_BATCHES = 1000   # eval_compile=auto compiles the eval step when a run evaluates at least this many


def depth(params) -> int:
    """The number of layers of ``params``: the leading axis of its ``layers.*`` leaves (0 without them)."""
    return max((leaf.shape[0] for name, leaf in named_leaves(params) if name.split(".")[0] == "layers"
                and leaf.ndim >= 1), default=0)


def compile_scope(cfg, params) -> str:
    """The ``compile_scope`` of ``core.step`` for ``cfg.compile_scope`` (``auto``: :func:`auto_scope` by the
    :func:`depth` of ``params`` and the device they live on)."""
    if cfg.compile_scope != "auto":
        return cfg.compile_scope
    if getattr(cfg, "parallel", None) == "fsdp,tp":
        return "block"    # tensor parallel runs on the autograd path (core.step)
    device_type = next((leaf.device.type for _, leaf in named_leaves(params)), "cpu")
    return auto_scope(depth(params), device_type, sharded=getattr(cfg, "parallel", None) in SHARDED)


def auto_scope(depth: int, device_type: str, sharded: bool = False) -> str:
    """``compile_scope=auto``: one graph up to ``AUTO_STEP_LAYERS`` layers, and beyond that on CUDA unless the params
    are sharded; else the block graph. ``torch.compile(module)`` unrolls every layer too, and on an H100 the block
    graphs with autograd between them ran well behind the plain compiled loop at 124M and 1B (docs/gpu.md,
    "Measured earlier: one H100, 2026-11-27"); on a CPU the unrolled graph's compile time dominates short runs
    (docs/design.md, 'Measured choices'), and sharded params are gathered one block at a time only when the blocks
    run apart (``core.step.per_block``)."""
    one_graph = depth <= AUTO_STEP_LAYERS or (device_type == "cuda" and not sharded)
    return "step" if one_graph else "block"


def auto_grad_mode(depth: int, scope: str, sharded: bool = False) -> Optional[str]:
    """``grad_mode=auto``: ``autograd`` for a step compiled whole (``scope``) beyond ``AUTO_STEP_LAYERS`` layers
    unless the params are sharded, else None (``core.step``'s choice: ``func``, the one graph, when it compiles
    whole). The one ``torch.func`` graph keeps every activation its backward reads, where AOTAutograd's split of
    the loss graph recomputes the cheap ones (``core.step``): at GPT-2 small's shape that is the functional step's
    extra peak over nanoGPT's loop (docs/gpu.md, "Where the one graph's memory goes"). Up to 4 layers, nanoGPT's
    shakespeare-char shape, the one graph stays."""
    return "autograd" if scope == "step" and depth > AUTO_STEP_LAYERS and not sharded else None


def grad_mode(cfg, params, scope: str) -> Optional[str]:
    """``core.step.Gradients``' mode for ``cfg.grad_mode`` (``auto``: :func:`auto_grad_mode`). The config refuses
    ``func`` with the keys that rule it out (``recipes.train.config``); this refuses it where ``compile_scope=auto``
    chose the block graph (``scope``)."""
    if not cfg.compile and cfg.grad_mode == "auto":
        return None
    if cfg.grad_mode == "auto":
        return auto_grad_mode(depth(params), scope, sharded=getattr(cfg, "parallel", None) in SHARDED)
    if cfg.grad_mode == "func" and cfg.compile and scope == "block":
        raise UserError("grad_mode=func differentiates the whole step in one torch.func graph, and compile_scope=auto "
                        "compiles this model's block instead (beyond 4 layers on the CPU, sharded params): set "
                        "compile_scope=step, or grad_mode=autograd or auto")
    return cfg.grad_mode


def eval_compiled(cfg) -> bool:
    """Whether the run's eval step is compiled (``cfg.eval_compile``; never under ``compile=false``). ``auto``: when
    the run evaluates at least ``EVAL_COMPILE_BATCHES`` batches (``eval_batches`` at every ``eval_every`` steps and at
    the end, once where the two meet). Compiling the eval graph is a cost paid once, before the first evaluation,
    against a small saving per batch: on a CPU it pays only past thousands of batches at nanoGPT's shakespeare-char
    shape and hundreds at 100M (docs/training.md, "Precision and what compiles"; the figures: docs/design.md,
    'Measured choices'). nanoGPT's configuration evaluates 8 x 20 = 160 batches, where the compile is a visible part
    of a cold run (docs/benchmarks.md, "Whole runs")."""
    if not cfg.compile or cfg.eval_compile == "false":
        return False
    if cfg.eval_compile == "true":
        return True
    evaluations = -(-cfg.steps // cfg.eval_every) if cfg.eval_every else 1     # ceil: the end's, unless periodic
    return evaluations * cfg.eval_batches >= EVAL_COMPILE_BATCHES


def describe_compile(cfg, device_type: str, collectives: bool) -> str:
    """The run log's words for what compiles: ``compile=False``, or ``compile=True (the eval step too|eager;
    inductor options: ...)`` with every option the train step's graphs compile with (``core.compile``; a step
    with ``collectives``, data parallel or sharded, keeps the Python wrapper)."""
    if not cfg.compile:
        return "compile=False"
    options = inductor_options(device_type, cpp_wrapper(device_type, collectives), cuda_options(cfg))
    return (f"compile=True (the eval step {'too' if eval_compiled(cfg) else 'eager'}; inductor options: "
            f"{describe_options(options)})")


def cuda_options(cfg) -> tuple:
    """Further inductor settings the run's train step compiles with on CUDA (``core.step.Compile.cuda_options``):
    ``NO_MIX_ORDER_REDUCTION`` where it runs Muon (``core.compile`` says why)."""
    return NO_MIX_ORDER_REDUCTION if cfg.optimizer == "muon" else ()


def compile_mode(cfg, device: torch.device) -> str:
    """The ``torch.compile`` mode the run's steps use (``default`` where ``cfg.compile_mode`` cannot apply)."""
    if not cfg.compile or (cfg.compile_mode == "reduce-overhead" and device.type != "cuda"):
        return "default"
    return cfg.compile_mode


def host_memory(cfg, device: torch.device) -> str:
    """``core.host_memory``'s mode for ``cfg.host_memory`` (``auto``: ``keep`` when training on the CPU, where the
    step's tensors are host memory)."""
    if cfg.host_memory != "auto":
        return cfg.host_memory
    return "keep" if device.type == "cpu" else "system"


def efficient_attention(compile: bool, dtype: str) -> bool:
    """Whether CUDA's memory-efficient SDPA kernel may run: not in a compiled fp32 step. On the H100 (torch 2.11)
    the compiled fp32 ``recipe=standard`` step (no GQA, so SDPA took that kernel; bf16/fp16 take cuDNN's or flash,
    GQA in fp32 the math kernel) failed at its first step: a fused Triton kernel was given a CPU pointer
    (``Pointer argument cannot be accessed from Triton``), as if the kernel's CPU seed/offset outputs reached it
    (bench.gpu's report, docs/gpu.md). Math attention is what fp32 GQA already ran."""
    return not (compile and dtype == "fp32")


CPU_NATIVE = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}   # the instructions


def native_cpu_matmul(dtype: str) -> bool:
    """Whether this CPU multiplies ``dtype`` (bf16/fp16) matrices in hardware (``CPU_NATIVE``'s instructions among
    :func:`cpu_flags`): with them a bf16 matmul runs well ahead of an fp32 one, without them it converts in software
    (docs/training.md, "Precision and what compiles"). True where the flags cannot be read."""
    flags = cpu_flags()
    return flags is None or any(name in flags for name in CPU_NATIVE[dtype])


def cpu_flags() -> Optional[set]:
    """The CPU's instruction-set flags as Linux lists them (``/proc/cpuinfo``, what ``lscpu`` prints), or None
    elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if line.startswith("flags")), None)
    return None if line is None else set(line.split(":", 1)[1].split())


def configure(cfg, device: torch.device) -> str:
    """Apply ``tf32`` on CUDA and ``host_memory``, warn (``core.io.logging.progress``) about settings this device or
    C library ignores, and return :func:`compile_mode`. Called once per run (``recipes.train.setup.start``)."""
    if not set_host_memory(host_memory(cfg, device)):
        progress(f"warning: host_memory={cfg.host_memory} is ignored: this process's C library is not glibc")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
        torch.backends.cuda.enable_mem_efficient_sdp(efficient_attention(cfg.compile, cfg.dtype))
    elif cfg.tf32:
        progress(f"warning: tf32=true is ignored on {device.type} (TensorFloat-32 is a CUDA matmul mode); "
                 f"matmuls stay full fp32")
    if device.type == "cpu" and cfg.dtype != "fp32" and not native_cpu_matmul(cfg.dtype):
        progress(f"warning: dtype={cfg.dtype} on a CPU without {' or '.join(CPU_NATIVE[cfg.dtype])}: its matmuls "
                 f"convert to fp32 in software, so dtype=fp32 is likely faster")
    mode = compile_mode(cfg, device)
    if mode != cfg.compile_mode:
        why = "with compile=false" if not cfg.compile else f"on {device.type} (CUDA graphs are CUDA's)"
        progress(f"warning: compile_mode={cfg.compile_mode} is ignored {why}; "
                 f"{'compiling with the default mode' if cfg.compile else 'nothing is compiled'}")
    return mode
