"""recipes: the training loops (a config dataclass plus ``run(cfg)`` each)."""
