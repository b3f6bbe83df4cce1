"""Deliberate faults for testing stability machinery: bad batches and a NaN loss, tied to the data.

``fault.inject_spike_at=S`` replaces the batches read at steps S .. S+spike_length-1 of an
uninterrupted run with uniformly random tokens (garbage data: a loss spike and large gradients);
``fault.inject_nan_at=S`` makes the loss of the batch read at step S NaN. Faults are keyed by the data
cursor, like real bad data: a rollback that skips past those batches never sees them again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from purestep.core.config import option
from purestep.core.layers import takes_layers
from purestep.core.gradients import loss_caller


@dataclass
class FaultConfig:
    inject_spike_at: int = option(0, "replace the batches of steps S.. with random tokens (0: off)", min=0)
    spike_length: int = option(5, "how many consecutive batches inject_spike_at corrupts", min=1)
    inject_nan_at: int = option(0, "make the loss of the batch of step S NaN (0: off)", min=0)

    @property
    def active(self) -> bool:
        return self.inject_spike_at > 0 or self.inject_nan_at > 0


class FaultyBatches:
    """Wraps a batch source (``get(cursor)``); every batch gains a ``loss_multiplier`` (1 or NaN)."""

    def __init__(self, batches, fault: FaultConfig, vocab_size: int, seed: int = 0):
        self.batches, self.fault, self.vocab_size, self.seed = batches, fault, vocab_size, seed

    def get(self, cursor: int) -> dict:
        batch = dict(self.batches.get(cursor))
        f = self.fault
        step = cursor + 1
        if f.inject_spike_at and f.inject_spike_at <= step < f.inject_spike_at + f.spike_length:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + cursor)
            batch = {k: torch.randint(0, self.vocab_size, v.shape, generator=g).to(v.device) for k, v in batch.items()}
        nan = f.inject_nan_at == step
        batch["loss_multiplier"] = torch.tensor(float("nan") if nan else 1.0, device=batch["x"].device)
        return batch


def with_faults(loss_fn):
    """``loss_fn`` (any signature ``core.step`` accepts) scaled by ``batch["loss_multiplier"]`` (present
    only when faults are configured); it takes ``layers`` (``core.layers``) when ``loss_fn`` does."""
    call = loss_caller(loss_fn)

    def loss(params, batch, key=None, frozen=None, layers=None):
        out, aux = call(params, batch, key, frozen, layers)
        return out * batch["loss_multiplier"], aux

    if takes_layers(loss_fn):
        return loss
    return lambda params, batch, key=None, frozen=None: loss(params, batch, key, frozen)
