"""Strict dataclass configs with ``key=value`` overrides: nanoGPT's configurator, made strict.

nanoGPT's "Poor Man's Configurator" reads ``--key=value``, ``literal_eval``s the value with a string
fallback, asserts the new type equals the old one and raises on an unknown key. Here the same idea runs
against dataclass annotations instead of globals:

- A config is a (possibly nested) dataclass. ``option(default, help, choices, min=, max=, above=, below=)``
  declares a field with its one-line help, allowed values and valid range (``min=1``; ``min=0, below=1``
  is [0, 1)); nested dataclasses are addressed with dotted keys
  (``model.n_layers=4``) and a dict field's entries too (``model.rope_scaling.factor=8``).
- A string value is parsed against the field's annotated type (int, float, bool, str, ``X | None``,
  tuples and lists from ``a,b,c``, dicts from JSON or a TOML inline table, ``Literal[...]``); a value
  that is already typed (from TOML) is checked the same way: an int is a float, a bool is not an int.
- A number outside its declared range is refused when the config is resolved, before anything runs; so is
  any float that is not finite (``inf``, ``nan``, or ``1e309``, which overflows to inf), in any key, list or
  dict entry: no key gives infinity a meaning (a key that means "no limit" says which finite value does, e.g. 0).
- Every mistake is a ``ConfigError``: one line that names the key and what is wrong with it, with close
  matches for a misspelt key (difflib) and the valid choices.
- ``resolve`` layers the sources: defaults < preset < config file (with its target) < command line.

Reading a TOML config file is ``core.cli.config_files``; the ``--help`` text and the key tables of
docs/configuration.md are ``core.cli.config_help``.

``UserError`` lives here too: the class of errors that are the user's to fix (bad config, missing file,
bad data). ``purestep`` prints them as one ``error:`` line and exits 2; anything else is a bug and keeps
its traceback.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import tomllib
import types
import typing
from typing import Any, Literal, Mapping, Union

from purestep.core.config_bounds import Bounds, not_finite
from purestep.core.exits import EXIT_GATE, EXIT_INCOMPLETE, GateFailed, Incomplete   # their home is core.exits (the exit-code
#                                                                              table); kept importable here

__all__ = ["UserError", "GateFailed", "EXIT_GATE", "Incomplete", "EXIT_INCOMPLETE", "ConfigError", "option", "Bounds", "same_as", "apply_overrides", "resolve", "flatten_keys",
           "to_dict", "from_dict", "type_str", "show_value"]


class UserError(Exception):
    """An error in what the user asked for (not a bug): reported as one line, exit code 2."""


class ConfigError(UserError, ValueError):
    """A bad config key or value; the message is one line naming the key."""


class _BadValue(Exception):
    """Internal: why a value does not fit a type (the text after ``bad value for 'key': ``)."""


def option(default: Any = dataclasses.MISSING, help: str = "", choices: tuple | None = None, *,
           min: float | None = None, max: float | None = None, above: float | None = None,
           below: float | None = None):
    """A dataclass field with a one-line ``help``, optional allowed ``choices`` and a valid range.

    The range of a number (of each number of a tuple or list): ``min``/``max`` are closed bounds
    (``min=1``: at least 1), ``above``/``below`` open ones (``above=0``: more than 0; ``min=0, below=1``:
    [0, 1)). A value outside it is a ConfigError when the config is resolved; ``None`` is always allowed
    for an optional field. ``--help`` and docs/configuration.md's key table show the range next to the type.

    Mutable defaults are turned into a ``default_factory``: a dataclass *class* is its own factory
    (``option(LlamaConfig, "model shape")``, which lets ``__post_init__`` see the overridden values), a
    dataclass instance, list, dict or set is deep-copied for every new config.
    """
    bounds = Bounds.of(min=min, max=max, above=above, below=below)
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None, "range": bounds}
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata=metadata)
    if dataclasses.is_dataclass(default) or isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    if choices is not None and default not in (dataclasses.MISSING, None) and default not in metadata["choices"]:
        raise ValueError(f"default {default!r} is not one of the choices {choices!r}")
    if bounds is not None and default is not dataclasses.MISSING and bounds.violation(default) is not None:
        raise ValueError(f"default {default!r} is not {bounds}")
    return dataclasses.field(default=default, metadata=metadata)


def same_as(cls, name: str):
    """The option ``name`` of config class ``cls`` again (same default, help, choices and range), for a config
    that takes some of another's keys without inheriting all of them: defaults stay in one place."""
    f = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if f is None:
        raise AttributeError(f"{cls.__name__} has no option {name!r}")
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    bounds = f.metadata.get("range")
    return option(default, f.metadata.get("help", ""), f.metadata.get("choices"),
                  **(bounds.keywords() if bounds is not None else {}))


