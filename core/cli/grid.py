"""Seed lists and grids for any training recipe: ``seed=1,2,3`` and ``grid.KEY=A,B`` on ``purestep``.

``split_grid`` takes the grid's axes out of the command line's ``key=value`` pairs before the config is
resolved; ``run_grid`` then runs the cross product of the axes, one cell after another, each in its own run
folder under the run root (``out=``, else ``runs/<recipe>-<name>``), and writes the summary
(``core.cli.grid_summary``: ``grid.csv``, ``grid.md``, ``grid.png``) in the root.

The rule for a value's alternatives: an axis value is split on ``|`` when it contains one, else on ``,``. So
``grid.lr=1e-3,3e-3`` has two alternatives, and a list, tuple or dict key keeps the commas inside each of its
alternatives by separating them with ``|``: ``grid.betas=0.9,0.95|0.9,0.99`` (two pairs),
``grid.model.rope_scaling={"factor":2,"type":"linear"}|{"factor":4,"type":"linear"}``; one value with a
comma and no second alternative ends in ``|`` (``grid.betas=0.9,0.95|``). ``seed=1,2,3`` is the axis
``seed`` (a comma in ``seed`` always lists seeds). Each alternative is parsed against the key's type like any
``key=value``; every cell is resolved before the first one runs, so a bad value stops the grid at once.

A cell's folder is named by its values in the order the axes were given (``seed=1,lr=0.001``): each value
as the config holds it (``show_value``), with characters outside ``[A-Za-z0-9._+-]`` turned into ``_`` (and
one longer than 40 characters cut to its last 24 and a hash). ``grid.parallel=N`` runs N cells at once
(``core.cli.grid_parallel``); it is never an axis.

A cell whose folder holds a final checkpoint is finished and skipped; any other resumes (``resume=auto``) or
starts. A cell that stops without finishing (diverged, too many rollbacks: ``core.exits.RunStopped``) is marked
failed and the grid goes on with the next; a rerun skips it, saying so, and the grid ends with exit code 4 while
any cell is in that state. A cell that fails otherwise stops the grid after the summary of the cells so far is
written; rerunning the command carries on from there.

A recipe takes a grid when its module sets ``GRID = True``: it trains into ``out=`` and leaves
``<out>/final.msgpack`` and ``<out>/metrics.jsonl``. Any other recipe refuses ``grid.*`` and seed lists by
name.
"""
from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping, Sequence

from purestep.core.io.checkpoint import FINAL, stopped_run
from purestep.core.config import ConfigError, resolve, show_value
from purestep.core.exits import RunStopped
from purestep.core.io.logging import progress
from purestep.core.cli.runs import make_folder, run_folder

PREFIX = "grid."
PARALLEL = "grid.parallel"                      # cells at once (core.cli.grid_parallel); never an axis
RESERVED = ("out", "name", "resume")           # each cell has its own folder and resumes on its own
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")


@dataclass
class Cell:
    name: str                       # folder name under the run root
    values: dict[str, str]          # axis -> the value as given
    shown: dict[str, str]           # axis -> the value as the config holds it (show_value)
    folder: Path
    cfg: Any


def alternatives(key: str, value: str) -> list[str]:
    """The values of one axis: ``value`` split on ``|`` when it holds one, else on ``,``."""
    if value.count("|") == 1 and value.rstrip().endswith("|"):
        parts = [value.rstrip()[:-1]]               # "0.9,0.95|": one value that holds commas
    else:
        parts = value.split("|") if "|" in value else value.split(",")
    parts = [p.strip() for p in parts]
    if not parts or any(p == "" for p in parts):
        raise ConfigError(f"bad value for '{key}': {value!r} has an empty alternative; write "
                          f"{key}=A,B (or A|B when a value holds commas)")
    if len(set(parts)) != len(parts):
        raise ConfigError(f"bad value for '{key}': {value!r} lists a value twice")
    return parts


def _parallel(value: str) -> int:
    try:
        n = int(value.strip())
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"bad value for '{PARALLEL}': {value!r}; give the number of cells to run at once (>= 1)")
    return n


def split_grid(pairs: Mapping[str, str]) -> tuple[dict[str, str], dict[str, list[str]], int]:
    """``(pairs without the grid, {axis: alternatives}, cells at once)``, the axes in the order given:
    ``grid.KEY=...`` and a ``seed`` with a comma in it (a seed list); ``grid.parallel=N`` (default 1)."""
    rest: dict[str, str] = {}
    axes: dict[str, list[str]] = {}
    parallel = None
    for key, value in pairs.items():
        if key == PARALLEL:
            parallel = _parallel(value)
        elif key.startswith(PREFIX):
            axis = key[len(PREFIX):]
            if not axis:
                raise ConfigError(f"'{key}' names no key; write grid.KEY=A,B (e.g. grid.lr=1e-3,3e-3)")
            if axis in RESERVED:
                raise ConfigError(f"'{key}' cannot be a grid axis: each cell runs in its own folder under the run "
                                  f"root (out=, else name=) and resumes on its own")
            if axis == "seed":
                raise ConfigError(f"'{key}': write the seeds as seed=1,2,3")
            if axis in pairs:
                raise ConfigError(f"'{key}' and '{axis}' both given; keep one")
            axes[axis] = alternatives(key, value)
        elif key == "seed" and ("," in value or "|" in value):
            axes["seed"] = alternatives("seed", value)
        else:
            rest[key] = value
    if parallel is not None and not axes:
        raise ConfigError(f"{PARALLEL}={parallel} without a grid; give its axes (grid.KEY=A,B or seed=1,2)")
    return rest, axes, parallel or 1


