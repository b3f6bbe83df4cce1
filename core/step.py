"""Pure train and eval steps: ``train_step(state, batch) -> (state, metrics)`` (Flax's ``train_step``).

``make_train_step(loss_fn, optimizer)`` builds the step from a loss over a params pytree:

    loss_fn(params, batch[, key=...][, frozen=...]) -> loss  or  (loss, aux: dict of 0-d tensors)

``key`` (if the loss takes it) is a per-step RNG key for dropout; ``frozen`` (if it takes it) is a pytree
of tensors that are inputs but not trained (a teacher, frozen layers): ``train_step(state, batch, frozen)``
passes it through as a graph input rather than a baked-in constant.

Two gradient engines (``core.gradients``, public pieces of their own) give the same numbers (tested):

- ``Gradients(mode="func")``: ``torch.func.grad_and_value`` inside one function, so forward, backward,
  clipping, the optimizer and the skip logic compile into a single ``fullgraph`` graph (the default of a
  compiled step with ``Compile(scope="step")``).
- ``Gradients(mode="autograd")``: the loss is compiled on its own, ``torch.autograd.grad`` runs outside it,
  and the update is compiled on its own. This is the path for what ``func.grad`` cannot do today,
  activation checkpointing above all (pytorch/pytorch#122729), and the default of an eager step, whose peak
  memory is lower through ``torch.autograd`` than through ``func.grad`` (``recipe=bench.step``; docs/design.md,
  'The step'). Compiled, it peaks lower too: AOTAutograd splits the loss's forward from its backward with its
  min-cut partitioner, which recomputes cheap activations (a norm's output, SwiGLU's product, RoPE'd keys) in the
  backward, where the one graph of ``func`` keeps every one the backward reads until it is read (inductor plans
  an inference graph's buffers but recomputes nothing across its matmuls).

``Compile(scope="step")`` compiles as above; ``"block"`` compiles the model's repeated block once for all
its layers (``core.compile.BlockCompiler``, handed to the model as ``core.layers.Layers``: regional compilation,
so compile time does not grow with depth; the loss must take ``layers`` and pass it to the model) and
the update on its own, with gradients through ``torch.autograd``: ``func.grad`` cannot trace a compiled
region on torch 2.13 (pytorch/pytorch ``nested_compile_region`` under ``torch.func``).

Inside the step: micro-batches (``Gradients(accum=)``; the batch has a leading micro-batch axis) are averaged;
``bf16``/``fp16`` run the loss under autocast with fp32 master weights; fp16 multiplies the loss by the
dynamic loss scale and unscales the gradients before anything reads them; a non-finite loss or gradient
norm leaves params, optimizer state and the data cursor's meaning untouched through ``torch.where``
(the step counter still advances, ``metrics["skipped"]`` says so). Metrics are 0-d tensors: the host
pulls them when it logs, never per step.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from purestep.core import rng
from purestep.core.compile import BlockCompiler, cpp_wrapper, maybe_compile
from purestep.core.donate import donate as donated, owned
from purestep.core.layers import check_takes_layers, layers_of
from purestep.core.state import TrainState
from purestep.core.tree import leaves_of
from purestep.core.gradients import (autocast, autograd_gradients, averaged_over_ranks, func_gradients, loss_caller,
                            make_objective, sharded_block_gradients)
from purestep.core.update import Monitors, apply_gradients, apply_in_place

GRAD_MODES = ("func", "autograd")
COMPILE_SCOPES = ("step", "block")


def per_block(shard, compile: bool, compile_scope: str = "step", grad_mode: Optional[str] = None) -> bool:
    """Whether a step over sharded params (``shard``) gathers them one block at a time (``core.parallel.shard_blocks``):
    on the autograd path when the model's loop runs in Python (eager, or ``compile_scope="block"``); a one-graph
    compiled step gathers them whole."""
    one_graph = compile and compile_scope != "block"
    return shard is not None and not one_graph and grad_mode != "func"


def _make_apply_gradients(optimizer, monitors: Monitors, donate: bool, shard, device_type: str,
                          eager: bool) -> Callable:
    """``apply(state, grads, loss, aux, due=None) -> (state, metrics)``: :func:`core.update.apply_gradients` with
    this step's optimizer and monitors, on DTensor views of the shards under ``shard``
    (``core.parallel.shard.Layout.on_dtensors``), donated from outside (``core.donate.donate``) when ``donate`` (a
    function of its own: the autograd paths compile it). An eager donated step whose optimizer carries an in-place
    step (``optimizer.in_place``: ``optim.fused``) runs :func:`core.update.apply_in_place` instead: the one place
    an eager step updates in place."""
    update = apply_in_place if donate and eager and getattr(optimizer, "in_place", None) else apply_gradients

    def apply(state: TrainState, grads, loss, aux, due: Optional[bool] = None):
        return update(state, grads, optimizer, loss=loss, aux=aux, monitors=monitors, due=due)

    apply = apply if shard is None else shard.on_dtensors(apply, device_type)
    return donated(apply) if donate and update is apply_gradients else apply


class HostDue:
    """``extra_metrics.due`` (optim.health) asked on the host where the update is its own graph or eager: a Python
    bool, so a compiled update has one graph with the metrics and one without (the one graph decides inside with
    ``torch.cond``: the host cannot branch it without a second compile of the whole step). The step count is known
    on the host when ``state.step`` is the tensor the step last returned, unchanged since (the same object, the
    same version counter), and read once otherwise (a resumed or rolled-back state): on CUDA ``int(state.step)``
    every step would wait for the previous step's kernels."""

    def __init__(self, due: Callable):
        self.due, self.ref, self.version, self.value, self.next = due, None, -1, 0, 0

    def __call__(self, step: torch.Tensor) -> bool:
        known = self.ref is not None and self.ref() is step and step._version == self.version
        self.next = (self.value if known else self.read(step)) + 1
        return bool(self.due(self.next))

    @staticmethod
    def read(step: torch.Tensor) -> int:
        return int(step)

    def returned(self, step: torch.Tensor) -> None:
        self.ref, self.version, self.value = weakref.ref(step), step._version, self.next


