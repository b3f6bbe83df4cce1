"""core: model- and recipe-agnostic building blocks (pytrees, RNG, the train state and step, compile)."""
