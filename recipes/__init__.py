"""recipes: the training loops (a config dataclass plus ``run(cfg)`` each) and their registry.

``RECIPES`` maps each name ``purestep recipe=NAME`` accepts to its module (imported only when chosen).
``core.cli.command`` receives it from its caller and knows no recipe by itself; a name not registered here is
tried as a dotted module path that defines ``Config`` and ``run`` (research code's own recipes).
"""
from typing import Sequence

from purestep.core.cli import command as cli

RECIPES = {
    "standard": "purestep.recipes.standard",
    "generate": "purestep.recipes.generate",
    "export": "purestep.recipes.export",
    "lr_find": "purestep.recipes.lr_find",
    "distill": "purestep.recipes.distill.recipe",
    "distill_cache": "purestep.recipes.distill.cache",
    "upcycle": "purestep.recipes.upcycle.recipe",
    "compress": "purestep.recipes.compress.recipe",
    "eval": "purestep.recipes.eval.recipe",
    "bench.step": "purestep.recipes.bench.step",
    "bench.fsdp": "purestep.recipes.bench.fsdp",
    "bench.speed": "purestep.recipes.bench.speed",
    "bench.wall": "purestep.recipes.bench.wall",
    "bench.nanogpt": "purestep.recipes.bench.nanogpt",
    "bench.health": "purestep.recipes.bench.health",
    "bench.checkpoint": "purestep.recipes.bench.checkpoint",
    "bench.orchestrator": "purestep.recipes.bench.orchestrator",
    "bench.distill": "purestep.recipes.bench.distill",
    "bench.policy": "purestep.recipes.bench.policy",
    "bench.export": "purestep.recipes.bench.export",
    "bench.kv": "purestep.recipes.bench.kv",
    "bench.upcycle": "purestep.recipes.bench.upcycle",
    "bench.gpu": "purestep.recipes.bench.gpu",
    "bench.llamacpp": "purestep.recipes.bench.llamacpp",
    "bench.eval": "purestep.recipes.bench.eval",
}


def main(argv: Sequence[str], repeats: bool = True) -> int:
    """``purestep`` with these arguments over this registry; returns the exit code (see ``core.cli.command.main``:
    ``repeats=False``, ``purestep``'s own command line, refuses a key given twice)."""
    return cli.main(argv, RECIPES, repeats)
