"""core.cli: the program around the recipes.

``command`` (``purestep``'s parser: ``recipe=`` ``config=`` ``preset=`` ``key=value``, help, the error
line and exit code), ``config_files`` (TOML configs), ``config_help`` (the key tables), ``runs`` (run
folders and their lock), ``grid``, ``grid_parallel``, ``grid_summary`` (sweeps over keys). The top of core:
it may import the kernel and every other core package.
"""
