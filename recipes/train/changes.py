"""Resuming with keys that differ from the checkpoint's: apply them and say so, or refuse naming them.

A resumed run is rebuilt from the command line it is given, so loop settings (``steps``, ``eval_every``,
``save_every`` ...) and the learning-rate schedule (a function of the step, rebuilt from the config) take
their new values by themselves; hyperparameters that live in the optimizer state as tensors (``lr``,
``beta1``, ``weight_decay`` ...) would silently keep the checkpoint's, so :func:`apply_hyperparameters`
writes the new ones in. Keys that define what is being trained (the model, the data, the tokenizer, the
seed, the state's layout) cannot change mid-run: :func:`check` refuses them in one line.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from purestep.core.config import ConfigError, flatten_keys, show_value, to_dict
from purestep.core.tree import tree_leaves, tree_map

FIXED = ("model", "student", "teacher", "tokenizer", "data", "seed", "init", "fim_rate", "dtype", "clipping",
         "optimizer", "health", "spike.enabled", "cache",
         "text_field", "loss_on", "pack", "val_fraction", "val_data")
"""Keys (or dotted prefixes) a resumed run cannot change: what is trained, on what, and the state's layout (a
config's run hooks add their own, ``recipes.train.hooks.RunHook.fixed_keys``).
(``teacher_dtype`` is not here: ``auto`` and ``fp32`` may hold the same teacher; distill compares the dtype the
teacher is actually held in, with the teacher's fingerprint.)"""
WHERE = ("out", "name", "resume", "compile", "compile_mode", "fused", "tf32", "device")
"""Keys that say where and how the run executes, not what it computes: never reported."""


def changes(saved: Mapping[str, Any], cfg) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (checkpoint's value, new value)}`` for every key both configs have and that differs."""
    old, new = flatten_keys(saved), flatten_keys(to_dict(cfg))
    return {k: (old[k], v) for k, v in new.items()
            if k in old and not _same(old[k], v) and not _matches(k, WHERE)}


def _same(a, b) -> bool:
    """Equal values, or two spellings of one existing file or folder (``data=x.txt`` vs its absolute path)."""
    if a == b:
        return True
    if isinstance(a, str) and isinstance(b, str) and a and b and os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return False


def _matches(key: str, names) -> bool:
    return any(key == n or (n.endswith(".") and key.startswith(n)) or key.startswith(n + ".") for n in names)


def check(diff: Mapping[str, tuple[Any, Any]], fixed=FIXED) -> None:
    """ConfigError naming every changed key that a resumed run cannot take."""
    bad = [k for k in diff if _matches(k, fixed)]
    if bad:
        listed = ", ".join(f"{k} ({show_value(diff[k][0])} -> {show_value(diff[k][1])})" for k in bad)
        raise ConfigError(f"resume: {listed} differ from the checkpoint's run and cannot change mid-run; "
                          f"give the checkpoint's values, or start a new run (another out=, or resume=never)")


def describe(diff: Mapping[str, tuple[Any, Any]], step: int) -> str:
    """``lr 0.001 -> 0.3, steps 40 -> 60 from step 40`` (empty when nothing changed)."""
    if not diff:
        return ""
    return ", ".join(f"{k} {show_value(a)} -> {show_value(b)}" for k, (a, b) in diff.items()) + f" from step {step}"


def tree_all_equal(a, b) -> bool:
    """Same structure and equal leaves."""
    try:
        return all(tree_leaves(tree_map(lambda x, y: torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y,
                                        a, b)))
    except (ValueError, TypeError):
        return False


def apply_hyperparameters(opt_state, old_fresh, new_fresh):
    """``opt_state`` with the hyperparameters the config change alters taken from ``new_fresh``.

    ``old_fresh``/``new_fresh`` are ``init(params)`` of the optimizers built from the checkpoint's and the new
    config: a leaf where those two differ is a hyperparameter the change touched (lr, betas, decay, clip
    thresholds, all 0-d tensors in the state), so it takes the new value; every other leaf (moments,
    counters, a learning rate a rollback scaled) keeps the checkpoint's. Different state layouts (another
    optimizer or clipping kind) are a ConfigError.
    """
    if tree_all_equal(old_fresh, new_fresh):
        return opt_state                        # the change touched no hyperparameter
    def pick(loaded, old, new):
        if isinstance(old, torch.Tensor) and not torch.equal(old, new):
            return new.to(device=loaded.device, dtype=loaded.dtype)
        return loaded
    try:
        return tree_map(pick, opt_state, old_fresh, new_fresh)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"resume: the optimizer's state no longer has the checkpoint's layout ({e}); "
                          f"start a new run (another out=, or resume=never)") from None
