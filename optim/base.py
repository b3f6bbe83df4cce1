"""The optax interface in PyTorch: gradient transformations as ``(init, update)`` pairs.

``init(params) -> state`` and ``update(updates, state, params) -> (updates, state)``, both out of place,
composed with :func:`chain` (optax ``base.py`` / ``combine.py``), or given disjoint parts of the params by
:func:`partition` (optax ``partition``, formerly ``multi_transform``). A transform knows nothing of how the step
runs: compiled or eager, donated or not (``core.donate``, ``core.compile``), on one rank or sharded. A transform
may also say what it wants logged: ``metrics(state) -> dict`` of 0-d tensors (the learning rate,
clip activity), which the train step adds to its metrics without knowing any optimizer. Hyperparameters that a
run may change (learning rate, betas, weight decay) live in the state as 0-d tensors, as in optax's
``inject_hyperparams``, so a schedule or an edit never recompiles a compiled step. Their dtype follows
the params' widest float dtype (float64 params give float64 hyperparameters, as ``torch.optim`` computes
its bias corrections in double precision).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch

from purestep.core import tree
from purestep.core.tree import Tree, tree_leaves


class GradientTransformation(NamedTuple):
    """optax's pair (``init``, ``update``), with ``metrics`` (state -> scalars the run logs)."""
    init: Callable[[Tree], Any]
    update: Callable[..., tuple[Tree, Any]]
    metrics: Optional[Callable[[Any], dict]] = None


class EmptyState(NamedTuple):
    pass


def identity() -> GradientTransformation:
    return GradientTransformation(lambda params: EmptyState(), lambda updates, state, params=None: (updates, state))


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transforms in order; the state is the tuple of their states (optax's ``chain``)."""
    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None):
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    def metrics(state):
        out = {}
        for t, s in zip(transforms, state):
            if t.metrics is not None:
                out.update(t.metrics(s))
        return out

    return GradientTransformation(init, update, metrics)


def partition(transforms: dict, labels: Callable[[Tree], Tree]) -> GradientTransformation:
    """Each transform of ``transforms`` (label -> transform) on the leaves ``labels(params)`` (a pytree of labels
    shaped like the params) gives its label, as optax's ``partition`` (``multi_transform``). A transform sees the
    params, updates and state of its own leaves only: the nested dicts pruned to them, with their names kept
    (masks by name, such as ``optim.common.decay_mask``, work inside). The state is a dict label -> state, in the
    order of ``transforms`` (so ``find_state`` meets the first transform's states first); a label with no leaves
    keeps an :class:`EmptyState`. ``metrics``: the first transform's under their own names (the run's ``lr``), every other's with its
    label and ``_`` in front (``muon_lr``)."""
    first = next(iter(transforms), None)

    def parts(params):
        keys = labels(params)
        unknown = set(_labels(keys)) - set(transforms)
        if unknown:
            raise ValueError(f"partition: labels {sorted(unknown)} have no transform (have {sorted(transforms)})")
        return keys

    def init(params):
        keys = parts(params)
        return {k: (t.init(_select(params, keys, k)) if _has(keys, k) else EmptyState())
                for k, t in transforms.items()}

    def update(updates, state, params=None):
        keys = parts(params if params is not None else updates)
        out, new_state = {}, {}
        for k, t in transforms.items():
            if not _has(keys, k):
                new_state[k] = state[k]
                continue
            sub_params = None if params is None else _select(params, keys, k)
            sub, new_state[k] = t.update(_select(updates, keys, k), state[k], sub_params)
            out.update(tree.flatten_dict(sub))
        return tree.tree_map_with_name(lambda name, _: out[name], updates), new_state

    def metrics(state):
        found = {}
        for k, t in transforms.items():
            if t.metrics is not None and not isinstance(state[k], EmptyState):
                found.update({(m if k == first else f"{k}_{m}"): v for m, v in t.metrics(state[k]).items()})
        return found

    return GradientTransformation(init, update, metrics)


def _labels(keys: dict) -> list:
    """The labels of a nested dict of labels (a walk in plain Python, which dynamo traces)."""
    return [x for v in keys.values() for x in (_labels(v) if isinstance(v, dict) else [v])]


def _has(keys: dict, label: str) -> bool:
    return label in _labels(keys)


def _select(node: dict, keys: dict, label: str) -> dict:
    """The nested dict ``node`` pruned to the leaves whose label in ``keys`` is ``label`` (no empty dicts)."""
    out = {}
    for name, value in node.items():
        if isinstance(value, dict):
            sub = _select(value, keys[name], label)
            if sub:
                out[name] = sub
        elif keys[name] == label:
            out[name] = value
    return out


apply_updates = tree.apply_updates


def hparam_dtype(params: Tree) -> torch.dtype:
    floats = [t.dtype for t in tree_leaves(params) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return torch.float64 if torch.float64 in floats else torch.float32


def hparam_device(params: Tree) -> torch.device:
    leaves = [t for t in tree_leaves(params) if isinstance(t, torch.Tensor)]
    return leaves[0].device if leaves else torch.device("cpu")


def hparams(params: Tree, **values: float) -> dict[str, torch.Tensor]:
    """0-d tensors on the params' device, in :func:`hparam_dtype`."""
    dtype, device = hparam_dtype(params), hparam_device(params)
    return {k: torch.tensor(float(v), dtype=dtype, device=device) for k, v in values.items()}


def counter(params: Tree) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=hparam_device(params))


def resolve_mask(mask: Tree | Callable[[Tree], Tree] | None, params: Tree) -> Tree | None:
    """A mask is a pytree of Python bools shaped like params, or a function of params giving one."""
    if mask is None:
        return None
    return mask(params) if callable(mask) else mask


def iter_states(state: Any):
    """Depth-first walk over the (nested tuple) state of a chain, yielding every NamedTuple state."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        yield state
        for value in state:
            yield from iter_states(value)
    elif isinstance(state, (tuple, list)):
        for value in state:
            yield from iter_states(value)
    elif isinstance(state, dict):
        for value in state.values():
            yield from iter_states(value)


def find_state(state: Any, cls: type) -> Any | None:
    """The first sub-state of type ``cls`` in a chain's state (or None)."""
    for s in iter_states(state):
        if isinstance(s, cls):
            return s
    return None


def replace_states(state: Any, cls: type, fn: Callable[[Any], Any]) -> Any:
    """A copy of ``state`` where every sub-state of type ``cls`` is replaced by ``fn(sub_state)``."""
    if isinstance(state, cls):
        return fn(state)
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*(replace_states(v, cls, fn) for v in state))
    if isinstance(state, tuple):
        return tuple(replace_states(v, cls, fn) for v in state)
    if isinstance(state, list):
        return [replace_states(v, cls, fn) for v in state]
    if isinstance(state, dict):
        return {k: replace_states(v, cls, fn) for k, v in state.items()}
    return state
