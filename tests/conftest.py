"""Shared test helpers: where optional real assets live, and skips that say how to get them."""
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def shared_data(name: str) -> Path:
    """A file from the shared test data (``$PURESTEP_SHARED_DATA`` or ``../shared/data``), or skip."""
    roots = [os.environ.get("PURESTEP_SHARED_DATA"), REPO.parent / "shared" / "data"]
    for root in roots:
        if root and (Path(root) / name).exists():
            return Path(root) / name
    pytest.skip(f"{name} not found in $PURESTEP_SHARED_DATA or ../shared/data (CI provides it)")
