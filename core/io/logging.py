"""Metric sinks for the training loop: TensorBoard, a JSONL file and a console progress line.

The loop pulls the step's 0-d metric tensors to the host every ``log_every`` steps (Levanter's deferred
metrics) and hands them to one ``Logger``, which fans out to:

- TensorBoard through ``torch.utils.tensorboard.SummaryWriter`` (``tensorboard --logdir runs``):
  scalars, text (generated samples, events, the resolved config), histograms, the HParams plugin and a
  custom-scalars layout (``layout``); scalar and histogram tags are renamed by ``core.io.board.board_tag`` so
  that loss, learning rate and throughput sort first (``train/loss`` -> ``1_train/loss``);
- ``metrics.jsonl`` in the same folder: one JSON object per ``scalars`` or ``event`` call, under the keys
  as logged (``train/loss``, ``lr``, ``health/...``);
- (both opened without following a symbolic link planted at their names: ``core.io.cache.open_append``,
  ``refuse_link``)
- the console, through click: a progress line (step/total, %, loss, tokens/s, ETA from an EMA of the
  step time) redrawn in place when stderr is a terminal and printed as plain lines when it is not.

``progress(message)`` is the one way to print a status line (tokenizing, loading, warming up) on stderr,
with or without a run folder; ``Logger.print`` writes through it.

Nothing here knows about models: the caller names the tags (``train/loss``, ``val/perplexity``, ``lr``,
``tokens_per_sec``...). ``Logger(..., enabled=False)`` is a no-op for non-zero ranks.
"""
from __future__ import annotations

import json
import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import click
import torch

from purestep.core.io.board import board_tag, layout_of
from purestep.core.io.cache import open_append, refuse_link
from purestep.core.config import flatten_keys

EVENTS = "events.out.tfevents"    # the prefix of SummaryWriter's event files

__all__ = ["Logger", "progress", "to_floats", "memory_mb", "format_duration"]


def progress(message: str) -> None:
    """A status line ("tokenizing...", "loading...", "warmed up ...") on stderr: the one way code outside
    a run's Logger reports progress, and what ``Logger.print`` writes through. A recipe's own output
    (generated text, benchmark tables, results) goes to stdout instead."""
    click.echo(message, err=True)


