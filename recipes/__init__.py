"""recipes: the training loops (a config dataclass plus ``run(cfg)`` each) and their registry.

``RECIPES`` maps each name ``bin/run recipe=NAME`` accepts to its module (imported only when chosen).
``core.cli.command`` receives it from its caller and knows no recipe by itself; a name not registered here is
tried as a dotted module path that defines ``Config`` and ``run`` (research code's own recipes).
"""
from typing import Sequence

from core.cli import command as cli

RECIPES = {
    "standard": "recipes.standard",
    "generate": "recipes.generate",
    "export": "recipes.export",
    "lr_find": "recipes.lr_find",
    "distill": "recipes.distill.recipe",
    "distill_cache": "recipes.distill.cache",
    "upcycle": "recipes.upcycle.recipe",
    "compress": "recipes.compress.recipe",
    "eval": "recipes.eval.recipe",
    "bench.step": "recipes.bench.step",
    "bench.speed": "recipes.bench.speed",
    "bench.wall": "recipes.bench.wall",
    "bench.health": "recipes.bench.health",
    "bench.checkpoint": "recipes.bench.checkpoint",
    "bench.orchestrator": "recipes.bench.orchestrator",
    "bench.distill": "recipes.bench.distill",
    "bench.policy": "recipes.bench.policy",
    "bench.export": "recipes.bench.export",
    "bench.kv": "recipes.bench.kv",
    "bench.upcycle": "recipes.bench.upcycle",
    "bench.gpu": "recipes.bench.gpu",
    "bench.llamacpp": "recipes.bench.llamacpp",
    "bench.eval": "recipes.bench.eval",
}


def main(argv: Sequence[str], repeats: bool = True) -> int:
    """``bin/run`` with these arguments over this registry; returns the exit code (see ``core.cli.command.main``:
    ``repeats=False``, ``bin/run``'s own command line, refuses a key given twice)."""
    return cli.main(argv, RECIPES, repeats)
