"""Run folders: names stay inside runs/, and one live run owns a folder at a time."""
import subprocess
import sys
import textwrap

import pytest

from core.config import ConfigError
from core.runs import RunFolderLocked, claim, run_folder


@pytest.mark.parametrize("name", ["../../../x", "a/b", "..", "."])
def test_a_name_cannot_leave_the_runs_folder(name):
    with pytest.raises(ConfigError, match="must be a plain name"):
        run_folder("", name, "standard")


def test_a_second_process_cannot_claim_a_held_folder_and_the_lock_dies_with_its_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from core.runs import claim
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
