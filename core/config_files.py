"""Config files: a TOML file as the flat dotted-key dict ``core.config.resolve`` layers over the defaults.

Tables become dotted prefixes (``[model]`` + ``n_layers`` -> ``model.n_layers``), as in nanoGPT's
configurator keys; every failure to read or parse the file is a one-line ``ConfigError``.
"""
from __future__ import annotations

import tomllib
from typing import Any

from core.config import ConfigError, flatten_keys

__all__ = ["load_toml"]


def load_toml(path) -> dict[str, Any]:
    """A TOML config file as a flat dict of dotted keys (``[model]`` + ``n_layers`` -> ``model.n_layers``)."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"bad config file {path}: {e}") from None
    return flatten_keys(data)