def _loss_scale(state: TrainState) -> torch.Tensor:
    if state.loss_scale:
        return state.loss_scale["scale"]
    return torch.ones((), device=state.step.device)


def _grad_mode(grad_mode: Optional[str], compile: bool, compile_scope: str, remat: bool, grad_accum: int) -> str:
    """How :func:`make_train_step` differentiates (``GRAD_MODES``), its arguments checked."""
    if compile_scope not in COMPILE_SCOPES:
        raise ValueError(f"unknown compile_scope {compile_scope!r}; choose one of {', '.join(COMPILE_SCOPES)}")
    by_block = compile and compile_scope == "block"
    if grad_mode is None:
        grad_mode = "func" if compile and not (remat or by_block) else "autograd"
    if grad_mode not in GRAD_MODES:
        raise ValueError(f"unknown grad_mode {grad_mode!r}; choose one of {', '.join(GRAD_MODES)}")
    if grad_mode == "func" and (remat or by_block):
        what = "remat" if remat else "Compile(scope='block')"
        raise ValueError(f"Gradients(mode='func') cannot run with {what}: torch.func.grad takes neither activation "
                         f"checkpointing nor a compiled region; use mode='autograd' or None")
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    return grad_mode


@dataclass(frozen=True)
class Gradients:
    """How a step differentiates its loss. ``mode``: ``"func"`` (``torch.func.grad_and_value`` inside the one
    graph), ``"autograd"`` (``torch.autograd``; what activation checkpointing needs; compiled, the loss's forward
    and backward split by AOTAutograd, a lower peak: module docstring), None: ``func`` when the step compiles as one
    graph without ``remat``, else ``autograd``. ``accum`` micro-batches (every batch leaf has a
    leading axis of that size) are summed into one update. ``remat``: the loss checkpoints its activations."""
    mode: Optional[str] = None
    accum: int = 1
    remat: bool = False


