"""Activation checkpointing of a model's block (Chen et al. 2016, arXiv 1604.06174): the block's activations are
not kept for backward but recomputed from its inputs, through ``torch.utils.checkpoint`` (non-reentrant).

One difference from calling ``torch.utils.checkpoint.checkpoint(block, params, x, ...)`` directly: the block's
params (a pytree) are handed to it as flat tensor arguments. ``torch.utils.checkpoint`` keeps a container argument
by reference until backward, but saves tensor arguments as saved tensors, which the saved-tensor hooks in force
see: so under ``parallel=fsdp`` a block's gathered params are not held from the forward to the recomputation but
gathered again for it (``core.parallel.shard_blocks``), as FSDP2 does with a checkpointed block.
"""
from __future__ import annotations

from typing import Callable

from torch.utils.checkpoint import checkpoint as torch_checkpoint

from purestep.core.tree import tree_flatten, tree_unflatten


def checkpoint(block: Callable, params, *args, **kwargs):
    """``block(params, *args, **kwargs)`` with its activations recomputed in backward."""
    leaves, spec = tree_flatten(params)
    n = len(leaves)

    def run(*flat, **kw):
        return block(tree_unflatten(spec, list(flat[:n])), *flat[n:], **kw)

    return torch_checkpoint(run, *leaves, *args, use_reentrant=False, **kwargs)