def check_recipe(name: str, module: ModuleType, axes: Mapping[str, list[str]], stages) -> None:
    """A ConfigError unless recipe ``name`` can run a grid (``GRID = True``), naming the grid keys given."""
    keys = ", ".join("seed=" + ",".join(v) if a == "seed" else f"{PREFIX}{a}" for a, v in axes.items())
    if not getattr(module, "GRID", False):
        raise ConfigError(f"recipe {name} has no training loop to repeat, so it takes no grid ({keys}); grids "
                          f"and seed lists are for training recipes such as standard and distill")
    if stages is not None:
        raise ConfigError(f"{keys}: a grid does not combine with [[stages]] in the config file; run the stages "
                          f"of one cell per command (out=...)")


def _held(cfg, key: str):
    """The value at dotted ``key`` in ``cfg`` (sections and dict entries), or None."""
    value = cfg
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
    return value


def _safe(value: str) -> str:
    """``value`` as part of a folder name: unsafe characters as ``_``; over 40 characters, its last 24 and
    8 hex digits of its SHA-1 (a long path stays recognisable by its end, and distinct)."""
    safe = _UNSAFE.sub("_", value)
    return safe if len(safe) <= 40 else f"{safe[-24:]}-{hashlib.sha1(value.encode()).hexdigest()[:8]}"


def cell_name(shown: Mapping[str, str]) -> str:
    return ",".join(f"{k}={_safe(v)}" for k, v in shown.items())


def plan(name: str, module: ModuleType, preset, toml: dict, pairs: dict, axes: Mapping[str, list[str]],
         root: Path) -> list[Cell]:
    """Every cell of the cross product, resolved (a bad value stops here, before anything runs)."""
    cells, seen = [], {}
    for combo in itertools.product(*axes.values()):
        values = dict(zip(axes, combo))
        label = ",".join(f"{k}={v}" for k, v in values.items())
        cfg = resolve(module.Config, presets=getattr(module, "PRESETS", None), preset=preset, toml=toml,
                      overrides={**pairs, **values}, context=f"recipe {name}, grid cell {label}")
        shown = {k: show_value(_held(cfg, k)) if _held(cfg, k) is not None else v for k, v in values.items()}
        folder_name = cell_name(shown)
        if folder_name in seen:
            raise ConfigError(f"grid cells {seen[folder_name]} and {label} would share the folder "
                              f"{folder_name!r}; give values that differ after parsing")
        seen[folder_name] = label
        folder = root / folder_name
        cfg = resolve(module.Config, presets=getattr(module, "PRESETS", None), preset=preset, toml=toml,
                      overrides={**pairs, **values, "out": str(folder)}, context=f"recipe {name}, grid cell {label}")
        cells.append(Cell(folder_name, values, shown, folder, cfg))
    return cells


def run_grid(name: str, module: ModuleType, preset, toml: dict, pairs: dict, axes: Mapping[str, list[str]],
             base, parallel: int = 1, argv: Sequence[str] = ()) -> int:
    """Run every cell of the grid (finished ones skipped): one after another in this process, or with
    ``parallel`` > 1 that many at once as ``purestep`` subprocesses given ``argv`` (this command's arguments)
    for the cell; then write the summary in the run root."""
    from purestep.core.cli.grid_parallel import run_parallel
    from purestep.core.cli.grid_summary import write_summary
    root = run_folder(getattr(base, "out", ""), getattr(base, "name", ""), name)
    cells = plan(name, module, preset, toml, pairs, axes, root)
    make_folder(root)
    todo, stopped = [], []
    for i, cell in enumerate(cells, 1):
        if (before := stopped_run(cell.folder)) is not None:   # newer than any final.msgpack: see CheckpointManager
            progress(f"grid cell {i}/{len(cells)}: {cell.name} failed: {before}; skipped")
            stopped.append(cell.name)
        elif (cell.folder / FINAL).exists():
            progress(f"grid cell {i}/{len(cells)}: {cell.name} is finished ({cell.folder / FINAL}); skipped")
        else:
            todo.append((i, cell))
    try:
        if parallel > 1:
            stopped += run_parallel(todo, len(cells), list(axes), argv, parallel)
        else:
            for i, cell in todo:
                progress(f"grid cell {i}/{len(cells)}: {cell.name} -> {cell.folder}")
                try:
                    module.run(cell.cfg)
                except RunStopped as e:            # this cell failed; the grid goes on
                    progress(f"grid cell {i}/{len(cells)}: {cell.name} failed: stopped without finishing: {e}")
                    stopped.append(cell.name)
    finally:
        written = write_summary(root, cells, list(axes))
        progress(f"grid summary: {', '.join(str(p) for p in written)}")
    if stopped:
        raise RunStopped(f"{len(stopped)} of {len(cells)} grid cells stopped without finishing ({', '.join(stopped)}); "
                         f"the summary marks them failed; to run one again, delete its folder (or grid other values)")
    return 0
