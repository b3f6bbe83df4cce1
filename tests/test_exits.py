"""Exit codes (``core.exits``): the table of docs/configuration.md is the code's, and a run that stops without
finishing (too many rollbacks, a non-finite validation loss) exits 4 with its last state as ``stopped.msgpack``,
never ``final``; a rerun on its folder says so instead of repeating it, and a grid marks the cell failed and goes
on. The compiled run at its rollback cap, as a process, is tests/test_default_paths.py's."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import torch

from purestep.core import exits
from purestep.core.io import checkpoint as ckpt
from purestep.recipes import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["recipe=standard", "preset=tiny", "compile=false", "block_size=32", "batch_size=4", "model.d_model=32",
        "model.n_layers=1", "model.n_heads=2", "sample_tokens=0", "eval_batches=2", "warmup_steps=0", "log_every=1",
        "save_every=10", "steps=20"]

pytestmark = pytest.mark.usefixtures("token_cache", "one_thread")   # tests/conftest.py


def events(folder: Path) -> list[dict]:
    return [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "event" in r]


def last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


def test_the_documented_exit_code_table_is_the_codes():
    import documentation
    page, table = documentation.block("exit-codes")
    assert table.strip() == exits.markdown_table(), \
        f"replace the table in {page.relative_to(ROOT)} with:\n{exits.markdown_table()}"
    assert (exits.DONE, exits.BAD_INPUT, exits.GATE, exits.STOPPED) == (0, 2, 3, 4)


def test_a_run_at_its_rollback_cap_exits_4_and_is_not_final_and_a_rerun_says_so(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    command = [*TINY, f"data={corpus}", "lr=1e30", f"out={out}"]
    assert main(command) == exits.STOPPED
    line = last_line(capsys.readouterr().err)
    assert line.startswith("stopped: 3 rollbacks within 1000 steps (the last at step ") and \
        line.endswith(f"its last state is {out / ckpt.STOPPED}, not final.msgpack"), line
    assert (out / ckpt.STOPPED).exists() and not (out / ckpt.FINAL).exists()
    top = ckpt.read_meta(out / ckpt.STOPPED)
    assert top["stopped"].startswith("3 rollbacks within 1000 steps") and top["step"] == 0   # the last rollback's
    assert [e["event"] for e in events(out)].count("rollback") == 3 and events(out)[-1]["event"] == "rollback_cap"

    log = (out / "metrics.jsonl").read_bytes()
    assert main(command) == exits.STOPPED                # the same command again: says what happened, runs nothing
    err = capsys.readouterr().err
    assert last_line(err) == (f"stopped: {out} holds a run that stopped without finishing: {top['stopped']}. Rerunning "
                              f"would repeat it: start a new run with another out= (e.g. a lower lr), or continue "
                              f"from its last state (step 0) on purpose with resume={out / ckpt.STOPPED}")
    assert (out / "metrics.jsonl").read_bytes() == log and "resuming" not in err

    # continuing on purpose from that state, with a sane lr, finishes the run: the folder is no longer stopped
    assert main([*command[:-2], "lr=1e-3", f"resume={out / ckpt.STOPPED}", f"out={out}"]) == exits.DONE
    assert (out / ckpt.FINAL).exists() and not (out / ckpt.STOPPED).exists()
    assert ckpt.read_meta(out / ckpt.FINAL)["step"] == 20


def test_a_non_finite_validation_loss_stops_the_run_as_diverged(corpus, tmp_path, capsys, monkeypatch):
    """Evaluation sees NaN (weights broken beyond what the step's non-finite skip guards): stop, not final."""
    import purestep.recipes.standard
    from purestep import recipes
    monkeypatch.setattr(recipes.standard, "evaluate", lambda *a, **k: float("nan"))
    out = tmp_path / "run"
    assert main([*TINY, f"data={corpus}", "eval_every=10", "spike.enabled=false", f"out={out}"]) == exits.STOPPED
    assert last_line(capsys.readouterr().err) == (f"stopped: diverged: validation loss nan at step 10; its last "
                                                  f"state is {out / ckpt.STOPPED}, not final.msgpack")
    assert ckpt.read_meta(out / ckpt.STOPPED)["step"] == 10 and not (out / ckpt.FINAL).exists()
    last = events(out)[-1]
    assert not (out / ckpt.BEST).exists() and (last["step"], last["event"], last["val_loss"]) == (10, "diverged", "nan")


def test_the_manager_links_a_stopped_state_and_any_later_save_unlinks_it(tmp_path):
    manager = ckpt.CheckpointManager(tmp_path, keep_last=0)
    tree = {"w": torch.ones(2)}
    assert ckpt.stopped_run(tmp_path) is None
    manager.save(3, tree, stopped="diverged: validation loss nan at step 3")
    assert os.path.samefile(tmp_path / ckpt.STOPPED, tmp_path / "step_000000003.msgpack")
    assert not (tmp_path / ckpt.FINAL).exists()
    assert "stopped without finishing: diverged: validation loss nan at step 3." in str(ckpt.stopped_run(tmp_path))
    with pytest.raises(exits.RunStopped):
        ckpt.resolve_resume("auto", tmp_path)
    assert ckpt.resolve_resume(str(tmp_path / ckpt.STOPPED), tmp_path) == tmp_path / ckpt.STOPPED   # on purpose
    manager.save(4, tree, final=True)
    assert not (tmp_path / ckpt.STOPPED).exists() and ckpt.read_meta(ckpt.resolve_resume("auto", tmp_path))["step"] == 4


def read_cells(root: Path) -> dict[str, dict]:
    rows = list(csv.reader((root / "grid.csv").read_text().splitlines()))
    return {r[0]: dict(zip(rows[0], r)) for r in rows[1:rows.index([])]}


def test_a_grid_marks_a_stopped_cell_failed_and_goes_on(corpus, tmp_path, capsys):
    root = tmp_path / "grid"
    command = [*TINY, f"data={corpus}", f"out={root}", "grid.lr=1e30,1e-3"]
    assert main(command) == exits.STOPPED
    err = capsys.readouterr().err
    assert "grid cell 1/2: lr=1e+30 failed: stopped without finishing: 3 rollbacks" in err
    assert "grid cell 2/2: lr=0.001 -> " in err           # the grid went on after the failed cell
    assert last_line(err) == ("stopped: 1 of 2 grid cells stopped without finishing (lr=1e+30); the summary marks them "
                              "failed; to run one again, delete its folder (or grid other values)")
    cells = read_cells(root)
    assert {name: c["status"] for name, c in cells.items()} == {"lr=1e+30": "failed", "lr=0.001": "finished"}
    assert "| `lr=1e+30` | failed |" in (root / "grid.md").read_text()

    logs = {name: (root / name / "metrics.jsonl").read_bytes() for name in cells}
    assert main(command) == exits.STOPPED                # rerun: both skipped, the failed one named with its reason
    err = capsys.readouterr().err
    assert "grid cell 1/2: lr=1e+30 failed: " in err and "holds a run that stopped without finishing" in err
    assert "grid cell 2/2: lr=0.001 is finished" in err
    assert {name: (root / name / "metrics.jsonl").read_bytes() for name in cells} == logs


STOPPER = '''
"""A grid cell that finishes or stops without finishing, as asked (tests/test_exits.py)."""
from dataclasses import dataclass
from pathlib import Path

import torch

from purestep.core.io import checkpoint as ckpt
from purestep.core.config import option
from purestep.core.exits import RunStopped

GRID = True


@dataclass
class Config:
    out: str = option("", "run folder")
    name: str = option("", "run name")
    diverge: bool = option(False, "stop without finishing")


def run(cfg):
    manager = ckpt.CheckpointManager(Path(cfg.out), keep_last=0)
    if cfg.diverge:
        manager.save(1, {"w": torch.ones(1)}, stopped="diverged: validation loss nan at step 1")
        raise RunStopped("diverged: validation loss nan at step 1")
    manager.save(1, {"w": torch.ones(1)}, final=True)
'''


def test_parallel_grid_cells_that_stop_are_marked_failed_and_the_grid_goes_on(tmp_path, monkeypatch, capsys):
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "__init__.py").write_text("")
    (tmp_path / "lab" / "stopper.py").write_text(STOPPER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))     # the cells' processes import it too
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    root = tmp_path / "grid"
    assert main(["recipe=lab.stopper", f"out={root}", "grid.diverge=true,false", "grid.parallel=2"]) == exits.STOPPED
    err = capsys.readouterr().err
    assert "grid cell 1/2: diverge=true failed: stopped without finishing" in err and "grid cell 2/2: diverge=false done" in err
    assert {n: c["status"] for n, c in read_cells(root).items()} == {"diverge=true": "failed", "diverge=false": "finished"}


EXIT_SCRIPT = """
import atexit, sys, threading, time
from purestep.core.exits import exit_process
atexit.register(lambda: open(sys.argv[1], "w").write("handlers ran"))
print("buffered", end="")
if sys.argv[2] == "thread":
    threading.Thread(target=lambda: (time.sleep(1), open(sys.argv[1] + ".thread", "w").write("waited"))).start()
exit_process(int(sys.argv[3]))
"""


@pytest.mark.parametrize("thread", ["none", "thread"])
def test_exit_process_runs_handlers_flushes_and_keeps_the_code(tmp_path, thread):
    """``bin/run`` ends through ``core.exits.exit_process``: the exit handlers run, buffered output arrives, the
    code is the command's; a live non-daemon thread gets the ordinary exit, which waits for it."""
    import subprocess
    import sys
    marker = tmp_path / "marker"
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(marker), thread, "4"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 4 and proc.stdout == "buffered", proc.stderr[-2000:]
    assert marker.read_text() == "handlers ran"
    assert (tmp_path / "marker.thread").exists() == (thread == "thread")
