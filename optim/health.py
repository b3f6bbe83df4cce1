"""Gradient health statistics, vectorized, packed into one tensor per step.

The checks of the stability notes (non-finite values, dead gradients, gradient and update magnitudes
relative to the weights, clip activity: OPT logbook, Karpathy's update/weight ratio of ~1e-3, AGC's
||g||/||w|| of Brock et al. 2021) computed inside the (compiled) train step, for every tensor and, for
weights stacked along a leading layer axis, for every layer slice: one reduction over every dim but the layer
axis (``x.square().sum(dim=(1, ...))``, :func:`slice_sums`) gives the statistic of all L layers at once. Nothing
calls ``.item()``: the step returns one float32 tensor ``[rows, 5]`` and the loop moves it to the host
once per log interval, where :class:`GradientHealth` turns it into a report, TensorBoard scalars and
histograms.

Columns (``COLUMNS``)::

    nonfinite         number of NaN/Inf gradient elements (float32: exact below 2**24)
    zero              1.0 if the gradient norm is exactly 0 (unused parameter, dead layer), else 0.0
    grad_norm         ||g|| in (at least) float32
    grad_to_weight    ||g|| / ||w||          (inf if the weight is all zeros; nan if both are)
    update_to_weight  ||w_new - w|| / ||w||  the change actually applied, after the cast to the param dtype

Rows: one per unstacked leaf (``embed``), one per layer of a stacked leaf (``layers.attn.wq[3]``), and a
last row ``global`` holding the same statistics over all parameters together.

Per-leaf ``vector_norm`` over flattened slices was timed against ``torch._foreach_norm`` over the leaves and their
``unbind(0)`` slices (docs/design.md, 'Measured choices'): compiled, ``vector_norm`` wins, since inductor fuses a
leaf's norm and non-finite count into one pass (``_foreach_norm`` cannot count non-finite values, so it needs that
pass anyway); eager, ``_foreach_norm`` wins (fewer kernel launches). The step is meant to run compiled, so this file
uses ``vector_norm``. The per-leaf work is four reductions; everything after them runs once on the concatenated
``[rows, 4]``.

The stacked-leaf convention (``stacked_predicate``, ``slice_squares``) lives here and is shared by
:mod:`optim.adagc` and :mod:`optim.agc`.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable, Optional, Union

import torch

from purestep.core.tree import Tree, is_sharded, named_leaves, tree_leaves, whole

COLUMNS = ("nonfinite", "zero", "grad_norm", "grad_to_weight", "update_to_weight")
GLOBAL = "global"
NOT_COMPUTED = -1.0   # every entry of a packed tensor from a step that skipped the statistics (GradientHealth.every)

Stacked = Union[None, Callable[[str, torch.Tensor], bool], str, Iterable[str]]


# ----------------------------------------------------------------------------------------------------------
# stacked leaves

def layer_stacked(name: str, leaf: torch.Tensor) -> bool:
    """The default for purestep models: every leaf under ``layers.`` carries a leading layer axis."""
    return name.split(".")[0] == "layers" and leaf.ndim >= 1


def stacked_predicate(stacked: Stacked = None) -> Callable[[str, torch.Tensor], bool]:
    """``(name, leaf) -> bool``: is this leaf stacked along a leading layer axis?

    ``None`` is :func:`layer_stacked`; a callable is used as is; a name or a collection of names marks
    those leaves and everything below them (``"layers"`` covers ``layers.attn.wq``); ``()`` marks none.
    """
    if stacked is None:
        return layer_stacked
    if callable(stacked):
        return stacked
    prefixes = (stacked,) if isinstance(stacked, str) else tuple(stacked)

    def predicate(name: str, leaf: torch.Tensor) -> bool:
        return leaf.ndim >= 1 and any(name == p or name.startswith(p + ".") for p in prefixes)

    return predicate


def computed(packed) -> bool:
    """Whether a packed health tensor holds statistics (not a step that skipped them: ``GradientHealth.every``)."""
    return bool(packed[0, 0] >= 0)


def wide(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, the dtype itself for float32/float64: norms never accumulate below fp32."""
    return torch.promote_types(dtype, torch.float32)


