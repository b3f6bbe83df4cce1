"""optim: optax-shaped gradient transformations for PyTorch pytrees (see ``optim.base``)."""
from purestep.optim.adagc import AdaGCState, adagc, adagc_metrics
from purestep.optim.adamw import adamw, scale_by_adam
from purestep.optim.agc import agc
from purestep.optim.fused import FusedAdamW, fused_adamw
from purestep.optim.base import (EmptyState, GradientTransformation, apply_updates, chain, find_state, identity,
                        partition, replace_states)
from purestep.optim.clip import clip_by_global_norm
from purestep.optim.health import GradientHealth
from purestep.optim.common import (add_decayed_weights, base_lr, current_lr, decay_mask, scale_by_learning_rate,
                          scale_lr)
from purestep.optim.lion import lion, scale_by_lion
from purestep.optim.muon import muon, muon_mask, orthogonalize, scale_by_muon
from purestep.optim.sgd import sgd, trace
from purestep.optim import schedules

__all__ = [
    "GradientTransformation", "EmptyState", "identity", "chain", "partition", "apply_updates", "find_state",
    "replace_states", "adamw", "scale_by_adam", "sgd", "trace", "lion", "scale_by_lion", "muon",
    "scale_by_muon", "muon_mask", "orthogonalize",
    "clip_by_global_norm", "add_decayed_weights", "scale_by_learning_rate", "current_lr", "base_lr",
    "scale_lr", "decay_mask", "schedules",
]
__all__ += ["adagc", "AdaGCState", "adagc_metrics", "agc", "GradientHealth", "fused_adamw", "FusedAdamW"]