@dataclass(frozen=True)
class Compile:
    """``torch.compile`` applied to the step from outside it (``core.compile``). ``scope``: what one graph covers
    (``COMPILE_SCOPES``, module docstring); ``mode``: ``torch.compile``'s ``mode``. ``compile=True`` is
    ``Compile()``; ``Compile(enabled=False)`` leaves the step eager. ``cuda_options``: further inductor ``(name,
    value)`` settings for the step's graphs on CUDA (``core.compile.inductor_options``; ``NO_MIX_ORDER_REDUCTION`` for
    a step that runs Muon)."""
    enabled: bool = True
    scope: str = "step"
    mode: str = "default"
    cuda_options: tuple = ()


@dataclass(frozen=True)
class Parallel:
    """Data parallelism the step composes: ``reduce(list of tensors) -> list`` averages the gradients, loss and aux
    across ranks before the update (``core.parallel.distributed.Dist.all_reduce_mean``); ``shard`` (a
    ``core.parallel.shard.Layout``) says the state's params and optimizer state are this rank's shards: the step
    gathers the params (one block at a time where :func:`per_block` says so, else whole), reduce-scatters the summed
    gradients once per step and updates the shards (``reduce`` is then unused), the optimizer and the extra metrics
    seeing them as DTensors (``Layout.on_dtensors``): written for whole tensors, they take no collective. A layout
    built with a ``core.parallel.tensor.TensorParallel`` (``Layout(tensor=)``, ``parallel=fsdp,tp``) also runs every
    block of the model tensor parallel on DTensors (``TensorParallel.block``, through the loss's ``layers``), on the
    autograd path, eager or with ``Compile(scope="block")``. ``frozen_shards`` (``{name: layout}``): those frozen
    inputs of the step are this rank's shards under their layout (a sharded teacher, ``teacher_shard=true``): gathered
    one block at a time as the loss runs their layers where the params are, else whole before each step."""
    reduce: Optional[Callable] = None
    shard: Any = None
    frozen_shards: dict = field(default_factory=dict)


def _tensor_parallel(shard, compile: Compile, grad_mode: Optional[str]):
    """The ``TensorParallel`` of the layout ``shard`` (None without one), or a ValueError for what tensor
    parallelism cannot run with: ``torch.func.grad`` (it cannot take DTensors) and so a step compiled as one graph."""
    tensor = getattr(shard, "tensor", None)
    if tensor is None:
        return None
    if grad_mode == "func":
        raise ValueError("tensor parallel runs on the autograd path: torch.func.grad cannot take DTensors")
    if compile.enabled and compile.scope != "block":
        raise ValueError('tensor parallel compiles the model\'s block (Compile(scope="block")), not the whole step')
    return tensor


def _block_runner(compiler: Optional[Callable], tensor) -> Optional[Callable]:
    """What the model's ``layers.block`` applies to its block function: the step's block compiler, run tensor
    parallel under ``tensor`` (the compiled block takes the DTensors)."""
    if tensor is None:
        return compiler
    if compiler is None:
        return tensor.block
    return lambda fn: tensor.block(compiler(fn))


