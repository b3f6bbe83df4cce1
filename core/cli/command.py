"""The ``purestep`` program: ``purestep recipe=NAME [config=FILE.toml] [preset=NAME] [key=value ...]``.

nanoGPT's ``python train.py config/x.py --key=value``, made strict (see ``core.config``): the recipe's
config dataclass is built from its defaults < preset < config file < the file's ``target=NAME`` table <
``key=value`` arguments (a ``[[stages]]`` table's keys sit above the file and its target, below the command
line), and an unknown key or a badly typed value stops the run before anything starts. A config file's
``[vars]`` and ``[targets.NAME]`` are ``core.cli.config_files``'. ``dry_run=true`` prints the recipe's plan
(``module.dry_run(cfg) -> str``, optional; refused by name for a recipe without one) instead of running.

The caller passes the registry of recipe names (``recipes.RECIPES``: name -> module path; ``core`` names no
recipe itself). A recipe is resolved as (``load_recipe``): a registered name first (``standard``,
``bench.step``, ...), then a dotted importable module path (your own recipe, e.g. ``mylab.my_recipe``).
A recipe module (imported only when chosen) exposes:

- ``Config``: the config dataclass (fields declared with ``core.config.option`` for help and choices);
- ``PRESETS``: optional ``dict[str, dict]`` of named settings (nested or dotted keys);
- ``DESCRIPTION``: one line for ``purestep --help``;
- ``run(cfg)``: the loop;
- ``GRID``: optional, True when the recipe trains into ``out=`` and leaves ``final.msgpack`` there, so
  ``seed=1,2`` and ``grid.KEY=A,B`` may repeat it per cell (``core.cli.grid``).

Exit codes (their table is ``core.exits.CODES``, which docs/configuration.md shows): 0 done; 2 a user error
(``core.config.UserError`` and its subclasses, among them ``core.data.tokenizers.DataError`` and
``core.io.checkpoint.CheckpointError``, ``FileNotFoundError``, and the OS errors of a path that cannot be written,
``PATH_ERRORS``: no permission, no space, a read-only disk, a file in the way), reported as one ``error:`` line on
stderr (naming the path and what to do); 3 a quality gate failed (``core.exits.GateFailed``: the run finished and
wrote its report, but its results miss a threshold the user set, e.g. upcycle's ``verify.max_ppl_ratio``), one
``gate failed:`` line; 4 a run that stopped without finishing (``core.exits.RunStopped``: diverged, too many
rollbacks; or a rerun on its folder), one ``stopped:`` line; 5 incomplete (``core.exits.Incomplete``: the run
trained and kept its model, but an item after training failed, e.g. a benchmark measurement; the rest ran and the
reports are written), one ``incomplete:`` line; 130 interrupted; 1 anything else, which is a bug and
prints its traceback. ``purestep`` is a thin click wrapper around ``main``, which tests also call in-process.

A key given twice on ``purestep``'s command line is an error naming it (``repeats=False``: what a person typed
twice is a mistake, and a silent "the last wins" hides it); a value is taken as typed, so a full-width digit is
not a number (``core.config``). Code that composes arguments (a base list plus overrides: tests, benchmarks, the
GPU command's jobs) calls ``main`` in-process, where a later key wins, or builds a child's command line with
``merge_args``, which lays later keys over earlier ones.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import errno
import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Mapping, Sequence

import click

from purestep.core import exits
from purestep.core.io.checkpoint import FINAL
from purestep.core.config import ConfigError, UserError, flatten_keys, resolve
from purestep.core.exits import GateFailed, Incomplete, RunStopped
from purestep.core.cli.config_files import load_toml
from purestep.core.cli.config_help import format_help
from purestep.core.cli.grid import check_recipe, run_grid, split_grid
from purestep.core.cli.runs import check_name, run_folder

PROG = "purestep"
RESERVED = ("recipe", "config", "preset", "target", "dry_run")   # arguments of purestep itself, not recipe keys
SYNOPSIS = f"{PROG} recipe=NAME [config=FILE.toml [target=NAME]] [preset=NAME] [dry_run=true] [key=value ...]"
USAGE = f"usage: {SYNOPSIS}\n       {PROG} [recipe=NAME] --help"


# OS errors on a path the user chose (the run folder above all): one line with the path and what to do
PATH_ERRORS = {
    errno.EACCES: "choose a path you may write to (another out=) or change its permissions",
    errno.EPERM: "choose a path you may write to (another out=) or change its permissions",
    errno.EROFS: "choose a path on a writable filesystem (another out=)",
    errno.ENOSPC: "free space, or choose another out= (or $PURESTEP_CACHE) on a disk with room",
    errno.EDQUOT: "free space within your quota, or choose another out= (or $PURESTEP_CACHE)",
    errno.ENOTDIR: "a part of the path is a file, not a folder; choose another out=",
    errno.EISDIR: "a folder stands where a file should go; choose another out= or move that folder",
    errno.ENAMETOOLONG: "choose a shorter out= (or name=)",
}


def is_user_error(e: BaseException) -> bool:
    """True for errors the user fixes (bad config, missing file, bad data, a run folder that cannot be
    written: no permission, no space, a read-only disk, a file in the way): no traceback for these."""
    return isinstance(e, (UserError, FileNotFoundError)) or isinstance(e, OSError) and e.errno in PATH_ERRORS


def user_message(e: BaseException) -> str:
    """The one line that tells the user what went wrong (and, for an OS error, with which path and what to do:
    ``path: reason; hint``, not Python's ``[Errno N] ...``)."""
    if isinstance(e, OSError) and not isinstance(e, UserError) and e.errno is not None:
        reason = (e.strerror or os.strerror(e.errno)).lower()
        where = f"{e.filename}: " if e.filename is not None else ""
        hint = f"; {PATH_ERRORS[e.errno]}" if e.errno in PATH_ERRORS else ""
        return f"{where}{reason}{hint}"
    return " ".join(str(e).split()) or type(e).__name__


def merge_args(*args: str) -> list[str]:
    """``key=value`` arguments with each key once, the later of two kept (where it stands, as ``main`` lays it
    over the earlier): a command line composed from a base and overrides, as ``purestep`` (which refuses a
    repeated key) takes it."""
    merged: dict[str, str] = {}
    for arg in args:
        key = arg.partition("=")[0].strip() if "=" in arg and not arg.startswith("-") else arg
        merged.pop(key, None)
        merged[key] = arg
    return list(merged.values())


def parse_args(argv: Sequence[str], repeats: bool = True) -> tuple[dict[str, str], bool]:
    """``key=value`` tokens as a dict and whether ``--help``/``-h`` was given; a repeated key is laid over the
    earlier one (``repeats``) or is a UserError naming it (``purestep``'s command line)."""
    pairs: dict[str, str] = {}
    want_help = False
    for token in argv:
        if token in ("--help", "-h"):
            want_help = True
        elif token.startswith("-"):
            raise UserError(f"unexpected option {token!r}; arguments are key=value without dashes "
                            f"(see {PROG} --help)")
        elif "=" not in token:
            raise UserError(f"argument {token!r} is not key=value")
        else:
            key, _, value = token.partition("=")
            if not key.strip():
                raise UserError(f"argument {token!r} has an empty key")
            if not repeats and key.strip() in pairs:
                raise UserError(f"key {key.strip()!r} is given twice ({key.strip()}={pairs[key.strip()]} and "
                                f"{token}); give it once")
            pairs.pop(key.strip(), None)
            pairs[key.strip()] = value
    return pairs, want_help


def load_recipe(name: str, recipes: Mapping[str, str]) -> ModuleType:
    """The recipe registered as ``name``, or the module at dotted path ``name`` (your own recipe).

    An unknown name, a missing module or a module without ``Config`` and ``run`` is a UserError.
    """
    if name not in recipes and "." not in name:
        close = difflib.get_close_matches(name, list(recipes), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ";"
        raise UserError(f"unknown recipe {name!r}{hint} recipes: {', '.join(recipes)} "
                        "(or a module path such as mylab.my_recipe)")
    path = recipes.get(name, name)
    if name not in recipes:
        _check_defines_recipe(path)             # before importing: no stranger's module runs
    try:
        module = importlib.import_module(path)
    except ModuleNotFoundError as e:
        if e.name is not None and (path == e.name or path.startswith(e.name + ".")):
            raise UserError(f"recipe {name!r} is not available: no module {path}") from None
        raise                                       # a missing import inside the recipe is a bug
    missing = [a for a in ("Config", "run") if not hasattr(module, a)]
    if missing:
        raise UserError(f"module {path} is not a recipe: it has no {' or '.join(missing)}")
    return module


def _find_spec(path: str):
    """The module spec of dotted ``path``, found without importing anything (``importlib.util.find_spec``
    imports the parent packages), or None."""
    spec, search = None, None
    parts = path.split(".")
    for i in range(len(parts)):
        name = ".".join(parts[:i + 1])
        if name in sys.modules:
            spec = sys.modules[name].__spec__
        else:
            finders = (getattr(f, "find_spec", None) for f in sys.meta_path)
            spec = next((s for s in (find(name, search) for find in finders if find) if s), None)
        if spec is None:
            return None
        search = spec.submodule_search_locations
        if search is None and i < len(parts) - 1:
            return None
    return spec


def _check_defines_recipe(path: str) -> None:
    """A UserError unless module ``path`` exists and its source defines ``Config`` and ``run`` at top level."""
    if not all(part.isidentifier() for part in path.split(".")):
        raise UserError(f"recipe {path!r} is neither a registered recipe nor a module path")
    spec = _find_spec(path)
    if spec is None:
        raise UserError(f"recipe {path!r} is not available: no module {path}")
    origin = Path(spec.origin or "")
    if origin.suffix != ".py" or not origin.is_file():
        raise UserError(f"module {path} is not a recipe: no Python source to check for Config and run")
    try:
        tree = ast.parse(origin.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"module {path} ({origin}) cannot be read as Python source: {e}") from None
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(t.id for t in targets if isinstance(t, ast.Name))
    missing = [a for a in ("Config", "run") if a not in defined]
    if missing:
        raise UserError(f"module {path} is not a recipe: it defines no {' or '.join(missing)} (not imported)")


def _describe_recipe(name: str, recipes: Mapping[str, str]) -> str:
    """One line for the recipe list; never raises (help must work while a recipe is broken)."""
    try:
        if importlib.util.find_spec(recipes[name]) is None:
            return f"(not available yet: no module {recipes[name]})"
        return getattr(load_recipe(name, recipes), "DESCRIPTION", "")
    except UserError as e:
        return f"({e})"
    except Exception as e:  # noqa: BLE001 - shown, not hidden: the run itself will raise it
        return f"(fails to import: {type(e).__name__}: {e})"


def top_help(recipes: Mapping[str, str]) -> str:
    width = max(len(n) for n in recipes)
    listing = "\n".join(f"  {n.ljust(width)}  {_describe_recipe(n, recipes)}" for n in recipes)
    return (f"{USAGE}\n\n"
            "Train and run language models with purestep. A recipe's settings come from its defaults,\n"
            "then preset=NAME, then the config=FILE.toml file (which may set recipe and preset too), then\n"
            "its [targets.NAME] chosen by target=NAME, then key=value arguments; nested settings use dotted\n"
            "keys (model.n_layers=4). dry_run=true prints the plan (sizes, step time, wall time, cost) only.\n\n"
            f"recipes:\n{listing}\n\n"
            f"'{PROG} recipe=NAME --help' lists a recipe's keys, types, defaults and presets.")


def recipe_help(name: str, module: ModuleType, cfg=None, sources: str = "") -> str:
    """Usage, description, keys and presets of a recipe; with ``cfg``, its values instead of defaults."""
    head = (f"usage: {PROG} recipe={name} [config=FILE.toml [target=NAME]] [preset=NAME] [key=value ...]"
            + ("\n       (dry_run=true: print the plan instead of running)" if hasattr(module, "dry_run") else ""))
    description = getattr(module, "DESCRIPTION", "")
    table = format_help(cfg if cfg is not None else module.Config, getattr(module, "PRESETS", None))
    if cfg is not None:
        table += f"\n\n(values after {sources})"
    return "\n\n".join(part for part in (head, description, table) if part)


def _run(argv: Sequence[str], recipes: Mapping[str, str], repeats: bool = True) -> int:
    pairs, want_help = parse_args(argv, repeats)
    toml = _config_file(pairs)
    dry_run = _dry_run_flag(pairs, toml)
    stages = toml.pop("stages", None)
    file_recipe = toml.pop("recipe", None)
    name = pairs.pop("recipe", None) or file_recipe
    if name is None:
        if want_help:
            click.echo(top_help(recipes))
            return 0
        raise UserError(f"no recipe given; usage: {SYNOPSIS} (recipes: {', '.join(recipes)})")
    if not isinstance(name, str):
        raise ConfigError(f"bad value for 'recipe': {name!r} is not a str")
    module = load_recipe(name, recipes)
    preset = pairs.pop("preset", None)
    pairs, axes, parallel = split_grid(pairs)       # seed=1,2 and grid.KEY=A,B: core.cli.grid
    if axes:
        check_recipe(name, module, axes, stages)
    cfg = resolve(module.Config, presets=getattr(module, "PRESETS", None), preset=preset, toml=toml,
                  overrides=pairs, context=f"recipe {name}")
    if want_help:
        given = [s for s, on in (("preset", preset or "preset" in toml), ("config file", toml),
                                 ("key=value arguments", pairs)) if on]
        click.echo(recipe_help(name, module, cfg if given else None, ", ".join(given)))
        return 0
    if dry_run:
        if axes:
            raise UserError("dry_run=true with seed lists or grid.* keys is not supported; dry-run one cell by "
                            "giving its values (e.g. seed=1 lr=0.001)")
        return _dry_run(name, module, cfg, stages)
    if stages is not None:
        return _run_stages(name, module, preset, toml, pairs, stages, cfg)
    if axes:
        return run_grid(name, module, preset, toml, pairs, axes, cfg, parallel, argv)
    module.run(cfg)
    return exits.DONE


def _config_file(pairs: dict) -> dict:
    """The ``config=`` file's keys (``[vars]`` substituted, the ``target=`` chosen: ``core.cli.config_files``),
    both arguments taken out of ``pairs``; ``{}`` without a file."""
    target = pairs.pop("target", None)
    if "config" not in pairs:
        if target is not None:
            raise UserError(f"target={target} needs a config=FILE.toml that defines [targets.{target}]")
        return {}
    return load_toml(pairs.pop("config"), target=target)


def _dry_run_flag(pairs: dict, toml: dict) -> bool:
    """``dry_run=true|false`` taken out of ``pairs`` (a command-line argument only: a file sets what to run,
    not whether to run it)."""
    if "dry_run" in toml:
        raise ConfigError("'dry_run' is a command-line argument (dry_run=true), not a config-file key")
    value = pairs.pop("dry_run", "false").strip().lower()
    if value not in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        raise ConfigError(f"bad value for 'dry_run': {value!r} is not a bool (true/false)")
    return value in ("true", "1", "yes", "on")


def _dry_run(name: str, module: ModuleType, cfg, stages) -> int:
    """Print the recipe's plan for ``cfg`` (``module.dry_run(cfg) -> str``) to stdout; nothing is run."""
    if not hasattr(module, "dry_run"):
        raise UserError(f"recipe {name} cannot do dry_run=true (it has no plan; recipes that can: those "
                        "defining dry_run(cfg), e.g. standard and distill)")
    if stages is not None:
        raise UserError("dry_run=true with [[stages]] is not supported; dry-run one stage by giving its keys "
                        "on the command line")
    click.echo(module.dry_run(cfg))
    return 0


def _run_stages(name: str, module: ModuleType, preset, toml: dict, pairs: dict, stages, base) -> int:
    """Run the config file's ``[[stages]]`` in order, each in ``<run folder>/<i>-<stage name>``.

    A stage's keys sit between the file's (its target's included) and the command line's (defaults <
    preset < file < target < stage < key=value). Unless a stage sets ``init`` itself, it starts from the
    previous stage's final weights. Each stage resumes on its own: rerunning the command skips finished
    stages and continues the rest.
    """
    if not isinstance(stages, list) or not stages or not all(isinstance(s, dict) for s in stages):
        raise ConfigError("'stages' must be a list of tables ([[stages]] in the config file)")
    root = run_folder(getattr(base, "out", ""), getattr(base, "name", ""), name)
    takes_init = "init" in {f.name for f in dataclasses.fields(module.Config)}
    previous = None
    for i, stage in enumerate(stages, 1):
        stage = flatten_keys(stage)
        label = check_name("stages.name", str(stage.pop("name", f"stage{i}")))
        folder = root / f"{i}-{label}"
        extra = {"out": str(folder)}
        if takes_init and previous is not None and "init" not in stage and "init" not in pairs:
            extra["init"] = str(previous)
        cfg = resolve(module.Config, presets=getattr(module, "PRESETS", None), preset=preset,
                      toml={**toml, **stage}, overrides={**pairs, **extra}, context=f"recipe {name}, stage {label}")
        click.echo(f"stage {i}/{len(stages)}: {label} -> {folder}", err=True)
        module.run(cfg)
        previous = folder / FINAL
    return 0


def main(argv: Sequence[str], recipes: Mapping[str, str], repeats: bool = True) -> int:
    """Run ``purestep`` with the given arguments and recipe registry; returns the exit code (``core.exits.CODES``).
    ``repeats=False`` (``purestep``'s own command line) refuses a key given twice."""
    try:
        return _run(list(argv), recipes, repeats)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return exits.INTERRUPTED
    except GateFailed as e:
        click.echo(f"gate failed: {user_message(e)}", err=True)
        return exits.GATE
    except RunStopped as e:
        click.echo(f"stopped: {user_message(e)}", err=True)
        return exits.STOPPED
    except Incomplete as e:
        click.echo(f"incomplete: {user_message(e)}", err=True)
        return exits.INCOMPLETE
    except Exception as e:  # noqa: BLE001 - sorted into user errors and bugs right here
        if not is_user_error(e):
            traceback.print_exc()
            return exits.BUG
        click.echo(f"error: {user_message(e)}", err=True)
        return exits.BAD_INPUT
