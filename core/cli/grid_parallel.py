"""``grid.parallel=N``: a grid's cells run N at once, each as its own ``purestep`` process (``core.cli.grid``).

A cell's command is this command's arguments without the grid (``grid.*``, the seed list) and without
``out=``/``name=``, followed by the cell's values and ``out=<cell folder>``; it runs from the same working
directory as ``python -m purestep`` with the copy of purestep that planned it first on ``PYTHONPATH`` (a checkout or
an installed package), so it imports the code that planned it. Its console
output goes to ``<cell folder>/grid.log`` (appended to on a rerun); one line here says when each cell starts
and ends. Every process keeps its own thread settings (``OMP_NUM_THREADS``): on a small machine give each
cell fewer threads (``OMP_NUM_THREADS=1 purestep ... grid.parallel=2``).

A cell that stops without finishing (exit code 4, ``core.exits.STOPPED``: diverged, too many rollbacks) is
reported and the grid goes on. A cell that fails otherwise lets the running ones finish and starts no new one; the
grid then stops with one line naming the failed cells and their logs (their exit codes: 2 a user error, 1 a bug).
Ctrl-C (or SIGTERM) asks every running cell to stop with a checkpoint (SIGTERM, which the training loop turns into
a clean stop) and waits.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import purestep
from purestep.core.config import UserError
from purestep.core.exits import STOPPED
from purestep.core.io.logging import progress

LOG = "grid.log"
PACKAGE_ROOT = Path(purestep.__file__).resolve().parents[1]   # the folder ``import purestep`` found it in
DROP = ("out", "name")


def child_argv(argv: Sequence[str], axes: Sequence[str], cell) -> list[str]:
    """``purestep`` arguments for one cell: ``argv`` without the grid, its values, and its folder as ``out=``."""
    keep = []
    for token in argv:
        key = token.partition("=")[0].strip()
        if key.startswith("grid.") or key in DROP or key in axes:   # each key once: purestep refuses a repeat
            continue
        keep.append(token)
    return [*keep, *(f"{k}={v}" for k, v in cell.values.items()), f"out={cell.folder}"]


def _start(cell, args: list[str]) -> subprocess.Popen:
    cell.folder.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    with open(cell.folder / LOG, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "purestep", *args], stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": path})


def _stop(running: dict) -> None:
    """SIGTERM to every running cell (each stops with a checkpoint), then wait for all of them."""
    for proc in running:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in running:
        proc.wait()


def run_parallel(todo: Sequence[tuple[int, object]], total: int, axes: Sequence[str], argv: Sequence[str],
                 n: int) -> list[str]:
    """Run the cells ``todo`` (``(number, Cell)``) ``n`` at a time; returns the names of those that stopped without
    finishing; a UserError naming the ones that failed otherwise."""
    queue, running, failed, stopped = list(todo), {}, [], []
    try:
        while running or (queue and not failed):
            while queue and not failed and len(running) < n:
                i, cell = queue.pop(0)
                running[_start(cell, child_argv(argv, axes, cell))] = (i, cell)
                progress(f"grid cell {i}/{total}: {cell.name} -> {cell.folder} (log: {cell.folder / LOG})")
            time.sleep(0.1)
            for proc in [p for p in running if p.poll() is not None]:
                i, cell = running.pop(proc)
                if proc.returncode == STOPPED:
                    stopped.append(cell.name)
                elif proc.returncode != 0:
                    failed.append(f"{cell.name} (exit {proc.returncode}, see {cell.folder / LOG})")
                progress(f"grid cell {i}/{total}: {cell.name} " + (
                    "done" if proc.returncode == 0 else f"failed: stopped without finishing (see {cell.folder / LOG})"
                    if proc.returncode == STOPPED else f"failed with exit code {proc.returncode}"))
    except BaseException:
        _stop(running)
        raise
    if failed:
        raise UserError(f"grid cell{'s' if len(failed) > 1 else ''} {'; '.join(failed)} failed; fix the cause and "
                        f"rerun the same command: finished cells are skipped, the rest resume")
    return stopped
