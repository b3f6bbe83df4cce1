"""Run folders: names stay inside runs/, and one live run owns a folder at a time."""
import json
import subprocess
import sys
import textwrap

import pytest

from purestep.core.config import ConfigError
from purestep.core.cli.runs import RunFolderLocked, claim, run_folder
from purestep.core.cli.command import merge_args  # noqa: E402 (bin/run refuses a repeated key)


@pytest.mark.parametrize("name", ["../../../x", "a/b", "..", "."])
def test_a_name_cannot_leave_the_runs_folder(name):
    with pytest.raises(ConfigError, match="must be a plain name"):
        run_folder("", name, "standard")


def test_a_second_process_cannot_claim_a_held_folder_and_the_lock_dies_with_its_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from purestep.core.cli.runs import claim
        with claim({str(tmp_path)!r}):
            print("held", flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderLocked, match=rf"pid {holder.pid} on host"):
            with claim(tmp_path):
                pass
    finally:
        holder.kill()                                  # kill -9: no cleanup runs, the kernel drops the lock
        holder.wait()
    with claim(tmp_path):                              # no stale lock
        with pytest.raises(RunFolderLocked):           # and a second claim, even in-process, is refused
            with claim(tmp_path):
                pass
    with claim(tmp_path):                              # released at the end of the block
        pass


def test_two_runs_on_one_folder_the_second_stops_naming_the_first(tmp_path, corpus):
    """Two real ``bin/run`` processes on the same out=: the second exits 2 naming the first's pid and host,
    and the first's run is untouched (it finishes, resumable, with its own metrics only)."""
    import os
    import signal
    from pathlib import Path
    repo = Path(__file__).resolve().parent.parent
    args = [sys.executable, str(repo / "bin" / "run"), *merge_args("recipe=standard", "preset=tiny", "compile=false",
            "sample_tokens=0", "eval_batches=1", f"data={corpus}", "steps=2000", "save_every=20", "log_every=1",
            f"out={tmp_path / 'run'}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(args, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        for line in first.stderr:                      # training: it holds the folder
            if line.startswith("step "):
                break
        second = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        assert second.stderr.startswith("error: out=") and f"pid {first.pid} on host" in second.stderr, second.stderr
        assert second.stderr.count("\n") == 1
    finally:
        first.send_signal(signal.SIGTERM)              # preemption: it saves and exits 0
        first.communicate(timeout=120)
    assert first.returncode == 0
    steps = [r["step"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if "train/loss" in r]
    assert steps == list(range(1, len(steps) + 1))   # one run's log, not two interleaved