def make_train_step(loss_fn: Callable, optimizer, *, precision: str = "fp32", compile: bool | Compile = False,
                    donate: bool = False, gradients: Gradients = Gradients(), monitors: Monitors = Monitors(),
                    parallel: Parallel = Parallel()) -> Callable:
    """Build ``train_step(state, batch, frozen=None) -> (state, metrics)``: the composition of the pieces (a
    gradient engine, ``core.update.apply_gradients``, the data-parallel reduction or sharding, donation and compile
    applied around them). It runs where the state lives (its ``step`` tensor's device type, built on first use).

    ``precision``: ``fp32``, or ``bf16``/``fp16`` autocast over fp32 master weights (fp16 with the state's dynamic
    loss scale). ``monitors`` (``core.update.Monitors``): the extra metrics (gradient health), the spike detector and
    the non-finite skip. Extra metrics with a ``due(step)`` method are asked on the host where the update runs
    apart from the backward or eagerly (``compile_scope="block"``, eager: ``HostDue``); the one-graph compiled step
    passes ``step=`` and lets them decide inside. ``donate=True``
    lets the step write the new params and optimizer state into the state it is given (``core.donate``: JAX's buffer
    donation; the same numbers, a lower peak); the caller must not read the old state again. The default keeps the
    step pure: research code may branch several steps from one state. On the CPU a step without collectives
    compiles with inductor's C++ wrapper (``core.compile``).
    """
    compile = compile if isinstance(compile, Compile) else Compile(enabled=bool(compile))
    tensor = _tensor_parallel(parallel.shard, compile, gradients.mode)
    grad_mode = _grad_mode(gradients.mode, compile.enabled, compile.scope, gradients.remat, gradients.accum)
    by_layer = per_block(parallel.shard, compile.enabled, compile.scope, grad_mode)
    check_takes_layers(loss_fn, compile.enabled and compile.scope == "block",
                       by_layer and parallel.shard.stacks or tensor is not None)
    built = {}   # device type -> the step built for it

    def train_step(state: TrainState, batch, frozen=None):
        kind = state.step.device.type
        if kind not in built:
            built[kind] = _train_step(loss_fn, optimizer, kind, precision, compile, donate, gradients, grad_mode,
                                      monitors, parallel)
        return built[kind](state, batch, frozen)

    return train_step


def _train_step(loss_fn, optimizer, device_type: str, precision: str, compile: Compile, donate: bool,
                gradients: Gradients, grad_mode: str, monitors: Monitors, parallel: Parallel) -> Callable:
    """:func:`make_train_step`'s step on ``device_type``."""
    shard, accum = parallel.shard, gradients.accum
    by_block = compile.enabled and compile.scope == "block"
    cpp = cpp_wrapper(device_type, collectives=shard is not None or parallel.reduce is not None)
    tensor = getattr(shard, "tensor", None)
    cache = tensor is None     # core.compile.inductor_options: graphs over a 2-D mesh are not cached
    compiled = functools.partial(maybe_compile, mode=compile.mode, cpp=cpp, device_type=device_type,
                                 cuda=compile.cuda_options, cache=cache)
    by_layer = per_block(shard, compile.enabled, compile.scope, grad_mode)
    compiler = BlockCompiler(compile.mode, cpp, device_type, cache) if by_block else None
    objective = make_objective(loss_caller(loss_fn), accum, precision, device_type, _block_runner(compiler, tensor),
                               head=compiler)
    apply = _make_apply_gradients(optimizer, monitors, donate, shard, device_type, eager=not compile.enabled)
    if grad_mode == "func":      # one graph: forward, backward, the update
        engine = func_gradients(objective, accum)
    elif by_layer:               # sharded: each block's params gathered when it runs, its gradients reduce-scattered
        engine = sharded_block_gradients(objective, accum, shard, parallel.frozen_shards)
        apply = compiled(apply, compile.enabled)
    else:                        # the loss and the update compiled apart, autograd between them
        one_graph = compile.enabled and not by_block
        engine = autograd_gradients(compiled(objective, one_graph, fullgraph=False), accum, by_row=not one_graph)
        apply = compiled(apply, compile.enabled)
    if not by_layer:             # data parallel applied around the gradients: averaged, or gathered and scattered
        engine = shard.around(engine) if shard is not None else averaged_over_ranks(engine, parallel.reduce)
    extra = monitors.extra_metrics
    one_graph = grad_mode == "func" and compile.enabled   # decides inside with torch.cond; elsewhere the host does
    host_due = HostDue(extra.due) if getattr(extra, "due", None) and not one_graph else None

    def train_step(state: TrainState, batch, frozen=None):
        key = rng.fold_in(state.key, state.step)
        due = None if host_due is None else host_due(state.step)
        grads, loss, aux = engine(state.params, batch, key, frozen, _loss_scale(state))
        new, metrics = apply(state, grads, loss, aux, due=due)
        if host_due is not None:
            host_due.returned(new.step)
        return new, metrics

    step = compiled(train_step, compile.enabled) if grad_mode == "func" else train_step
    if donate:
        step = _donating(step)
    return step if by_layer or not parallel.frozen_shards else _frozen_gathered(step, parallel.frozen_shards)


