"""recipes.bench: benchmarks, each a recipe: purestep recipe=bench.NAME."""
