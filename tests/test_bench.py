"""Every benchmark is a recipe: ``bin/run recipe=bench.NAME --help`` answers (in process, exit 0)."""
import importlib

import pytest

from recipes import RECIPES, main

BENCHES = [name for name in RECIPES if name.startswith("bench.")]


def test_there_are_benchmarks():
    assert {"bench.step", "bench.health", "bench.checkpoint", "bench.orchestrator", "bench.distill"} <= set(BENCHES)


@pytest.mark.parametrize("name", BENCHES)
def test_benchmark_answers_help(name, capsys):
    assert main([f"recipe={name}", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: bin/run recipe={name} ") and "\nkeys:\n" in out
    assert importlib.import_module(RECIPES[name]).DESCRIPTION in out
