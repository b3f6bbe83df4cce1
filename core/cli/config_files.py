"""Config files: a TOML file as the flat dotted-key dict ``core.config.resolve`` layers over the defaults.

Tables become dotted prefixes (``[model]`` + ``n_layers`` -> ``model.n_layers``), as in nanoGPT's
configurator keys; every failure to read or parse the file is a one-line ``ConfigError``.

Two tables are the file's own, not config keys:

- ``[vars]``: values substituted into the file's string values as ``${name}`` (top level, targets and
  ``[[stages]]`` alike); a var may use other vars; a value that is exactly ``"${name}"`` takes the var's
  own type (``steps = "${n}"`` with ``n = 300`` is the int 300); ``$${`` writes a literal ``${``. An
  unknown or cyclic var is a ConfigError naming it, and so is an expansion beyond ``MAX_EXPANSION``.
- ``[targets.NAME]``: named sets of keys (dotted or nested, like the top level) laid over the top level
  when ``target=NAME`` is chosen (on the command line, or as the file's own default ``target = "NAME"``;
  the command line's wins). An unknown target is a ConfigError listing the file's targets.

So a file resolves as: its top-level keys < the chosen target's keys (``core.cli.command`` then puts the preset
below both and the command line above them).
"""
from __future__ import annotations

import re
import tomllib
from typing import Any, Mapping, Optional

from purestep.core.config import ConfigError, flatten_keys, show_value

__all__ = ["load_toml", "substitute_vars", "FILE_ONLY"]

FILE_ONLY = ("vars", "targets", "target")        # the file's own tables and keys, never config keys
_NOT_IN_TARGET = ("vars", "targets", "target", "stages", "config")
_VAR = re.compile(r"\$\$\{|\$\{([^}]*)\}")
MAX_EXPANSION = 2**20      # the size one value may reach through [vars] (characters, list and table entries)


def _read(path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"bad config file {path}: {e}") from None


def load_toml(path, target: Optional[str] = None) -> dict[str, Any]:
    """A TOML config file as a flat dict of dotted keys (``[model]`` + ``n_layers`` -> ``model.n_layers``),
    its ``[vars]`` substituted and its target ``target`` (or the file's own ``target = ...``) laid over it."""
    data = _read(path)
    variables = data.pop("vars", {})
    targets = data.pop("targets", {})
    file_target = data.pop("target", None)
    if not isinstance(variables, dict):
        raise ConfigError(f"config file {path}: 'vars' must be a table ([vars])")
    if not isinstance(targets, dict) or not all(isinstance(t, dict) for t in targets.values()):
        raise ConfigError(f"config file {path}: 'targets' must hold tables ([targets.NAME])")
    data = substitute_vars(data, variables, f"config file {path}")
    flat = flatten_keys(data)
    name = target if target is not None else file_target
    if name is None:
        return flat
    if not isinstance(name, str) or name not in targets:
        listed = f"its targets: {', '.join(targets)}" if targets else "it has no [targets.NAME] tables"
        raise ConfigError(f"unknown target {name!r} in config file {path}; {listed}")
    chosen = flatten_keys(substitute_vars(targets[name], variables, f"config file {path}, target {name}"))
    bad = [k for k in chosen if k.partition(".")[0] in _NOT_IN_TARGET]
    if bad:
        raise ConfigError(f"config file {path}: target {name} sets {bad[0]!r}, which a target cannot set "
                          f"(targets hold config keys, recipe and preset)")
    for k, v in chosen.items():
        flat.pop(k, None)
        flat[k] = v
    return flat


def substitute_vars(data: Any, variables: Mapping[str, Any], where: str) -> Any:
    """``data`` (nested dicts, lists, values) with ``${name}`` in its strings replaced by ``variables``; a value
    that would expand beyond :data:`MAX_EXPANSION` (characters of text, list and table entries counted alike: a
    chain of vars doubling at each step) is a ConfigError before it is built."""
    resolved: dict[str, tuple[Any, int]] = {}          # var -> (its value, its size)

    def var(name: str, chain: tuple[str, ...]) -> tuple[Any, int]:
        if name in chain:
            cycle = " -> ".join((*chain[chain.index(name):], name))
            raise ConfigError(f"{where}: var {name!r} refers to itself ({cycle})")
        if name not in resolved:
            if name not in variables:
                known = f"[vars] has {', '.join(variables)}" if variables else "it has no [vars]"
                raise ConfigError(f"{where}: unknown var {name!r} (in ${{{name}}}); {known}")
            resolved[name] = walk(variables[name], (*chain, name))
        return resolved[name]

    def bounded(size: int, chain: tuple[str, ...]) -> int:
        if size > MAX_EXPANSION:
            inside = f" (expanding var {chain[-1]!r})" if chain else ""
            raise ConfigError(f"{where}: [vars] expand to more than {MAX_EXPANSION:,} characters{inside}; "
                              f"a var chain that repeats itself grows exponentially")
        return size

    def text(s: str, chain: tuple[str, ...]) -> tuple[Any, int]:
        whole = _VAR.fullmatch(s)
        if whole and whole.group(1) is not None:           # exactly "${x}": the var's own type
            return var(whole.group(1).strip(), chain)
        size = len(s)

        def one(m: re.Match) -> str:
            nonlocal size
            if m.group(1) is None:
                return "${"
            value, n = var(m.group(1).strip(), chain)
            size = bounded(size + n, chain)                 # before show_value builds a list's text
            return value if isinstance(value, str) else show_value(value)
        return _VAR.sub(one, s), size

    def walk(value: Any, chain: tuple[str, ...]) -> tuple[Any, int]:
        if isinstance(value, str):
            return text(value, chain)
        if isinstance(value, (dict, list)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            out, size = {}, 1
            for k, v in items:
                out[k], n = walk(v, chain)
                size = bounded(size + n, chain)
            return out if isinstance(value, dict) else list(out.values()), size
        return value, 1

    return walk(data, ())[0]
