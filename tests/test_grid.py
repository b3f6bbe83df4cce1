"""Seed lists and grids (core.cli.grid): the cells, their folders, resuming, the summary, and refusals."""
from __future__ import annotations

import csv
import json
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from purestep.core.io import checkpoint as ckpt
from purestep.core.config import ConfigError, option
from purestep.core.cli.grid import alternatives, cell_name, plan, split_grid
from purestep.recipes import main

pytestmark = pytest.mark.usefixtures("token_cache", "one_thread")   # tests/conftest.py

SMALL = ["preset=tiny", "steps=20", "compile=false", "block_size=32", "batch_size=4", "model.d_model=32",
         "model.n_layers=1", "model.n_heads=2", "eval_every=10", "eval_batches=2", "save_every=10",
         "sample_tokens=0", "log_every=5"]
CELLS = ["seed=1,lr=0.001", "seed=1,lr=0.003", "seed=2,lr=0.001", "seed=2,lr=0.003"]


def own_metrics(folder: Path) -> dict:
    """A run's own final and best validation loss from its metrics.jsonl, checked against its final checkpoint."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    val = [r["val/loss"] for r in records if "val/loss" in r]
    best = ckpt.load(folder / ckpt.FINAL)["loop"]["best_val"]
    assert min(val) == pytest.approx(best, rel=1e-6)
    return {"final_val_loss": val[-1], "best_val_loss": best}


def read_summary(root: Path) -> tuple[dict[str, dict], dict[str, dict]]:
    rows = list(csv.reader((root / "grid.csv").read_text().splitlines()))
    gap = rows.index([])
    cells = [dict(zip(rows[0], r)) for r in rows[1:gap]]
    groups = [dict(zip(rows[gap + 1], r)) for r in rows[gap + 2:]]
    return {c["cell"]: c for c in cells}, {g["group"]: g for g in groups}


def test_seed_list_and_grid_run_resumably_with_a_summary(corpus, tmp_path, capsys):
    root = tmp_path / "grid"
    command = ["recipe=standard", f"data={corpus}", f"out={root}", *SMALL, "seed=1,2", "grid.lr=1e-3,3e-3"]
    assert main(command) == 0
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == CELLS
    cells, groups = read_summary(root)
    assert list(cells) == CELLS
    first = {}
    for name in CELLS:
        own = first[name] = own_metrics(root / name)
        row = cells[name]
        assert row["status"] == "finished" and row["step"] == "20" and (row["seed"], row["lr"]) == tuple(
            part.split("=")[1] for part in name.split(","))
        assert float(row["final_val_loss"]) == own["final_val_loss"]
        assert float(row["best_val_loss"]) == own["best_val_loss"]
        assert float(row["tokens_per_sec"]) > 0 and float(row["wall_seconds"]) > 0
        assert ckpt.load(root / name / ckpt.FINAL)["config"]["lr"] == float(row["lr"])
    for lr in ("0.001", "0.003"):
        pair = [first[f"seed={s},lr={lr}"]["final_val_loss"] for s in (1, 2)]
        assert groups[f"lr={lr}"]["seeds"] == "2"
        assert float(groups[f"lr={lr}"]["final_val_loss_mean"]) == pytest.approx(sum(pair) / 2)
        assert float(groups[f"lr={lr}"]["final_val_loss_std"]) == pytest.approx(abs(pair[0] - pair[1]) / 2 ** 0.5)
    assert (root / "grid.md").read_text().count("| `seed=") == 4

    # an interruption after step 10 of one cell: its last checkpoints gone; the rerun resumes that cell alone
    victim = root / "seed=2,lr=0.001"
    for name in (ckpt.FINAL, ckpt.BEST, "step_000000020.msgpack"):
        (victim / name).unlink(missing_ok=True)
    before = {name: (root / name / "metrics.jsonl").read_bytes() for name in CELLS}
    capsys.readouterr()
    assert main(command) == 0
    err = capsys.readouterr().err
    assert err.count("is finished") == 3 and "grid cell 3/4: seed=2,lr=0.001 -> " in err
    assert "resum" in err.lower()
    for name in CELLS:
        after = (root / name / "metrics.jsonl").read_bytes()
        assert (after == before[name]) == (name != victim.name)
    cells, _ = read_summary(root)
    assert float(cells[victim.name]["final_val_loss"]) == first[victim.name]["final_val_loss"]   # bitwise resume
    assert own_metrics(victim)["final_val_loss"] == first[victim.name]["final_val_loss"]


def test_parallel_cells_run_as_subprocesses_and_a_failed_cell_resumes_after_the_fix(corpus, tmp_path, monkeypatch,
                                                                                     capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")          # the cells' processes, like this one (one_thread)
    (tmp_path / "a.txt").write_bytes(corpus.read_bytes())
    command = ["recipe=standard", "out=grid", *SMALL, "seed=3", "grid.data=a.txt,b.txt", "grid.parallel=2"]
    assert main(command) == 2                           # b.txt is missing: its cell fails, the other finishes
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: grid cell data=b.txt (exit 2, see grid/data=b.txt/grid.log) failed")
    root = tmp_path / "grid"
    assert "b.txt" in (root / "data=b.txt" / "grid.log").read_text()
    cells, _ = read_summary(root)
    assert [c["status"] for c in cells.values()] == ["finished", "unfinished"]

    (tmp_path / "b.txt").write_bytes(corpus.read_bytes())
    done = (root / "data=a.txt" / "metrics.jsonl").read_bytes()
    assert main(command) == 0
    assert (root / "data=a.txt" / "metrics.jsonl").read_bytes() == done      # finished: skipped
    cells, groups = read_summary(root)
    assert all(c["status"] == "finished" for c in cells.values())
    a, b = own_metrics(root / "data=a.txt"), own_metrics(root / "data=b.txt")
    assert a == b                                       # the same text and seed: the same run, in its own process
    assert float(cells["data=b.txt"]["final_val_loss"]) == b["final_val_loss"]
    assert groups["data=b.txt"]["seeds"] == "1" and groups["data=b.txt"]["final_val_loss_std"] == ""


def test_alternatives_split_on_bars_when_given_else_commas():
    assert alternatives("grid.lr", "1e-3, 3e-3") == ["1e-3", "3e-3"]
    assert alternatives("grid.betas", "0.9,0.95|0.9,0.99") == ["0.9,0.95", "0.9,0.99"]
    assert alternatives("grid.betas", "0.9,0.95|") == ["0.9,0.95"]
    for bad in ("1,,2", "|1", "1,1", "a|b|"):
        with pytest.raises(ConfigError, match="'grid.x'"):
            alternatives("grid.x", bad)
    rest, axes, parallel = split_grid({"steps": "5", "seed": "3,1", "grid.model.d_model": "64,128",
                                       "grid.parallel": "2"})
    assert rest == {"steps": "5"} and axes == {"seed": ["3", "1"], "model.d_model": ["64", "128"]} and parallel == 2
    assert split_grid({"seed": "7"}) == ({"seed": "7"}, {}, 1)
    for pairs, fragment in (({"grid.out": "a,b"}, "'grid.out'"), ({"grid.lr": "1,2", "lr": "3"}, "'grid.lr' and 'lr'"),
                            ({"grid.seed": "1,2"}, "seed=1,2,3"), ({"grid.": "1"}, "'grid.'"),
                            ({"grid.parallel": "0", "seed": "1,2"}, "'grid.parallel'"),
                            ({"grid.parallel": "2"}, "grid.parallel=2 without a grid")):
        with pytest.raises(ConfigError, match=fragment):
            split_grid(pairs)


@dataclass
class _Shape:
    scaling: dict = option({}, "a dict key")


@dataclass
class _Config:
    seed: int = option(0, "seed")
    betas: tuple[float, float] = option((0.9, 0.95), "a tuple key")
    lr: float = option(1e-3, "lr")
    out: str = option("", "run folder")
    name: str = option("", "run name")
    shape: _Shape = option(_Shape, "section")


def test_cells_of_list_and_dict_keys_are_named_by_their_parsed_values(tmp_path):
    module = types.SimpleNamespace(Config=_Config, PRESETS=None)
    _, axes, _ = split_grid({"grid.betas": "0.9,0.95|0.8,0.99", "grid.shape.scaling": '{"factor":2}|{"factor":4}',
                          "grid.lr": "1e-3"})
    cells = plan("toy", module, None, {}, {}, axes, tmp_path)
    assert [c.cfg.betas for c in cells] == [(0.9, 0.95)] * 2 + [(0.8, 0.99)] * 2
    assert [c.cfg.shape.scaling for c in cells] == [{"factor": 2}, {"factor": 4}] * 2
    assert cells[0].name == 'betas=0.9_0.95,shape.scaling=__factor__2_,lr=0.001'
    assert cells[0].folder == tmp_path / cells[0].name and cells[0].cfg.out == str(cells[0].folder)
    _, axes, _ = split_grid({"grid.lr": "1e-3,abc"})
    with pytest.raises(ConfigError, match="bad value for 'lr'.*grid cell lr=abc|bad value for 'lr'"):
        plan("toy", module, None, {}, {}, axes, tmp_path)
    _, axes, _ = split_grid({"grid.lr": "1e-3,0.001"})
    with pytest.raises(ConfigError, match="share the folder 'lr=0.001'"):
        plan("toy", module, None, {}, {}, axes, tmp_path)
    long = "x" * 30 + "/tail-of-a-long-path.txt"
    name = cell_name({"data": long})
    assert name.startswith("data=_tail-of-a-long-path.txt-") and len(name) == len("data=") + 24 + 9


@pytest.mark.parametrize("recipe,args,named", [
    ("generate", ["grid.temperature=0.5,0.8"], "grid.temperature"),
    ("bench.step", ["seed=1,2"], "seed=1,2"),
    ("export", ["grid.format=hf,gguf"], "grid.format"),
])
def test_recipes_without_a_training_loop_refuse_grids_by_name(recipe, args, named, tmp_path, capsys):
    assert main([f"recipe={recipe}", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"recipe {recipe} has no training loop" in err and named in err


def test_a_bad_grid_value_stops_before_any_cell_runs(corpus, tmp_path, capsys):
    root = tmp_path / "grid"
    assert main(["recipe=standard", f"data={corpus}", f"out={root}", *SMALL, "grid.lr=1e-3,fast"]) == 2
    assert "bad value for 'lr'" in capsys.readouterr().err and not root.exists()
