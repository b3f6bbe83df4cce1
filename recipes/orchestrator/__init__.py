"""recipes.orchestrator: the orchestrator: a strategy layer any training recipe can switch on."""
