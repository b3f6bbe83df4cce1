"""Commands run as users run them: ``purestep`` (and ``torchrun``) in child processes, several at a time, each
started once the commands it needs have succeeded, each stopped at a shared deadline.

A job's output goes to ``<folder>/<name>.log``; its report item holds the command, the exit code, the wall time
and the log's last lines.
"""
from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from purestep.core.cli.command import merge_args
from purestep.recipes.bench.gpu.report import Report

REPO = Path(__file__).resolve().parents[3]
BIN_RUN = str(REPO / "bin" / "run")


def bin_run(*args: str) -> list[str]:
    """``purestep ARGS`` through this Python (a later key laid over an earlier one: ``merge_args``)."""
    return [sys.executable, BIN_RUN, *merge_args(*args)]


def torchrun(nproc: int, *args: str) -> list[str]:
    """``torchrun --standalone --nproc_per_node=N purestep ARGS`` through this Python (``merge_args``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", BIN_RUN,
            *merge_args(*args)]


@dataclass
class Job:
    name: str
    argv: list[str]
    needs: tuple[str, ...] = ()
    section: str = "recipes"
    ok_codes: tuple[int, ...] = (0,)   # the exit codes that count as success
    requires: tuple[str, ...] = ()     # importable modules it needs (an optional extra's), else it is skipped
    proc: subprocess.Popen | None = None
    started: float = 0.0
    result: dict = field(default_factory=dict)


def child_env() -> dict:
    """The children's environment: this checkout first on the path (the parent's inductor cache is inherited
    through ``TORCHINDUCTOR_CACHE_DIR``)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def run_jobs(report: Report, jobs: list[Job], folder: Path, deadline: float, parallel: int = 8) -> dict[str, Job]:
    """Run ``jobs`` (at most ``parallel`` at once) until all ended or ``deadline`` (``time.monotonic()``) passed;
    each ends as one report item in its section. A job whose needs failed is skipped, saying which."""
    folder.mkdir(parents=True, exist_ok=True)
    env, pending, running, done = child_env(), list(jobs), [], {}
    names = {job.name for job in jobs}
    while pending or running:
        for job in list(pending):
            failed = [n for n in job.needs if n not in names or (n in done and done[n].result.get("ok") is not True)]
            absent = [m for m in job.requires if importlib.util.find_spec(m) is None]
            if absent:
                pending.remove(job)
                done[job.name] = _finish(report, job, ok=None, reason=f"needs {', '.join(absent)} (an optional "
                                                                     f"extra: pip install purestep[hf])")
            elif failed:
                pending.remove(job)
                done[job.name] = _finish(report, job, ok=None, reason=f"needs {', '.join(failed)}")
            elif all(n in done for n in job.needs) and len(running) < parallel and time.monotonic() < deadline:
                pending.remove(job)
                job.started = time.monotonic()
                log = open(folder / f"{job.name}.log", "w")
                job.proc = subprocess.Popen(job.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder,
                                            start_new_session=True)
                log.close()
                running.append(job)
        for job in list(running):
            code = job.proc.poll()
            if code is None and time.monotonic() < deadline:
                continue
            if code is None:
                _stop(job.proc)
            running.remove(job)
            tail = _tail(folder / f"{job.name}.log")
            ok = code in job.ok_codes
            done[job.name] = _finish(report, job, ok=ok, exit_code=code, log_tail=tail,
                                     seconds=round(time.monotonic() - job.started, 1),
                                     summary=tail[-1] if ok and tail else None,
                                     error=None if ok else ("stopped at the deadline" if code is None
                                                            else f"exit {code}: {_error_line(tail)}"))
        if pending and not running and time.monotonic() >= deadline:
            for job in pending:
                done[job.name] = _finish(report, job, ok=None, reason="not started: out of time")
            pending = []
        time.sleep(0.5)
    return done


def _finish(report: Report, job: Job, **result) -> Job:
    job.result = {"name": job.name, "command": " ".join(map(shlex.quote, job.argv[1:])),
                  **{k: v for k, v in result.items() if v is not None}}
    job.result.setdefault("ok", result.get("ok"))
    seconds = job.result.pop("seconds", 0.0)
    item = dict(job.result, seconds=seconds)
    report.add(job.section, item)
    return job


def _stop(proc: subprocess.Popen) -> None:
    """Stop a child and everything it started (torchrun's workers, compile workers)."""
    import signal
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=10)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def _error_line(tail: list[str]) -> str:
    """The line of a failed command's output that names the error (the last ``...Error``/``error:`` line)."""
    named = [line for line in tail if "Error" in line or line.startswith(("error:", "gate failed:", "stopped:"))]
    return (named or tail or [""])[-1].strip()


def _tail(path: Path, lines: int = 40) -> list[str]:
    text = path.read_text(errors="replace").replace("\r", "\n") if path.exists() else ""
    return [line for line in text.splitlines() if line.strip()][-lines:]
