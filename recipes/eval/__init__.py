"""recipe=eval: multiple-choice accuracy scored as lm-evaluation-harness scores it.

``evaluate(model, tasks, limit, ...)`` (``recipes.eval.run``) is the function other code calls without the CLI;
``recipes.eval.recipe`` is the recipe (``purestep recipe=eval``), ``tasks`` the formats and data, ``scoring`` the
batched log-likelihoods, ``stats`` the standard errors and the paired comparison, ``report`` what a run writes.
"""
