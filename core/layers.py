"""How a model runs its stacked layers, handed to it by whoever runs it: :class:`Layers`.

A model whose params stack its blocks along a leading layer axis (``models.llama``; Flax ``nn.scan``) loops over
``layers.unstack(params["layers"])`` and calls ``layers.block(block_fn)`` for each layer. The plain run (``None``,
or ``Layers()``) is ``core.tree.unstack`` (one ``torch.unbind``) and the block function itself. The train and eval
steps (``core.step``) apply what they own from outside the model, as torchtitan's ``apply_compile`` and
``fully_shard`` are applied to each ``TransformerBlock`` from outside it:

- ``block``: under ``compile_scope="block"`` the step's ``core.compile.BlockCompiler``, so every layer runs one
  compiled graph of the block (regional compilation);
- ``head``: the same compiler for the loss tail (``models.llama.head_loss``: final norm, output head, cross
  entropy), a graph of its own, as torchtitan compiles its loss beside the blocks;
- ``unstack``: on the eager autograd path the step's ``core.row_grads.RowGradients.unstack`` (each layer's
  gradients written into their rows as its backward ends); under ``parallel=fsdp`` run block by block,
  ``core.parallel.shard_blocks.Blocks.unstack`` (each layer gathered from the ranks' shards when the loop reaches it).

A loss function gets it from the step when it takes a ``layers`` keyword
(``loss_fn(params, batch[, key=][, frozen=][, layers=])``) and passes it on to the model, and to a frozen teacher's
forward too: a step's source hands out only the layers of the tree it owns and unbinds any other, and its
compiler keeps one compiled callable per block function (a teacher of another width adds a graph to it). A step that compiles the block or gathers the layers per
block refuses a loss that does not take ``layers`` (:func:`check_takes_layers`); on the autograd path such a loss
runs with ``unbind`` (the same numbers, the stacked gradients held whole until backward ends).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional

from purestep.core.tree import unstack


def _itself(fn: Callable) -> Callable:
    return fn


@dataclass(frozen=True)
class Layers:
    """``unstack(tree) -> layers' trees``, ``block(fn) -> the function each layer calls`` and ``head(fn) -> the
    function the loss tail calls`` (module docstring)."""
    unstack: Callable = unstack
    block: Callable = _itself
    head: Callable = _itself


def layers_of(unstack: Optional[Callable] = None, block: Optional[Callable] = None,
              head: Optional[Callable] = None) -> Optional[Layers]:
    """:class:`Layers` of what is given (the plain run's for the rest), or None (the plain run) when nothing is."""
    if unstack is None and block is None and head is None:
        return None
    return Layers(unstack or Layers.unstack, block or Layers.block, head or Layers.head)


def takes_layers(loss_fn: Callable) -> bool:
    """Whether ``loss_fn`` takes the ``layers`` keyword (a :class:`Layers` for its model)."""
    return "layers" in inspect.signature(loss_fn).parameters


def check_takes_layers(loss_fn: Callable, compiled_block: bool, gathered: bool) -> None:
    """A ValueError unless ``loss_fn`` takes ``layers`` where a step must hand it to the model: it compiles the
    model's block (``compiled_block``) or gathers the stacked layers' shards one layer at a time (``gathered``)."""
    if not (compiled_block or gathered) or takes_layers(loss_fn):
        return
    why = ('compile_scope="block" compiles the model\'s block from outside the model' if compiled_block else
           "a sharded step run block by block (parallel=fsdp) gathers each layer when the model reaches it")
    raise ValueError(f"{why}: the loss function must take a 'layers' keyword and pass it to the model, e.g. "
                     f"def loss_fn(params, batch, layers=None): return llama.loss(params, batch, cfg, layers=layers) "
                     f"(core.layers)")
