"""Config help: the key table (key, type and valid range, default, meaning) of a config class, as ``--help``
text and as the Markdown key tables of docs/configuration.md (which ``tests/test_readme.py`` checks against it)."""
from __future__ import annotations

import dataclasses
from typing import Mapping

from purestep.core.config import _default, _fields, _is_section, flatten_keys, show_value, type_str

__all__ = ["describe", "format_help", "markdown_table"]


def describe(cfg_cls_or_instance) -> list[tuple[str, str, str, str]]:
    """``(key, type, default, help)`` for every leaf field, nested ones under dotted keys.

    Given an instance, the "default" column shows that instance's values.
    """
    rows = []

    def walk(cls, obj, prefix):
        for f, tp in _fields(cls):
            value = getattr(obj, f.name) if obj is not None else _default(f)
            if _is_section(tp):
                nested = value if not isinstance(value, type) else None
                walk(tp, nested, f"{prefix}{f.name}.")
                continue
            choices = f.metadata.get("choices")
            tstr = "|".join(show_value(c) for c in choices) if choices else type_str(tp)
            if f.metadata.get("range") is not None:
                tstr += f" {f.metadata['range']}"
            shown = "(required)" if value is dataclasses.MISSING else show_value(value)
            rows.append((prefix + f.name, tstr, shown, f.metadata.get("help", "")))

    is_cls = isinstance(cfg_cls_or_instance, type)
    walk(cfg_cls_or_instance if is_cls else type(cfg_cls_or_instance),
         None if is_cls else cfg_cls_or_instance, "")
    return rows


def format_help(cfg_cls_or_instance, presets: Mapping[str, Mapping] | None = None) -> str:
    """The keys table (key, type, default, meaning) and the presets, as text for ``--help``.

    Given an instance, the third column shows its values instead of the defaults.
    """
    rows = describe(cfg_cls_or_instance)
    header = ("key", "type", "default" if isinstance(cfg_cls_or_instance, type) else "value", "meaning")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(3)]
    lines = ["keys:"]
    for key, tstr, default, help_ in [header] + rows:
        cells = [key.ljust(widths[0]), tstr.ljust(widths[1]), default.ljust(widths[2]), help_]
        lines.append(("  " + "  ".join(cells)).rstrip())
    if presets:
        lines += ["", "presets (applied before the config file and key=value):"]
        width = max(len(p) for p in presets)
        for name, values in presets.items():
            settings = " ".join(f"{k}={show_value(v)}" for k, v in flatten_keys(values).items())
            lines.append(f"  {name.ljust(width)}  {settings}")
    return "\n".join(lines)


def markdown_table(cls) -> str:
    """The key table of a config class as Markdown (docs/configuration.md's tables are checked against this)."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, tp, default, help_ in describe(cls):
        tp = tp.replace("|", " \\| ")  # a choice list like auto|cpu must not split the Markdown cell
        rows.append(f"| `{key}` | {tp} | `{default}` | {help_} |")
    return "\n".join(rows)
