"""Hostile inputs (issue 49): a run folder belongs to its run, untrusted files and templates are bounded, a diverged
run is not a success, and every bad input is one ``error:`` line. Each test is one of the issue's reproductions with
its documented outcome; the data-loss ones assert every original file's bytes afterwards."""
import shutil
from pathlib import Path

import pytest

from core.cli.runs import claim
from recipes import main

FIXTURE = Path(__file__).parent / "fixtures" / "behaviour" / "step_000000030.msgpack"   # a char-level tiny run


def snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def first_error(capsys, *args: str, code: int = 2) -> str:
    assert main(list(args)) == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[0].startswith("error: ") and len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def run_folder(tmp_path):
    """A run folder as training leaves it: a checkpoint, metrics.jsonl and its .lock."""
    folder = tmp_path / "cc2"
    folder.mkdir()
    shutil.copy(FIXTURE, folder / "step_000000050.msgpack")
    (folder / "metrics.jsonl").write_text('{"step": 50, "loss": 2.5}\n')
    (folder / ".lock").write_text("pid 1 on host h\n")
    return folder


def test_export_refuses_a_live_run_folder_and_leaves_every_byte(run_folder, capsys):
    with claim(run_folder):                      # the running job's lock: flock, as a second process holds it
        before = snapshot(run_folder)
        message = first_error(capsys, "recipe=export", f"init={FIXTURE}", f"out={run_folder}", "overwrite=true",
                              "verify=false")
        assert "in use by a run" in message and "pid " in message
        assert snapshot(run_folder) == before
    message = first_error(capsys, "recipe=export", f"init={FIXTURE}", f"out={run_folder}", "overwrite=true",
                          "verify=false")                      # no live holder: its files still are not export's
    assert ".lock" in message and snapshot(run_folder) == before
    assert sorted(p.name for p in run_folder.parent.iterdir()) == ["cc2"]     # no temporary left


def test_export_refuses_init_inside_out(run_folder, capsys):
    (run_folder / ".lock").unlink()
    shutil.copy(FIXTURE, run_folder / "final.msgpack")
    before = snapshot(run_folder)
    message = first_error(capsys, "recipe=export", f"init={run_folder / 'final.msgpack'}", f"out={run_folder}",
                          "overwrite=true")
    assert "inside out=" in message and snapshot(run_folder) == before
    message = first_error(capsys, "recipe=export", f"init={run_folder}", f"out={run_folder}", "overwrite=true")
    assert "inside out=" in message and snapshot(run_folder) == before


def test_export_overwrite_replaces_an_earlier_export_only(tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["recipe=export", f"init={FIXTURE}", f"out={out}", "verify=false"]) == 0
    first = snapshot(out)
    assert "model.safetensors" in first and "config.json" in first
    (out / "config.json").write_text("{}")
    assert main(["recipe=export", f"init={FIXTURE}", f"out={out}", "verify=false", "overwrite=true"]) == 0
    assert snapshot(out) == first                                # replaced: the same files as the first export
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert "notes.txt" in first_error(capsys, "recipe=export", f"init={FIXTURE}", f"out={out}", "overwrite=true")
    assert (out / "notes.txt").read_text() == "mine" and snapshot(out).keys() == {*first, "notes.txt"}
