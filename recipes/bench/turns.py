"""Whole runs as child processes taking turns, cold and warm: what ``bench.wall`` and ``bench.nanogpt`` share.

:func:`timed` runs one command as a child process with inductor's cache (``TORCHINDUCTOR_CACHE_DIR``) where the
benchmark puts it, timed from its start to its exit, each output line stamped with the seconds since the start, and
its peak resident set (``ru_maxrss`` of ``os.wait4``: the child's, or its largest waited-for descendant's).
:func:`take_turns` is the schedule: per repeat, per cache state, each side in the order given; ``cold`` runs compile
into a new, empty cache, one per run; ``warm`` runs read the cache their own side's first cold run filled (an untimed
cold run fills it first if none ran yet).
"""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from purestep.core.config import UserError
from purestep.core.io.logging import progress

REPO = Path(__file__).resolve().parents[2]
CACHES = ("cold", "warm")


def check_caches(caches: tuple[str, ...]) -> None:
    """``caches=``: some of ``cold``, ``warm``, or an error naming the key."""
    unknown = [c for c in caches if c not in CACHES]
    if unknown or not caches:
        raise UserError(f"bad value for 'caches': {','.join(caches)}; give cold, warm or both")


def loss_text(value) -> str:
    return "?" if value is None else f"{value:.4f}"


@dataclass
class Child:
    """A finished child process: its wall seconds, its output lines with the seconds since its start at which each
    arrived, and its peak RSS in MiB."""
    seconds: float
    lines: list[tuple[float, str]]
    peak_rss_mib: float

    @property
    def text(self) -> str:
        return "".join(f"{line}\n" for _, line in self.lines)


def timed(argv: list[str], cache: Path, log: Path, cwd: Path = REPO) -> Child:
    """Run ``argv`` in ``cwd`` with this checkout on the path, unbuffered output (so each line's time is when it was
    printed) and inductor's cache at ``cache``; stdout and stderr together are written to ``log`` as they come. A
    failure is an error naming the log."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    lines = []
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with open(log, "w") as written:                         # as it comes, so a long run can be followed
        for line in proc.stdout:
            lines.append((time.perf_counter() - start, line.rstrip("\n")))
            written.write(line)
            written.flush()
    proc.stdout.close()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)     # reaped here: wait4 is what gives the child's rusage
    child = Child(seconds, lines, usage.ru_maxrss / 1024)   # KiB on Linux
    if proc.returncode != 0:
        raise UserError(f"{' '.join(argv[:4])} ... exited {proc.returncode}; its output is in {log}")
    return child


def slug(side: str) -> str:
    """A side's name as a folder name: ``plain, loss outside`` -> ``plain-loss-outside``."""
    return side.replace(", ", "-").replace(" ", "-")


def take_turns(sides: dict[str, Callable[[Path, Path], dict]], caches: tuple[str, ...], repeats: int, folder: Path,
               tmp: Path) -> dict[str, dict[str, list[dict]]]:
    """``{cache state: {side: [each repeat's result]}}``: ``sides[name](run folder, inductor cache)`` runs one side
    once and returns its result (``wall_s``, ``val_loss``, optionally ``compile_s``); runs go in ``folder``, caches
    in ``tmp``, each named for its side (:func:`slug`), cache state and repeat."""
    runs: dict[str, dict[str, list]] = {c: {s: [] for s in sides} for c in caches}
    warm_caches: dict[str, Path] = {}
    for repeat in range(repeats):
        for cache_state in caches:
            for side, fn in sides.items():
                name = slug(side)
                if cache_state == "warm" and side not in warm_caches:   # fill it: a cold run, not timed
                    warm_caches[side] = tmp / f"{name}-filled"
                    fn(folder / f"{name}-fill", warm_caches[side])
                cache = tmp / f"{name}-cold-{repeat}" if cache_state == "cold" else warm_caches[side]
                r = fn(folder / f"{name}-{cache_state}-{repeat}", cache)
                if cache_state == "cold" and side not in warm_caches:
                    warm_caches[side] = cache
                runs[cache_state][side].append(r)
                compiling = f", compiling {r['compile_s']:.1f}s" if r.get("compile_s") is not None else ""
                progress(f"  {side}, {cache_state} cache ({repeat + 1}/{repeats}): {r['wall_s']:.1f}s{compiling}, "
                         f"val loss {loss_text(r['val_loss'])}")
    return runs
