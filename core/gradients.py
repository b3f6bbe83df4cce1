"""Gradient engines: ``gradients(params, batch, key, frozen, scale) -> (grads, loss, aux)``, the first piece of a step.

A loss ``loss_fn(params, batch[, key=][, frozen=][, layers=]) -> loss or (loss, aux)`` becomes an objective
(:func:`make_objective`: autocast, the fp16 loss scale, the micro-batch mean), which an engine differentiates:

- :func:`func_gradients`: ``torch.func.grad_and_value`` (JAX's ``value_and_grad``), the engine of a one-graph step;
- :func:`autograd_gradients`: ``torch.autograd`` on leaves that require grad, for activation checkpointing and
  the block-compiled step (stacked leaves' gradients written layer by layer, ``core.row_grads``);
- :func:`sharded_block_gradients`: the autograd engine over this rank's shards, each block gathered when it runs
  and the gradients reduce-scattered (``core.parallel.shard_blocks``, FSDP's per-block gather).

:func:`averaged` is the data-parallel piece (DDP's gradient all-reduce). ``core.step.make_train_step`` composes
these with ``core.update.apply_gradients``; research code may call them directly (``tests/test_step.py``).
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Optional

import torch

from purestep.core import rng
from purestep.core.layers import layers_of
from purestep.core.row_grads import RowGradients
from purestep.core.tree import map_flat, tree_flatten, tree_map, tree_unflatten

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device_type: str):
    """The autocast context for ``precision`` (a no-op for fp32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown dtype {precision!r}; choose one of {', '.join(PRECISIONS)}")
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def loss_caller(loss_fn: Callable) -> Callable:
    """Normalize ``loss_fn`` to ``(params, batch, key, frozen, layers=None) -> (loss, aux)`` (``layers``: a
    ``core.layers.Layers`` for the model, passed when the loss takes it)."""
    sig = inspect.signature(loss_fn).parameters
    takes_key, takes_frozen, takes_layers = "key" in sig, "frozen" in sig, "layers" in sig

    def call(params, batch, key, frozen, layers=None):
        kwargs = {}
        if takes_key:
            kwargs["key"] = key
        if takes_frozen:
            kwargs["frozen"] = frozen
        if takes_layers:
            kwargs["layers"] = layers
        out = loss_fn(params, batch, **kwargs)
        return out if isinstance(out, tuple) else (out, {})

    return call


def micro_batches(batch, grad_accum: int):
    if grad_accum == 1:
        return [batch]
    leaves, spec = tree_flatten(batch)
    columns = [leaf.unbind(0) for leaf in leaves]
    if any(len(c) != grad_accum for c in columns):
        raise ValueError(f"grad_accum={grad_accum} needs every batch leaf to have a leading axis of that size")
    return [tree_unflatten(spec, [c[i] for c in columns]) for i in range(grad_accum)]


def _mean(values: list[torch.Tensor]) -> torch.Tensor:
    return values[0] if len(values) == 1 else torch.stack(values).mean()


def _mean_aux(auxes: list[dict]) -> dict:
    return {k: _mean([a[k] for a in auxes]) for k in auxes[0]} if auxes and auxes[0] else {}


def make_objective(call: Callable, grad_accum: int, precision: str, device_type: str,
                    blocks: Optional[Callable] = None, head: Optional[Callable] = None) -> Callable:
    """``objective(params, batch, key, frozen, scale, unstack=None) -> (scaled loss / grad_accum, (loss, aux))``; the
    model gets ``core.layers.Layers`` of ``blocks`` (a ``core.compile.BlockCompiler``: its block compiled), ``head``
    (the same for its loss tail) and ``unstack`` (its layers from the step's row gradients or gathered shards) where
    any is given."""
    def objective(params, batch, key, frozen, scale, unstack=None):
        with autocast(precision, device_type):
            loss, aux = call(params, batch, key, frozen, layers_of(unstack, blocks, head))
        loss = loss.to(torch.promote_types(loss.dtype, torch.float32))
        return loss * scale / grad_accum, (loss.detach(), aux)

    return objective


def func_gradients(objective: Callable, grad_accum: int) -> Callable:
    """``gradients(params, batch, key, frozen, scale) -> (grads, loss, aux)``: the gradients summed over the
    micro-batches, their mean loss and aux, through ``torch.func.grad_and_value`` (JAX's ``value_and_grad``): a pure
    function of its inputs, so forward, backward and the update trace into one graph."""
    grad_fn = torch.func.grad_and_value(objective, has_aux=True)

    def gradients(params, batch, key, frozen, scale):
        total, losses, auxes = None, [], []
        for i, micro in enumerate(micro_batches(batch, grad_accum)):
            grads, (_, (loss, aux)) = grad_fn(params, micro, rng.fold_in(key, i), frozen, scale)
            total = grads if total is None else tree_map(torch.add, total, grads)
            losses.append(loss)
            auxes.append(aux)
        return total, _mean(losses), _mean_aux(auxes)

    return gradients


def autograd_gradients(objective: Callable, grad_accum: int, by_row: bool = True) -> Callable:
    """:func:`func_gradients`'s result through ``torch.autograd`` on leaves that require grad (what activation
    checkpointing needs, pytorch/pytorch#122729); with
    ``by_row`` (the objective is not one compiled graph) the stacked leaves' gradients are written layer by layer
    (``core.row_grads``)."""
    def gradients(params, batch, key, frozen, scale):
        leaves, spec = tree_flatten(params)
        rows = RowGradients([p.detach().requires_grad_() for p in leaves])
        live_params = tree_unflatten(spec, rows.live)
        losses, auxes = [], []
        for i, micro in enumerate(micro_batches(batch, grad_accum)):
            obj, (loss, aux) = objective(live_params, micro, rng.fold_in(key, i), frozen, scale,
                                         rows.unstack if by_row else None)
            rows.backward(obj)
            losses.append(loss.detach())
            auxes.append({k: v.detach() for k, v in aux.items()})
        return tree_unflatten(spec, rows.gradients()), _mean(losses), _mean_aux(auxes)

    return gradients


def sharded_block_gradients(objective: Callable, grad_accum: int, shard, frozen_shards: Optional[dict] = None
                            ) -> Callable:
    """:func:`autograd_gradients` over this rank's shards (FSDP's per-block gather), the stacked layers gathered one
    block at a time
    (``core.parallel.shard_blocks``): this rank's gradient shards (reduce-scattered once per optimizer step), the loss
    and aux averaged over ranks. ``frozen_shards`` (``{name: layout}``): those frozen inputs are this rank's shards
    too (a sharded teacher), their layers gathered one block at a time as the objective runs them, and not
    differentiated."""
    def gradients(shards, batch, key, frozen, scale):
        blocks = shard.blocks(shards)
        micros = micro_batches(batch, grad_accum)
        total, losses, auxes = None, [], []
        for i, micro in enumerate(micros):
            with blocks.running(last=i == len(micros) - 1) as params, contextlib.ExitStack() as stack:
                inputs, others = dict(frozen or {}), []
                for name, layout in (frozen_shards or {}).items():
                    others.append(layout.blocks(inputs[name], train=False))
                    inputs[name] = stack.enter_context(others[-1].running())
                unstack = blocks.unstack_with(others) if others else blocks.unstack
                obj, (loss, aux) = objective(params, micro, rng.fold_in(key, i), inputs, scale, unstack)
            inputs = blocks.inputs()
            grads = torch.autograd.grad(obj, inputs, allow_unused=True)[:-1]     # the anchor's is None
            grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, inputs)]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
            losses.append(loss.detach())
            auxes.append({k: v.detach() for k, v in aux.items()})
        return blocks.finish(total, _mean(losses), _mean_aux(auxes))

    return gradients


def averaged_over_ranks(engine: Callable, reduce: Optional[Callable]) -> Callable:
    """``engine`` (``(...) -> (grads, loss, aux)``) with its results averaged across data-parallel ranks by
    ``reduce`` (:func:`averaged`); ``engine`` itself when ``reduce`` is None."""
    if reduce is None:
        return engine
    after = averaged(reduce)
    return lambda *args: after(*engine(*args))


def averaged(reduce: Optional[Callable]) -> Callable:
    """``reduced(grads, loss, aux)``: averaged across data-parallel ranks by ``reduce`` (DDP's all-reduce mean,
    ``core.parallel.distributed.Dist.all_reduce_mean``), or as they are when ``reduce`` is None."""
    def reduced(grads, loss, aux):
        if reduce is None:
            return grads, loss, aux
        return map_flat(reduce, (grads, loss, aux))

    return reduced