def _donating(step: Callable) -> Callable:
    return lambda state, batch, frozen=None: step(owned(state, frozen), batch, frozen)


def _frozen_gathered(step: Callable, frozen_shards: dict) -> Callable:
    """``step`` taking the frozen inputs ``frozen_shards`` names as this rank's shards: each gathered whole first
    (``core.parallel.shard.Layout.gather``), for a step that does not gather them block by block."""
    def gathered(state, batch, frozen=None):
        whole = {name: layout.gather(frozen[name]) for name, layout in frozen_shards.items()}
        return step(state, batch, {**frozen, **whole})
    return gathered


def make_eval_step(loss_fn: Callable, *, precision: str = "fp32", compile: bool | Compile = False,
                   shard=None) -> Callable:
    """``eval_step(params, batch, frozen=None) -> metrics`` (no gradients, no dropout), run where ``params`` live.
    ``shard`` (a ``core.parallel.shard.Layout``): ``params`` are this rank's shards, gathered block by block where
    :func:`per_block` says so, else whole before the step; every block tensor parallel where the layout is
    (``Layout.tensor``)."""
    compile = compile if isinstance(compile, Compile) else Compile(enabled=bool(compile))
    tensor = _tensor_parallel(shard, compile, None)
    by_layer = per_block(shard, compile.enabled, compile.scope)
    check_takes_layers(loss_fn, compile.enabled and compile.scope == "block",
                       by_layer and shard.stacks or tensor is not None)
    built = {}   # device type -> the step built for it

    def eval_step(params, batch, frozen=None):
        kind = next((t.device.type for t in leaves_of(params) if isinstance(t, torch.Tensor)), "cpu")
        if kind not in built:
            built[kind] = _eval_step(loss_fn, kind, precision, compile, shard)
        return built[kind](params, batch, frozen)

    return eval_step


def _eval_step(loss_fn, device_type: str, precision: str, compile: Compile, shard) -> Callable:
    """:func:`make_eval_step`'s step on ``device_type``."""
    call = loss_caller(loss_fn)
    by_block = compile.enabled and compile.scope == "block"
    by_layer = per_block(shard, compile.enabled, compile.scope)
    cpp = cpp_wrapper(device_type, collectives=shard is not None)
    tensor = getattr(shard, "tensor", None)
    compiler = BlockCompiler(compile.mode, cpp, device_type, tensor is None) if by_block else None
    blocks = _block_runner(compiler, tensor)

    def eval_step(params, batch, frozen=None):
        with torch.no_grad(), autocast(precision, device_type):
            if by_layer:
                gathering = shard.blocks(params, train=False)
                with gathering.running() as full:
                    loss, aux = call(full, batch, None, frozen, layers_of(gathering.unstack, blocks, compiler))
            else:
                loss, aux = call(params, batch, None, frozen, layers_of(None, blocks, compiler))
        return {"loss": loss, **aux}

    step = maybe_compile(eval_step, compile.enabled and not by_block, mode=compile.mode, cpp=cpp,
                         device_type=device_type)
    if shard is None or by_layer:
        return step
    return lambda params, batch, frozen=None: step(shard.gather(params), batch, frozen)
