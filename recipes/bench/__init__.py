"""recipes.bench: benchmarks, each a recipe: bin/run recipe=bench.NAME."""