def to_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Metric values (0-d tensors, numbers) as floats, with one host transfer per device."""
    out = {k: v for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    by_device: dict[torch.device, list[str]] = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(k)
    for device, keys in by_device.items():
        dtype = torch.float32 if device.type == "mps" else torch.float64   # mps has no float64
        packed = torch.stack([metrics[k].detach().reshape(()).to(dtype) for k in keys])
        out.update(zip(keys, packed.tolist()))
    return {k: float(out[k]) for k in metrics}


def memory_mb(device: torch.device | str | None = None) -> float:
    """Peak memory in MiB: the CUDA allocator's peak on ``device``, else this process's peak resident set."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:                                            # Linux: the kernel's exact high-water mark
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # bytes on macOS, KiB elsewhere
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def reset_peak_memory(device: torch.device | str | None = None) -> bool:
    """Start :func:`memory_mb`'s peak afresh: CUDA's peak statistics, or Linux's resident high-water mark (writing
    5 to ``/proc/self/clear_refs``); False where neither can be reset (the peak then stays the whole process's)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def format_duration(seconds: float) -> str:
    """``42s``, ``3m07s``, ``2h05m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _fmt_rate(v: float) -> str:
    """``812``, ``12.3k``, ``4.56M``."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{suffix}"
    return f"{v:.3g}"


def _json_value(v):
    """Strict JSON: tensors become floats, NaN and infinities become null."""
    if isinstance(v, torch.Tensor):
        v = v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class Logger:
    """Fans metrics out to TensorBoard, ``metrics.jsonl`` and the console; a context manager.

    ``folder`` receives the event files and ``metrics.jsonl`` (appended to, so a resumed run continues
    the same file). Each sink can be switched off; ``enabled=False`` switches off all of them and
    creates nothing (for ranks other than 0).
    """

    def __init__(self, folder: str | os.PathLike, *, tensorboard: bool = True, jsonl: bool = True,
                 console: bool = True, enabled: bool = True):
        self.folder = os.fspath(folder)
        self._tb = self._jsonl = self._bins = None
        self._console = console and enabled
        if enabled and (tensorboard or jsonl):
            os.makedirs(self.folder, exist_ok=True)
        if enabled and jsonl:
            self._jsonl = open_append(os.path.join(self.folder, "metrics.jsonl"))
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            for planted in Path(self.folder).glob(f"{EVENTS}*"):   # its file names are SummaryWriter's to choose
                refuse_link(planted)
            self._tb = SummaryWriter(log_dir=self.folder)
        self._tty = self._console and sys.stderr.isatty()
        self._line_open = False                     # a progress line is on screen without its newline
        self._last: tuple[int, float] | None = None  # (step, time) at the previous progress call
        self._step_time: float | None = None        # EMA of seconds per step

    # -- TensorBoard and JSONL -------------------------------------------------------------------------

    def scalars(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Log ``{tag: value}`` at ``step``; returns the values as floats for the caller to reuse."""
        step = int(step)
        values = to_floats(metrics)
        if self._tb is not None and values:
            # one event holding every value (a Summary takes many), as add_scalar would write one event per tag:
            # gradient health's ~200 per-leaf scalars made that a visible part of a small CPU step at log_every=10
            # (docs/design.md, 'Measured choices')
            from tensorboard.compat.proto.summary_pb2 import Summary
            self._tb._get_file_writer().add_summary(
                Summary(value=[Summary.Value(tag=board_tag(tag), simple_value=v) for tag, v in values.items()]), step)
        self._write_jsonl({"step": step, "time": time.time(), **values})
        return values

    def event(self, step: int, kind: str, **fields) -> None:
        """A notable event (a rollback, a skipped step, early stopping): JSONL and TensorBoard text."""
        step = int(step)
        fields = {k: _json_value(v) for k, v in fields.items()}
        self._write_jsonl({"step": step, "time": time.time(), "event": kind, **fields})
        if self._tb is not None:
            detail = ", ".join(f"{k}={v}" for k, v in fields.items())
            self._tb.add_text(f"events/{kind}", f"step {step}: {kind}" + (f" ({detail})" if detail else ""), step)

    def text(self, step: int, tag: str, text: str) -> None:
        """Text at ``step`` (generated samples); TensorBoard renders it as markdown."""
        if self._tb is not None:
            self._tb.add_text(tag, text, int(step))

    def histogram(self, step: int, tag: str, values) -> None:
        """A histogram of ``values`` (a tensor or array) at ``step``, over TensorBoard's default ("tensorflow")
        buckets, handed over as an array: ``add_histogram`` would turn its list of ~1,500 edges into one on every
        call (gradient health writes five on each log step)."""
        if self._tb is not None:
            if isinstance(values, torch.Tensor):
                values = values.detach().float().cpu()
            if self._bins is None:
                import numpy as np
                self._bins = np.asarray(self._tb.default_bins)
            self._tb.add_histogram(board_tag(tag), values, int(step), bins=self._bins)

    def hparams(self, config: Mapping[str, Any], metrics: Mapping[str, Any] | None = None,
                step: int = 0) -> None:
        """The resolved config for TensorBoard's HParams tab and as a markdown table under ``config``.

        ``config`` is a nested dict (``core.config.to_dict``), flattened to dotted names. ``metrics`` maps
        the tags HParams compares runs by to a value, written as a scalar at ``step``, or to None for a
        tag that ``scalars`` logs anyway (HParams shows its latest value). Everything goes into this
        run's folder, not into a sub-run as ``SummaryWriter.add_hparams`` would.
        """
        if self._tb is None:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summaries
        flat = flatten_keys(config)
        values = {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v, default=str)
                  for k, v in flat.items()}
        metrics = {board_tag(tag): v for tag, v in (metrics or {}).items()}
        for summary in hparams_summaries(values, {tag: 0.0 for tag in metrics}):
            self._tb.file_writer.add_summary(summary)
        for tag, v in to_floats({k: v for k, v in metrics.items() if v is not None}).items():
            self._tb.add_scalar(tag, v, int(step))
        rows = "\n".join(f"| `{k}` | `{json.dumps(v, default=str)}` |" for k, v in flat.items())
        self._tb.add_text("config", "| key | value |\n|---|---|\n" + rows, 0)

    def layout(self, categories: Mapping[str, Mapping[str, Any]]) -> None:
        """The custom-scalars layout (TensorBoard's CUSTOM SCALARS tab): ``{category: {chart: [tag regex,
        ...]}}``, each chart a multi-line chart with one line per matching tag (``core.io.board.layout_of``)."""
        if self._tb is not None:
            self._tb.add_custom_scalars(layout_of(categories))

    def _write_jsonl(self, record: dict) -> None:
        if self._jsonl is not None:
            record = {k: _json_value(v) for k, v in record.items()}
            self._jsonl.write(json.dumps(record, default=str) + "\n")
            self._jsonl.flush()                     # a crash loses at most the line being written

    # -- console ---------------------------------------------------------------------------------------

    def progress(self, step: int, total: int, *, loss=None, tokens_per_sec=None,
                 extra: Mapping[str, Any] | None = None) -> None:
        """Show ``step/total``, the percentage, loss, tokens/s, ``extra`` values and the ETA."""
        if not self._console:
            return
        step, total, now = int(step), int(total), time.monotonic()
        if self._last is not None and step > self._last[0]:
            per_step = (now - self._last[1]) / (step - self._last[0])
            self._step_time = per_step if self._step_time is None else 0.7 * self._step_time + 0.3 * per_step
        self._last = (step, now)
        named = {"loss": loss, "tok/s": tokens_per_sec, **(extra or {})}
        values = to_floats({k: v for k, v in named.items() if v is not None})
        parts = [f"step {step}/{total} ({100 * step / max(total, 1):.1f}%)"]
        for k, v in values.items():
            parts.append(f"{k} {_fmt_rate(v) if k == 'tok/s' else _fmt(v)}")
        if self._step_time is not None and step < total:
            parts.append(f"eta {format_duration(self._step_time * (total - step))}")
        line = " | ".join(parts)
        if self._tty:                               # cut to the width: a wrapped line cannot be redrawn
            width = shutil.get_terminal_size().columns - 1
            click.echo("\r\x1b[K" + line[:width], nl=False, err=True)
            self._line_open = True
        else:
            click.echo(line, err=True)

    def print(self, message: str) -> None:
        """A one-off line (eval results, checkpoint saved) that does not garble the progress line."""
        if not self._console:
            return
        if self._line_open:
            click.echo("\r\x1b[K", nl=False, err=True)
            self._line_open = False
        progress(message)

    # -- lifetime --------------------------------------------------------------------------------------

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()
        if self._jsonl is not None:
            self._jsonl.flush()

    def close(self) -> None:
        """Flush and close every sink; ends an open progress line. Safe to call twice."""
        if self._line_open:
            click.echo("", err=True)
            self._line_open = False
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> "Logger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

