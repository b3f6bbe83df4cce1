"""recipes.train: shared training machinery: the config, the one loop, the one optimizer factory, the one run wiring, faults."""
