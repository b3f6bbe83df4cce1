"""The README stays true: its research script runs as written, and its key tables match the code."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from core.config_help import markdown_table
from recipes import RECIPES

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def block(name: str) -> str:
    match = re.search(rf"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", README, re.S)
    assert match, f"README has no {name} block"
    return match.group(1)


def test_research_script_runs_verbatim(tmp_path):
    script = re.search(r"```python\n(.*?)```", block("research-script"), re.S).group(1)
    assert len(script.strip().splitlines()) <= 40
    env = {**os.environ, "PURESTEP_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    val = float(re.search(r"validation loss (\d+\.\d+)", proc.stdout).group(1))
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.5 and val < 4.0, proc.stdout


@pytest.mark.parametrize("recipe", ["standard"])
def test_key_table_matches_the_code(recipe):
    import importlib
    expected = markdown_table(importlib.import_module(RECIPES[recipe]).Config)
    assert block(f"keys:{recipe}").strip() == expected.strip(), \
        f"README key table for {recipe} is stale; replace it with:\n{expected}"


def test_every_recipe_is_in_the_recipes_table():

    table = README.split("## Recipes", 1)[1].split("\n## ", 1)[0]
    assert [name for name in RECIPES if f"| `{name}` |" not in table] == []
