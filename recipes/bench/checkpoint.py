"""Checkpoint throughput and memory: :mod:`core.io.checkpoint` against ``torch.save`` / ``torch.load``.

Run ``purestep recipe=bench.checkpoint [n_params=100000000] [repeats=3] [folder=PATH]``. Both formats write
the same float32 state dict (a Llama-shaped model, one tensor per weight) to the same folder; after an
untimed warm-up round, each measurement is repeated, the order of the contenders rotating, and the median
kept (these machines are noisy and shared, so only ratios measured in one process mean anything). Our save
fsyncs before its rename, so the baseline is ``torch.save`` plus an fsync of its file (``torch.save`` alone is reported
too). Loads are timed cold (the file's pages dropped from the page cache with ``posix_fadvise(DONTNEED)``
after an ``os.sync``) and warm. Ratios are ours over torch's (above 1: ours is faster); the CPU-time
ratio compares the calling thread's CPU seconds, which other processes on a shared machine inflate less
than wall time. Peak extra memory during a save is the resident set size (sampled from
``/proc/self/statm`` by a thread) above its value before the call; tracemalloc does not see tensors.

Both loaders do the same work per tensor (allocate, ``read`` into it), and that work is mostly the
kernel faulting in and zeroing fresh pages; ours also computes each tensor's CRC-32 (``zlib.crc32``, on
a worker thread overlapped with the writes and reads: ``core.io.checkpoint_checksums``), which a warm load
from the page cache cannot hide, so expect load ratios below 1 that move with the machine.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from purestep.core.io import checkpoint
from purestep.core.config import UserError, option

DESCRIPTION = "time durable msgpack checkpoints against torch.save/torch.load (MB/s ratios, peak memory)"
MB = 1e6


@dataclass
class Config:
    n_params: int = option(100_000_000, "parameters in the Llama-shaped float32 state dict", min=1)
    repeats: int = option(3, "timed rounds after the warm-up round; the median is reported", min=1)
    folder: str = option("", "folder for the temporary files (empty: the system's temporary folder)")


def run(cfg: Config) -> dict:
    if cfg.n_params < 1 or cfg.repeats < 1:
        raise UserError("n_params and repeats must be >= 1")
    return benchmark(cfg.n_params, folder=cfg.folder or None, repeats=cfg.repeats)


def make_state(n_params: int, d: int = 768, ffn: int = 2048, vocab: int = 50304) -> dict[str, torch.Tensor]:
    """A float32 Llama-shaped state dict of about ``n_params`` elements (untied embedding and head)."""
    vocab = max(256, min(vocab, n_params // (4 * d)))
    per_layer = 4 * d * d + 3 * d * ffn + 2 * d
    n_layers = max(1, round((n_params - 2 * vocab * d) / per_layer))
    g = torch.Generator().manual_seed(0)
    shapes = {"embed": (vocab, d), "head": (vocab, d), "norm": (d,)}
    for i in range(n_layers):
        shapes |= {f"layers.{i}.attn.{w}": (d, d) for w in ("wq", "wk", "wv", "wo")}
        shapes |= {f"layers.{i}.mlp.w1": (ffn, d), f"layers.{i}.mlp.w3": (ffn, d), f"layers.{i}.mlp.w2": (d, ffn)}
        shapes |= {f"layers.{i}.attn_norm": (d,), f"layers.{i}.mlp_norm": (d,)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this thread) of ``fn()``; the CPU time ignores other processes."""
    t0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - t0, time.thread_time() - c0


def _peak_extra_rss(fn) -> tuple[tuple[float, float], int]:
    """(``_timed(fn)``, peak RSS above the starting RSS in bytes), sampling RSS every 0.2 ms."""
    base, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.0002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    times = _timed(fn)
    done.set()
    thread.join()
    return times, max(peak[0], _rss()) - base


