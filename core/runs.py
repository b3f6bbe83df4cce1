"""Where a run lives: ``out``, else ``runs/<recipe>-<name>``, else ``runs/<recipe>-<timestamp>``."""
from __future__ import annotations

from datetime import datetime
from pathlib import Path


def run_folder(out: str, name: str, recipe: str) -> Path:
    if out:
        return Path(out)
    return Path("runs") / f"{recipe}-{name or datetime.now().strftime('%Y%m%d-%H%M%S')}"
