"""recipes.compress: hidden-state compression: the recipe and the teacher states it trains on."""