def _evict(path: Path) -> None:
    """Drop ``path``'s (clean) pages from the page cache so the next read comes from the disk."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def benchmark(n_params: int = 100_000_000, folder=None, repeats: int = 3) -> dict:
    """Measure and print save/load MB/s of ours against torch's and our peak extra memory during save."""
    state = make_state(n_params)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    largest = max(t.numel() * t.element_size() for t in state.values())
    runs: dict[str, list[tuple[float, float]]] = {}
    peaks: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        ours, theirs = Path(tmp) / "state.msgpack", Path(tmp) / "state.pt"
        saves = {"save": (ours, lambda: checkpoint.save(ours, state, step=0)),
                 "torch_save": (theirs, lambda: torch.save(state, theirs)),
                 "torch_save_fsync": (theirs, lambda: (torch.save(state, theirs), checkpoint.fsync_path(theirs)))}
        loads = {"load": (ours, lambda: checkpoint.load(ours)["state"]), "torch_load": (theirs, lambda: torch.load(theirs))}
        # Round -1 is a warm-up that is not counted: a process's first save and load pay for imports, first
        # use of the allocator and, on a VM, host faults for guest pages never touched before. The order
        # of the contenders rotates so neither always goes first.
        for rep in range(-1, repeats):
            keep = runs if rep >= 0 else {}
            for key in _rotate(list(saves), rep):
                path, fn = saves[key]
                path.unlink(missing_ok=True)
                os.sync()
                times, peak = _peak_extra_rss(fn)
                keep.setdefault(key, []).append(times)
                peaks.setdefault(key, []).append(peak)
            for key in _rotate(list(loads), rep):
                path, fn = loads[key]
                for cache in ("cold", "warm"):
                    if cache == "cold":
                        _evict(path)
                    out = []
                    keep.setdefault(f"{key}_{cache}", []).append(_timed(lambda: out.append(fn())))
                    assert all(torch.equal(out[0][k], v) for k, v in state.items()), f"{key} does not round-trip"
                    del out
    mbps = {k: nbytes / MB / statistics.median(wall for wall, _ in v) for k, v in runs.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
    result = {
        "n_params": sum(t.numel() for t in state.values()), "n_tensors": len(state), "state_mb": nbytes / MB,
        "largest_tensor_mb": largest / MB, **{f"{k}_mbps": v for k, v in mbps.items()},
        "save_ratio": mbps["save"] / mbps["torch_save_fsync"], "save_ratio_no_fsync": mbps["save"] / mbps["torch_save"],
        "load_cold_ratio": mbps["load_cold"] / mbps["torch_load_cold"],
        "load_warm_ratio": mbps["load_warm"] / mbps["torch_load_warm"],
        **{f"{ours}_cpu_ratio": cpu[theirs] / cpu[ours] for ours, theirs in _PAIRS},
        "save_peak_extra_mb": max(peaks["save"]) / MB,
        "torch_save_peak_extra_mb": max(peaks["torch_save"]) / MB,
    }
    _print(result, repeats)
    return result


_PAIRS = (("save", "torch_save_fsync"), ("load_cold", "torch_load_cold"), ("load_warm", "torch_load_warm"))


def _rotate(keys: list, n: int) -> list:
    n %= len(keys)
    return keys[n:] + keys[:n]


def _print(r: dict, repeats: int) -> None:
    print(f"{r['n_params'] / 1e6:.1f}M float32 params in {r['n_tensors']} tensors ({r['state_mb']:.0f} MB), "
          f"largest tensor {r['largest_tensor_mb']:.0f} MB; median of {repeats}")
    print(f"{'MB/s (wall clock)':<30}{'purestep':>9}{'torch':>8}{'ratio':>7}{'CPU-time ratio':>16}")
    rows = (("save (fsync'd, durable)", "save", "torch_save_fsync", "save_ratio", "save_cpu_ratio"),
            ("save vs torch.save, no fsync", "save", "torch_save", "save_ratio_no_fsync", None),
            ("load, cold page cache", "load_cold", "torch_load_cold", "load_cold_ratio", "load_cold_cpu_ratio"),
            ("load, warm page cache", "load_warm", "torch_load_warm", "load_warm_ratio", "load_warm_cpu_ratio"))
    for label, ours, theirs, ratio, cpu in rows:
        print(f"{label:<30}{r[ours + '_mbps']:>9.0f}{r[theirs + '_mbps']:>8.0f}{r[ratio]:>7.2f}"
              + (f"{r[cpu]:>16.2f}" if cpu else ""))
    print(f"peak extra RSS during save (max over runs): purestep {r['save_peak_extra_mb']:.1f} MB, "
          f"torch.save {r['torch_save_peak_extra_mb']:.1f} MB; largest tensor {r['largest_tensor_mb']:.0f} MB")