# ----------------------------------------------------------------------------------------------------------
# the fields of a config class

@functools.lru_cache(maxsize=None)
def _fields(cls) -> tuple[tuple[dataclasses.Field, Any], ...]:
    """``(field, resolved type)`` for each init field (string annotations resolved)."""
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls) if f.init)


def _is_section(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_dict(tp) -> bool:
    return tp is dict or typing.get_origin(tp) is dict


def _default(f: dataclasses.Field):
    """A field's default; a nested dataclass built by its class factory is returned as the class."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            return f.default_factory
        return f.default_factory()
    return dataclasses.MISSING


def _leaf_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for f, tp in _fields(cls):
        keys += _leaf_keys(tp, f"{prefix}{f.name}.") if _is_section(tp) else [prefix + f.name]
    return keys


# ----------------------------------------------------------------------------------------------------------
# parsing and checking one value

_TRUE, _FALSE, _NONE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}, {"none", "null"}


def type_str(tp) -> str:
    """A short readable name for an annotation: ``int``, ``float | None``, ``tuple[int, ...]``, ``a|b``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "None"
    if tp is Any:
        return "any"
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_str(a) for a in args)
    if origin is not None and args:
        inner = ", ".join("..." if a is Ellipsis else type_str(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    return getattr(tp, "__name__", str(tp))


def show_value(v) -> str:
    """A value written the way it is typed on the command line (``true``, ``none``, ``1,2,3``)."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (tuple, list)):
        return ",".join(show_value(x) for x in v) if v else ("()" if isinstance(v, tuple) else "[]")
    if isinstance(v, dict):
        return json.dumps(v, separators=(",", ":"), default=str)
    if isinstance(v, str):
        return v if v and v.strip() == v else repr(v)
    return str(v)


def _literal(s: str):
    """A TOML literal (``8``, ``1e-3``, ``true``, ``"x"``, ``[1, 2]``) or, failing that, the string."""
    try:
        return tomllib.loads(f"v = {s}")["v"]
    except tomllib.TOMLDecodeError:
        return s


def _convert(tp, v):
    """``v`` (a command-line string or an already typed value) as a value of type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return _literal(v) if isinstance(v, str) else v
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) < len(args) and (v is None or isinstance(v, str) and v.strip().lower() in _NONE):
            return None
        for a in options:
            try:
                return _convert(a, v)
            except _BadValue:
                if len(options) == 1:
                    raise
        raise _BadValue(f"{v!r} is not {type_str(tp)}")
    if origin is Literal:
        for a in args:
            if (isinstance(v, str) and v == show_value(a)) or (type(v) is type(a) and v == a):
                return a
        raise _BadValue(f"{v!r}; choose one of {', '.join(show_value(a) for a in args)}")
    if tp is bool:
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
            return v.strip().lower() in _TRUE
        raise _BadValue(f"{v!r} is not a bool (true/false)")
    if tp is int or tp is float:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and (tp is float or isinstance(v, int)):
            return tp(v)
        if isinstance(v, str) and v.strip().isascii():   # Python's int() also reads other scripts' digits ("５")
            try:
                return tp(v.strip())
            except ValueError:
                pass
        raise _BadValue(f"{v!r} is not {'an int' if tp is int else 'a float'}")
    if tp is str:
        if isinstance(v, str):
            return v
        raise _BadValue(f"{v!r} is not a str")
    if tp in (tuple, list) or origin in (tuple, list):
        return _convert_sequence(origin or tp, args, v)
    if _is_dict(tp):
        return _convert_dict(args, v)
    raise TypeError(f"config fields of type {type_str(tp)} are not supported")


def _convert_sequence(kind, args, v):
    if isinstance(v, str):
        s = v.strip()
        if s[:1] + s[-1:] in ("[]", "()"):
            s = s[1:-1].strip()
        items = [x.strip() for x in s.split(",")] if s else []
        if items and items[-1] == "":          # a trailing comma, as in "4,"
            items.pop()
    elif isinstance(v, (list, tuple)):
        items = list(v)
    else:
        raise _BadValue(f"{v!r} is not a {kind.__name__} (write a,b,c)")
    if kind is list or (len(args) == 2 and args[1] is Ellipsis):    # list[X], tuple[X, ...]
        item_types = [args[0] if args else Any] * len(items)
    elif args:
        if len(items) != len(args):
            raise _BadValue(f"{v!r} has {len(items)} items, expected {len(args)}")
        item_types = list(args)
    else:
        item_types = [Any] * len(items)
    return kind(_convert(t, x) for t, x in zip(item_types, items))


def _convert_dict(args, v):
    if isinstance(v, str):
        s = v.strip() or "{}"
        try:
            v = json.loads(s)
        except json.JSONDecodeError:
            v = _literal(s)
    if not isinstance(v, dict):
        raise _BadValue(f"{v!r} is not a dict (write JSON or a TOML inline table, e.g. {{factor = 8.0}})")
    if not args:
        return dict(v)
    key_type, value_type = args
    return {_convert(key_type, k): _convert(value_type, x) for k, x in v.items()}


def _check(key: str, tp, value, metadata: Mapping):
    """``value`` converted to ``tp`` and checked against the field's ``choices`` and range, or a
    ConfigError naming ``key``."""
    choices, bounds = metadata.get("choices"), metadata.get("range")
    try:
        out = _convert(tp, value)
        if choices is not None and out not in choices:
            raise _BadValue(f"{value!r}; choose one of {', '.join(show_value(c) for c in choices)}")
    except _BadValue as e:
        raise ConfigError(f"bad value for '{key}': {e}") from None
    _check_finite(key, value, out, bounds)
    bad = bounds.violation(out) if bounds is not None and out is not None else None
    if bad is not None:
        what = (f"{show_value(bad)} in {key}={show_value(out)} is out of range; each item must be"
                if isinstance(out, (tuple, list)) else f"{key}={show_value(out)} is out of range; it must be")
        raise ConfigError(f"bad value for '{key}': {what} {bounds}")
    return out


def _check_finite(key: str, given, value, bounds: Bounds | None = None) -> None:
    """A ConfigError naming ``key`` when ``value`` (parsed from ``given``) holds inf or NaN (``not_finite``)."""
    what = not_finite(key, given.strip() if isinstance(given, str) else show_value(given), value)
    if what is not None:
        raise ConfigError(f"bad value for '{key}': {what}; give a finite number" + (f" {bounds}" if bounds else ""))


# ----------------------------------------------------------------------------------------------------------
# applying overrides

def _unknown_key(key: str, root, context: str) -> ConfigError:
    """The message for an unknown key: close matches, then the valid keys of the nearest section."""
    keys = _leaf_keys(root)
    by_last: dict[str, list[str]] = {}              # match on the last part: 'lrr' -> 'optim.lr'
    for k in keys:
        by_last.setdefault(k.rpartition(".")[2], []).append(k)
    guesses = [k for k in keys if k.endswith("." + key)]
    for m in difflib.get_close_matches(key.rpartition(".")[2], list(by_last), n=3, cutoff=0.6):
        guesses += sorted(by_last[m], key=lambda k: -difflib.SequenceMatcher(None, key, k).ratio())
    guesses = list(dict.fromkeys(guesses))
    section, cls = "", root
    for part in key.split(".")[:-1]:                # descend into the sections the key names correctly
        tp = dict((f.name, t) for f, t in _fields(cls)).get(part)
        if not _is_section(tp):
            break
        section, cls = f"{section}{part}.", tp
    valid = [f"{section}{f.name}.*" if _is_section(tp) else section + f.name for f, tp in _fields(cls)]
    hint = f"; did you mean {' or '.join(repr(g) for g in guesses[:3])}?" if guesses else ";"
    return ConfigError(f"unknown key '{key}' for {context}{hint} valid keys: {', '.join(valid)}")


def _apply(target, values: Mapping[str, Any], prefix: str, root, context: str):
    """Build ``target`` (a dataclass class, or an instance to ``replace``) with dotted-key ``values``."""
    cls = target if isinstance(target, type) else type(target)
    fields = {f.name: (f, tp) for f, tp in _fields(cls)}
    changes: dict[str, Any] = {}
    sections: dict[str, dict] = {}
    for key, value in values.items():
        name, _, rest = key.partition(".")
        if name not in fields:
            raise _unknown_key(prefix + key, root, context)
        f, tp = fields[name]
        if _is_section(tp):
            if not rest:
                raise ConfigError(f"'{prefix}{name}' is a section, not a value; set its keys, "
                                  f"e.g. {prefix}{name}.{_fields(tp)[0][0].name}=...")
            sections.setdefault(name, {})[rest] = value
        elif not rest:
            changes[name] = _check(prefix + name, tp, value, f.metadata)
        elif _is_dict(tp):                          # one entry of a dict field: merge it in
            current = changes[name] if name in changes else (
                _default(f) if isinstance(target, type) else getattr(target, name))
            changes[name] = _set_entry(current, rest.split("."), value, prefix + key)
        else:
            raise _unknown_key(prefix + key, root, context)
    for name, sub in sections.items():
        f, tp = fields[name]
        base = _default(f) if isinstance(target, type) else getattr(target, name)
        changes[name] = _apply(base, sub, f"{prefix}{name}.", root, context)
    if isinstance(target, type):
        missing = [n for n, (f, _) in fields.items() if n not in changes and _default(f) is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"missing required key{'s' if len(missing) > 1 else ''} "
                              f"{', '.join(repr(prefix + n) for n in missing)} for {context}")
    try:
        return target(**changes) if isinstance(target, type) else dataclasses.replace(target, **changes)
    except (ValueError, TypeError) as e:           # a __post_init__ check that spans several keys
        if isinstance(e, ConfigError):
            raise
        where = f" ({prefix[:-1]})" if prefix else ""
        raise ConfigError(f"invalid config for {context}{where}: {e}") from e


def _set_entry(d, path: list[str], value, key: str) -> dict:
    d = dict(d)
    if len(path) > 1:
        inner = d.get(path[0], {})
        if not isinstance(inner, dict):
            raise ConfigError(f"bad key '{key}': '{path[0]}' holds {inner!r}, not a table")
        d[path[0]] = _set_entry(inner, path[1:], value, key)
    else:
        d[path[0]] = _literal(value) if isinstance(value, str) else value
        _check_finite(key, value, d[path[0]])
    return d


def _context(cfg_or_cls, context: str | None) -> str:
    cls = cfg_or_cls if isinstance(cfg_or_cls, type) else type(cfg_or_cls)
    return context or cls.__name__


def apply_overrides(cfg, overrides: Mapping[str, Any], *, context: str | None = None):
    """A copy of ``cfg`` with dotted-key ``overrides`` (strings parsed, typed values checked).

    Works out of place through ``dataclasses.replace``. Note that ``replace`` reruns ``__post_init__`` on
    the *current* values: a config that writes derived values back into its fields keeps them stale, so
    build fresh configs with ``resolve`` (which starts from the class) rather than overriding an instance.
    ``context`` names the config in messages (``"recipe standard"``; default: the class name).
    """
    return _apply(cfg, dict(overrides), "", type(cfg), _context(cfg, context))


def flatten_keys(d: Mapping, prefix: str = "") -> dict[str, Any]:
    """Nested tables to dotted keys; an empty table stays a value (``{}``)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(flatten_keys(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def resolve(cls, *, presets: Mapping[str, Mapping] | None = None, preset: str | None = None,
            toml: Mapping[str, Any] | None = None, overrides: Mapping[str, Any] | None = None,
            context: str | None = None):
    """Build ``cls`` from defaults < ``presets[preset]`` < ``toml`` (flat) < ``overrides``.

    A config file may name its own preset (``preset = "tiny"``); an explicit ``preset`` argument wins.
    Preset dicts may be nested or dotted.
    """
    context = _context(cls, context)
    toml = dict(toml or {})
    file_preset = toml.pop("preset", None)
    name = preset if preset is not None else file_preset
    layers = []
    if name is not None:
        if not isinstance(name, str) or name not in (presets or {}):
            valid = f"valid presets: {', '.join(presets)}" if presets else "it has no presets"
            raise ConfigError(f"unknown preset {name!r} for {context}; {valid}")
        layers.append(flatten_keys(presets[name]))
    layers += [toml, dict(overrides or {})]
    merged: dict[str, Any] = {}
    for layer in layers:
        for k, v in layer.items():
            merged.pop(k, None)                     # a later layer also goes later in order
            merged[k] = v
    return _apply(cls, merged, "", cls, context)


# ----------------------------------------------------------------------------------------------------------
# dicts

def to_dict(cfg) -> dict[str, Any]:
    """The config as plain nested dicts (for checkpoints and TensorBoard hparams)."""
    return dataclasses.asdict(cfg)


def from_dict(cls, d: Mapping[str, Any], *, context: str | None = None):
    """The inverse of ``to_dict``: unknown keys and wrong types are errors; missing keys take defaults."""
    def flat(cls, d, prefix):
        sections = {f.name: tp for f, tp in _fields(cls) if _is_section(tp)}
        out = {}
        for k, v in d.items():
            if k in sections and isinstance(v, Mapping):
                out.update(flat(sections[k], v, f"{prefix}{k}."))
            else:
                out[prefix + k] = v
        return out
    return _apply(cls, flat(cls, d, ""), "", cls, _context(cls, context))
