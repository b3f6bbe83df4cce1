"""Applying gradients: ``apply_gradients(state, grads, optimizer, loss=...) -> (state, metrics)``.

Flax's ``TrainState.apply_gradients`` with the bookkeeping a training step does around the optimizer, each a piece
of its own that a step composes:

- :func:`scale_loss` and :func:`unscale`: fp16's loss multiplied by the dynamic loss scale (``core.loss_scale``, as
  ``torch.amp.GradScaler``) before the backward, its gradients divided by it before anything reads them;
  :func:`next_loss_scale` grows or backs the scale off;
- the global gradient norm and the finite check of the loss and that norm;
- ``optimizer.update`` (an optax-style ``GradientTransformation``, ``optim``) and ``core.tree.apply_updates``;
- :func:`if_finite`: optax's ``apply_if_finite`` as a select: a non-finite step leaves the params and the optimizer
  state as they were (``torch.where``, no host branch); the step counter still advances and ``metrics["skipped"]``
  says so;
- ``Monitors``: gradient health (``optim.health.GradientHealth`` or any ``extra_metrics(grads=, updates=, params=,
  new_params=)``) and the spike detector's statistics (``core.spike.update_monitor``), as metric functions.

Metrics are 0-d tensors (or small packed ones): the host pulls them when it logs, never per step. One code path,
compiled (``fullgraph=True``) or eager, with no host sync; donation (``core.donate``) and compilation wrap it from
outside.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from purestep.core.loss_scale import update_loss_scale
from purestep.core.spike import SpikeConfig, update_monitor
from purestep.core.state import TrainState
from purestep.core.tree import apply_updates, global_norm, leaves_of, tree_map, where


@dataclass(frozen=True)
class Monitors:
    """What a step watches besides its loss. ``extra_metrics``: gradient health (``optim.health``); with a
    ``due(step) -> bool`` method and a ``skipped(device)`` one it is computed only on due steps. ``spike``: the
    spike detector (``core.spike``; its state in ``state.monitor``, ``init_state(..., spike=True)``). ``skip``:
    a non-finite step leaves the state untouched (:func:`if_finite`); ``False`` writes its NaNs and saves the select
    (optax without ``apply_if_finite``; a run's ``skip_nonfinite=false``)."""
    extra_metrics: Optional[Callable] = None
    spike: Optional[SpikeConfig] = None
    skip: bool = True


def scale_loss(loss: torch.Tensor, loss_scale: dict) -> torch.Tensor:
    """``loss`` multiplied by the dynamic loss scale of ``loss_scale`` before the backward (fp16; unchanged, the same
    tensor, without one): its gradients are then ``scale`` times too large until :func:`unscale`."""
    scale = loss_scale.get("scale") if loss_scale else None
    return loss if scale is None else loss * scale.to(loss.dtype)


def unscale(grads, loss_scale: dict):
    """``grads`` divided by the dynamic loss scale of ``loss_scale`` (fp16; unchanged without one)."""
    scale = loss_scale.get("scale") if loss_scale else None
    return grads if scale is None else tree_map(lambda g: g / scale.to(g.dtype), grads)


def next_loss_scale(loss_scale: dict, finite: torch.Tensor) -> dict:
    """The loss scale after a step that was (or was not) ``finite``: ``core.loss_scale.update_loss_scale``."""
    return update_loss_scale(loss_scale, finite) if loss_scale else loss_scale


def if_finite(finite: torch.Tensor, new, old):
    """optax's ``apply_if_finite`` as a select: ``new`` where the step was finite, else ``old``, leaf by leaf."""
    return where(finite, new, old)


def apply_gradients(state: TrainState, grads, optimizer, *, loss: torch.Tensor, aux: Optional[dict] = None,
                    monitors: Monitors = Monitors(), due: Optional[bool] = None) -> tuple[TrainState, dict]:
    """The state after one optimizer step on ``grads`` (summed over micro-batches and averaged over ranks already),
    and the step's metrics: ``loss``, ``grad_norm``, ``skipped``, ``param_norm``, ``aux``, what the optimizer and
    ``monitors`` report. Sharded params and gradients come as DTensors (``core.parallel.shard.Layout.on_dtensors``),
    whose norms are whole-model; ``due`` (decided on the host, or None: in the graph or always) says whether the extra
    metrics run this step."""
    grads, grad_norm, finite, metrics = _checked(state, grads, loss, aux)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_params = apply_updates(state.params, updates)
    if getattr(optimizer, "metrics", None) is not None:   # what the transforms report: lr, clip activity
        metrics.update(optimizer.metrics(opt_state))
    metrics.update(extra_metrics(monitors.extra_metrics, state, grads, updates, new_params, grad_norm, due))
    monitor, loss_scale = _watched(state, loss, grad_norm, finite, monitors, metrics)
    keep_old = monitors.skip
    kept = if_finite(finite, new_params, state.params) if keep_old else new_params
    metrics["param_norm"] = global_norm(kept)   # of the params it keeps: one pass with the update
    new_state = TrainState(step=state.step + 1, params=kept,
                           opt_state=if_finite(finite, opt_state, state.opt_state) if keep_old else opt_state,
                           key=state.key, cursor=state.cursor + 1, loss_scale=loss_scale, monitor=monitor)
    return new_state, metrics


def apply_in_place(state: TrainState, grads, optimizer, *, loss: torch.Tensor, aux: Optional[dict] = None,
                   monitors: Monitors = Monitors(), due: Optional[bool] = None) -> tuple[TrainState, dict]:
    """:func:`apply_gradients` for an eager donated step whose optimizer writes its step into the state's tensors,
    ``optimizer.in_place(grads, opt_state, params, grad_norm=, finite=) -> metrics`` (``optim.fused``: torch's
    fused AdamW; the metrics are what ``optimizer.metrics`` reports of the pure update's new state): the same state
    and metrics, with ``state``'s params and optimizer state updated where they are (the caller
    gives ``state`` up, as with ``core.donate``) and ``grads`` given up too. On a step whose extra metrics run
    (gradient health) the old params and the gradients are copied first, so they read what the pure step gives
    them: the gradients, the old and new params and the update applied (``new - old``; 0 on a skipped step, where
    the pure step's update is the non-finite one it did not apply)."""
    grads, grad_norm, finite, metrics = _checked(state, grads, loss, aux)
    watched = monitors.extra_metrics is not None and due is not False
    before = tree_map(torch.clone, state.params) if watched else None
    metrics.update(optimizer.in_place(tree_map(torch.clone, grads) if watched else grads, state.opt_state,
                                      state.params, grad_norm=grad_norm, finite=finite if monitors.skip else None))
    if watched:
        updates = tree_map(torch.sub, state.params, before)
        metrics.update(extra_metrics(monitors.extra_metrics, state._replace(params=before), grads, updates,
                                     state.params, grad_norm, due))
    else:
        metrics.update(extra_metrics(monitors.extra_metrics, state, grads, None, None, grad_norm, due))
    monitor, loss_scale = _watched(state, loss, grad_norm, finite, monitors, metrics)
    metrics["param_norm"] = global_norm(state.params)
    return TrainState(step=state.step + 1, params=state.params, opt_state=state.opt_state, key=state.key,
                      cursor=state.cursor + 1, loss_scale=loss_scale, monitor=monitor), metrics


def _checked(state: TrainState, grads, loss: torch.Tensor, aux: Optional[dict]):
    """``(grads, grad_norm, finite, metrics)``: the gradients unscaled (before clipping or statistics read them),
    their global norm, whether the loss and that norm are finite, and the metrics that start every step."""
    grads = unscale(grads, state.loss_scale)
    grad_norm = global_norm(grads)
    finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
    return grads, grad_norm, finite, {"loss": loss, "grad_norm": grad_norm, "skipped": (~finite).float(),
                                      **(aux or {})}


def _watched(state: TrainState, loss: torch.Tensor, grad_norm: torch.Tensor, finite: torch.Tensor,
             monitors: Monitors, metrics: dict) -> tuple:
    """``(monitor, loss_scale)`` after this step: the spike detector's state and the next loss scale, their metrics
    added to ``metrics``."""
    monitor, spike_metrics = spike_statistics(state, loss, grad_norm, monitors.spike)
    metrics.update(spike_metrics)
    loss_scale = next_loss_scale(state.loss_scale, finite)
    if loss_scale:
        metrics["loss_scale"] = loss_scale["scale"]
    return monitor, loss_scale


def extra_metrics(metric_fn: Optional[Callable], state: TrainState, grads, updates, new_params,
                  grad_norm: torch.Tensor, due: Optional[bool] = None) -> dict:
    """``metric_fn``'s statistics of this step (gradient health), or what it reports when not ``due``. A
    ``metric_fn`` that says when it is due (``due``: optim.health) decides inside a graph when the host did not
    (``step=``, the count after this step)."""
    if metric_fn is None:
        return {}
    if due is False:      # the host said the extra metrics are not due (core.step.HostDue)
        return metric_fn.skipped(grad_norm.device)
    gated = getattr(metric_fn, "due", None) is not None
    when = {"step": state.step + 1} if gated and due is None else {}
    applied = new_params if rounds_updates(state.params) else None
    return metric_fn(grads=grads, updates=updates, params=state.params, new_params=applied, **when)


def spike_statistics(state: TrainState, loss: torch.Tensor, grad_norm: torch.Tensor,
                     spike: Optional[SpikeConfig]) -> tuple[dict, dict]:
    """The spike detector's next state and its metrics (``core.spike``); ``state.monitor`` as is when it is off."""
    if spike is None or not spike.enabled:
        return state.monitor, {}
    monitor = update_monitor(state.monitor, loss, grad_norm, state.step + 1, spike)
    return monitor, {"spike": monitor["hard"].float(), "z_loss": monitor["z_loss"], "z_grad": monitor["z_grad"]}


def rounds_updates(params) -> bool:
    """Whether storing an update in ``params`` can round it away (a leaf narrower than fp32). Extra metrics read what
    was applied, ``new_params - params``, except over fp32 params: there they read the updates (the same to fp32
    rounding), so a compiled donated update stores the new params once, where they belong, instead of writing them
    out for the metrics and copying them into the donated params."""
    return any(leaf.dtype not in (torch.float32, torch.float64) for leaf in leaves_of(params)
               if leaf.is_floating_point())
