"""models: ``init(cfg, seed) -> params`` and ``apply(params, tokens, cfg) -> logits`` as plain functions."""
