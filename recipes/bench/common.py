"""What the train-step benchmarks (``bench.step``, ``bench.health``) share: the keys of the Llama they time
and of the timing, and the model and the one random batch every variant steps on."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from purestep.core.config import option, same_as
from purestep.core.device import DEVICES, resolve_device
from purestep.core.io.logging import progress
from purestep.core.tree import size
from purestep.models import llama


@dataclass
class StepBench:
    d_model: int = same_as(llama.LlamaConfig, "d_model")
    n_layers: int = same_as(llama.LlamaConfig, "n_layers")
    n_heads: int = same_as(llama.LlamaConfig, "n_heads")
    n_kv_heads: int = same_as(llama.LlamaConfig, "n_kv_heads")
    vocab_size: int = option(256, "vocabulary size of the random token batch (256: byte-level)", min=1)
    batch_size: int = option(16, "sequences per step", min=1)
    block_size: int = option(128, "tokens per sequence", min=1)
    warmup: int = option(3, "untimed steps per variant (compilation happens here)", min=0)
    steps: int = option(10, "timed steps per variant per round", min=1)
    rounds: int = option(3, "interleaved timing rounds", min=1)
    threads: int = option(0, "torch.set_num_threads (0 keeps the default)", min=0)
    seed: int = option(0, "seed for weights and the batch", min=0)
    device: str = option("cpu", "where the steps run (peak memory: RSS on CPU, max_memory_allocated on CUDA)",
                         choices=DEVICES)


def model_and_batch(cfg: StepBench) -> tuple[llama.LlamaConfig, dict, dict]:
    """The Llama of ``cfg`` (its threads set), its seeded params, and one seeded batch of random tokens, on
    ``cfg.device``."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    model_cfg = llama.LlamaConfig(vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers,
                                  n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads)
    params = llama.init(model_cfg, seed=cfg.seed, device=device)
    tok = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.block_size + 1),
                        generator=torch.Generator().manual_seed(cfg.seed)).to(device)
    return model_cfg, params, {"x": tok[:, :-1].contiguous(), "y": tok[:, 1:].contiguous()}


def warm_up(label: str, cfg: StepBench, params: dict, variants: dict) -> None:
    """Print what is timed (the benchmark's header, on stdout), then run ``cfg.warmup`` untimed steps of every
    variant (compilation happens here), each waited for with ``.item()``."""
    print(f"{label}: Llama d={cfg.d_model} L={cfg.n_layers} H={cfg.n_heads}/{cfg.n_kv_heads or cfg.n_heads} "
          f"({size(params) / 1e6:.2f}M params), batch {cfg.batch_size}x{cfg.block_size}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    width = max(map(len, variants), default=0)
    for name, step in variants.items():
        start = time.perf_counter()
        for _ in range(cfg.warmup):
            step().item()
        progress(f"  warmed up {name:<{width}} in {time.perf_counter() - start:6.1f}s")


def cpu_allocated_peak_mb(step) -> float:
    """The tensors' peak over one call of ``step`` on the CPU, counted as CUDA's ``max_memory_allocated`` counts
    it: the bytes of every tensor alive at the call's start (the storages of the plain tensors and parameters the
    garbage collector reaches: params, gradients, optimizer state, the batch) plus the largest rise of torch's CPU
    allocator during the call (``torch.profiler``'s memory events, compiled graphs' buffers included). Unlike the
    resident set it leaves out the heap the C library keeps after a free."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
            except NotImplementedError:    # a torch.func wrapper: the tensor it wraps is counted on its own
                continue
            storages[storage.data_ptr()] = storage.nbytes()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = rise = 0
    for _, nbytes in events:
        live += nbytes
        rise = max(rise, live)
    return (sum(storages.values()) + rise) / 2**20