def slice_sums(t: torch.Tensor, stacked: bool, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The sum of each layer slice (``[L]``) of a stacked leaf, of the whole leaf (0-d) otherwise: one reduction
    over every dim but the layer axis, with no reshape (a leaf sharded twice on one dim, ``parallel=fsdp,tp``, has
    no flat view a DTensor can name)."""
    if not stacked:
        return t.sum(dtype=dtype)
    return t.sum(dim=tuple(range(1, t.ndim)), dtype=dtype) if t.ndim > 1 else t.to(dtype or t.dtype)


def slice_squares(t: torch.Tensor, stacked: bool) -> torch.Tensor:
    """Sum of squares of each layer slice (``[L]``) of a stacked leaf, of the whole leaf (0-d) otherwise, in at least
    float32. A sum, not a norm: over a sharded leaf (a ``DTensor``) it is a partial sum that adds up across ranks, so
    statistics of many leaves stack into one tensor and become whole-model in one all-reduce."""
    return slice_sums((t.to(wide(t.dtype)) if t.dtype != wide(t.dtype) else t).square(), stacked)


# ----------------------------------------------------------------------------------------------------------
# the statistics

class GradientHealth:
    """Per-tensor and per-layer gradient statistics for ``make_train_step(extra_metrics=...)``.

    ``health = GradientHealth(params, clip_norm=1.0)``; ``make_train_step(..., monitors=Monitors(health))``
    adds ``metrics["health"]``, a float32 ``[len(health.layout), 5]`` tensor; the loop pulls it to the host
    every log interval and calls :meth:`report`, :meth:`to_scalars` and :meth:`histograms` on it.
    ``clip_norm`` (the global clipping threshold, if any) adds ``health/clip/*`` to the scalars. Over sharded
    params and gradients (DTensors) every statistic is a sum over the ranks' shards, made whole in one all-reduce.
    ``every`` (the loop's ``log_every``) computes them only on the steps :meth:`due` names;
    the object itself is the ``extra_metrics`` callable then, so the step can ask :meth:`due` (``make_train_step``).
    """

    def __init__(self, params: Tree, *, stacked: Stacked = None, clip_norm: float | None = None,
                 every: int | None = None):
        if every is not None and every < 1:
            raise ValueError(f"GradientHealth: every must be >= 1, got {every}")
        is_stacked = stacked_predicate(stacked)
        self.clip_norm, self.every = clip_norm, every
        self.leaves: list[tuple[str, bool, int]] = []      # (name, stacked, number of rows)
        self.rows: list[tuple[str, int | None]] = []        # (leaf name, layer index or None)
        for name, leaf in named_leaves(params):
            s = bool(is_stacked(name, leaf))
            n = leaf.shape[0] if s else 1
            self.leaves.append((name, s, n))
            self.rows += [(name, i) for i in range(n)] if s else [(name, None)]
        self.rows.append((GLOBAL, None))
        self.layout = [name if i is None else f"{name}[{i}]" for name, i in self.rows]

    # ---------------------------------------------------------------------------------- inside the step

    def due(self, step):
        """Whether the step that brings the count to ``step`` (an int, or a tensor inside a graph) computes the
        statistics: every step without ``every``; else the multiples of ``every`` (the loop's log steps) and the
        first (the loop's check for unused parameters)."""
        if self.every is None:
            return True if isinstance(step, int) else torch.ones((), dtype=torch.bool, device=step.device)
        return (step % self.every == 0) | (step == 1)

    def skipped(self, device: torch.device) -> dict[str, torch.Tensor]:
        """What :meth:`metrics` returns on a step that is not due (:func:`computed` is false)."""
        return {"health": torch.full((len(self.rows), len(COLUMNS)), NOT_COMPUTED, device=device)}

    def metrics(self, *, grads: Tree, params: Tree, new_params: Tree | None = None,
                updates: Tree | None = None, step: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``{"health": packed}``; traceable, no host sync in a graph. The update ratio uses ``new_params - params``
        (what the step applied), or ``updates`` when ``new_params`` is not given. With ``every`` and ``step`` (the
        count after this step, a tensor), a step that is not :meth:`due` skips the per-leaf work (``torch.cond``,
        compiled or eager) and returns :meth:`skipped`'s tensor; over sharded gradients (DTensors, which
        ``torch.cond`` does not take) it computes them and selects. A step whose update is
        not inside the same graph as its backward asks :meth:`due` on the host instead and calls this only when
        due (``core.step``): in a graph of its own, inductor writes out the new params the branch reads and
        copies them into the donated params afterwards instead of storing each where it belongs in one pass, on
        every step, taken or not (a much slower update kernel at 100M parameters in a kernel profile;
        docs/design.md, 'Measured choices')."""
        g_leaves, w_leaves = tree_leaves(grads), tree_leaves(params)
        d_new = new_params is not None
        if not d_new and updates is None:
            raise ValueError("GradientHealth.metrics needs new_params= or updates=")
        d_leaves = tree_leaves(new_params if d_new else updates)
        if not (len(g_leaves) == len(w_leaves) == len(d_leaves) == len(self.leaves)):
            raise ValueError(f"GradientHealth was built for {len(self.leaves)} leaves, got "
                             f"{len(g_leaves)} grads / {len(w_leaves)} params / {len(d_leaves)} updates")
        statistics = functools.partial(self._raw, d_new)
        want = None if self.every is None or step is None else self.due(step)
        if want is None or any(is_sharded(g) for g in g_leaves):   # torch.cond takes no DTensor operands
            raw = statistics(g_leaves, w_leaves, d_leaves)
        else:   # only the due steps run the reductions (a host check when eager: torch.cond's own)
            raw = torch.cond(want, statistics, self._not_computed, (g_leaves, w_leaves, d_leaves))
        counts, squares = raw.split([1, 3], dim=-1)
        raw = torch.cat([counts, squares.sqrt()], dim=-1)
        nonfinite, gn, wn, dn = raw.unbind(-1)
        _, g_all, w_all, d_all = raw.square().sum(0).sqrt().unbind()
        rows = torch.stack([nonfinite, (gn == 0).float(), gn, gn / wn, dn / wn], dim=-1)
        total = torch.stack([nonfinite.sum(), (g_all == 0).float(), g_all, g_all / w_all, d_all / w_all])
        packed = torch.cat([rows, total.reshape(1, 5)])
        return {"health": packed if want is None else torch.where(want, packed, NOT_COMPUTED)}

    __call__ = metrics

    def _raw(self, d_new: bool, g_leaves: list, w_leaves: list, d_leaves: list) -> torch.Tensor:
        """``[rows, 4]``: per row the non-finite count and the sums of squares of g, w and d (sums, so a sharded
        leaf's rows add up across ranks); ``d_leaves`` are the new params (``d_new``) or the updates."""
        raw = []
        for (_, s, _), g, w, d in zip(self.leaves, g_leaves, w_leaves, d_leaves):
            if d_new:
                d = d.to(wide(w.dtype)) - w.to(wide(w.dtype))
            nonfinite = slice_sums(~torch.isfinite(g), s, torch.float32)
            norms = [slice_squares(x, s).float() for x in (g, w, d)]
            # every column [rows]: a sharded 0-d leaf (a [1] shard) gave torch 2.11's stack one 0-d and three [1]
            raw.append(torch.stack([c.reshape(-1) for c in [nonfinite] + norms], dim=-1))
        return whole(torch.cat(raw))   # sharded leaves: the ranks' partial sums, one all-reduce

    def _not_computed(self, g_leaves: list, *_) -> torch.Tensor:
        return torch.full((len(self.rows) - 1, 4), NOT_COMPUTED, device=g_leaves[0].device)

    # ---------------------------------------------------------------------------------- on the host

    def _check(self, packed) -> torch.Tensor:
        packed = torch.as_tensor(packed).detach().cpu().double()
        if tuple(packed.shape) != (len(self.rows), len(COLUMNS)):
            raise ValueError(f"packed health tensor has shape {tuple(packed.shape)}, "
                             f"expected {(len(self.rows), len(COLUMNS))}")
        return packed

    def report(self, packed) -> list[tuple[str, str]]:
        """``(name, problem)`` for every tensor or layer slice whose gradient is non-finite or exactly zero.

        A stacked leaf with the same problem in every layer is named once, without an index. Meant for the
        first step (unused parameters, broken graphs) and for steps the loop saw skipped.
        """
        packed = self._check(packed)
        problems, row = [], 0
        for name, s, n in self.leaves:
            block = packed[row:row + n]
            row += n
            bad = [i for i in range(n) if block[i, 0] > 0]
            zero = [i for i in range(n) if block[i, 1] > 0]
            if bad:
                text = f"{int(block[bad, 0].sum())} non-finite gradient values"
                problems += _name_rows(name, s, n, bad, text, [f"{int(block[i, 0])} non-finite gradient values"
                                                               for i in bad])
            if zero:
                problems += _name_rows(name, s, n, zero, "gradient is exactly zero",
                                       ["gradient is exactly zero"] * len(zero))
        return problems

    def tag(self, column: str, row: int) -> str:
        name, i = self.rows[row]
        return f"health/{column}/{name}" + ("" if i is None else f"/{i}")

    def to_scalars(self, packed, columns: Iterable[str] = COLUMNS) -> dict[str, float]:
        """``{"health/grad_norm/layers.attn.wq/3": value, ...}`` for TensorBoard, plus ``health/clip/ratio``
        (global grad norm / ``clip_norm``) and ``health/clip/clipped`` (1.0 when the global clip scaled
        the gradients: ``norm + 1e-6 > clip_norm``, torch's rule) when ``clip_norm`` was given."""
        table = self._check(packed).tolist()   # one conversion, not one per entry
        cols = [COLUMNS.index(c) for c in columns]
        out = {self.tag(COLUMNS[c], r): float(table[r][c]) for r in range(len(self.rows)) for c in cols}
        if self.clip_norm is not None:
            norm = float(table[-1][2])
            out["health/clip/ratio"] = norm / self.clip_norm
            out["health/clip/clipped"] = float(norm + 1e-6 > self.clip_norm)
        return out

    def histograms(self, packed) -> dict[str, torch.Tensor]:
        """``{"health/<column>": values over all tensors and layer slices}`` (the global row and
        non-finite values left out, since histograms cannot bin them; the ``nonfinite`` column counts them).
        A column with no finite value at all (a diverged step) has no histogram."""
        packed = self._check(packed)[:-1]
        out = {}
        for c, column in enumerate(COLUMNS):
            values = packed[:, c]
            finite = values[torch.isfinite(values)].float()
            if finite.numel():
                out[f"health/{column}"] = finite
        return out

    def global_stats(self, packed) -> dict[str, float]:
        """The ``global`` row as ``{column: value}``."""
        packed = self._check(packed)
        return {c: float(packed[-1, i]) for i, c in enumerate(COLUMNS)}


def _name_rows(name: str, stacked: bool, n: int, hit: list[int], whole: str, each: list[str]):
    """One entry for an unstacked leaf or a stacked leaf hit in every layer, else one per layer."""
    if not stacked:
        return [(name, whole)]
    if len(hit) == n:
        return [(name, f"{whole} in all {n} layers")]
    return [(f"{name}[{i}]", text) for i, text in zip(hit, each)]
