"""The distillation student (``recipe=distill student=``): a fresh Llama of the ``model.*`` shape (``config``), the
teacher with every other layer kept (``drop_layers``: DistilBERT, Sanh et al. 2019), the teacher's architecture with
narrower ``model.*`` widths (``shrink``), or ``init=CHECKPOINT``; ``StudentModel`` is the ``model.*`` section, every
field unset unless given."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import replace
from typing import Optional

from purestep.core.config import UserError, option
from purestep.core.tree import cast, tree_map
from purestep.models import llama
from purestep.models.loading import LoadedModel, load_model, require_llama
from purestep.recipes.distill.hidden import PROJ
from purestep.recipes.distill.teacher import compute_view

STUDENTS = ("config", "drop_layers", "shrink")
THETA = "kd_temperature"          # the learnable temperature's logit in the params pytree (never the student's)
NOT_STUDENT = (THETA, PROJ)       # trained with the student, no part of it


def _optional_fields(cls, name: str, help_: str):
    """A copy of dataclass ``cls`` whose every field is ``X | None = None`` ("unset"), in the field's range."""
    hints = typing.get_type_hints(cls)

    def unset(f):
        bounds = f.metadata.get("range")
        return option(None, help_, **(bounds.keywords() if bounds is not None else {}))
    return dataclasses.make_dataclass(
        name, [(f.name, Optional[hints[f.name]], unset(f)) for f in dataclasses.fields(cls)])


StudentModel = _optional_fields(llama.LlamaConfig, "StudentModel",
                                "student shape (student=config: unset = LlamaConfig default; shrink: the teacher's)")


WIDTH_DEPENDENTS = {"head_dim": ("d_model", "n_heads"), "ffn_dim": ("d_model",)}


def build_student(cfg, teacher: LoadedModel, device) -> tuple[llama.LlamaConfig, dict, str]:
    """``(config, params, description)`` of the student (without the temperature parameter)."""
    vocab = teacher.config.vocab_size
    overrides = {k: v for k, v in dataclasses.asdict(cfg.model).items() if v is not None}
    if overrides.pop("vocab_size", vocab) != vocab:
        raise UserError(f"model.vocab_size={cfg.model.vocab_size}: the student shares the teacher's "
                        f"vocabulary ({vocab}); leave it unset")
    if cfg.init:
        if cfg.student != "config" or overrides:
            raise UserError("init=PATH starts the student from that checkpoint: leave student= and model.* unset")
        start = require_llama(load_model(cfg.init, device=device), "init", "distill")
        if start.config.vocab_size != vocab:
            raise UserError(f"init={cfg.init}: its vocabulary ({start.config.vocab_size}) differs from the "
                            f"teacher's ({vocab})")
        return start.config, {k: v for k, v in start.params.items() if k not in NOT_STUDENT}, \
            f"from {start.source} ({start.format})"
    if cfg.student == "drop_layers":
        if overrides:
            raise UserError(f"student=drop_layers copies the teacher's shape; model.* keys "
                            f"({', '.join(sorted(overrides))}) apply to student=config or shrink")
        return _drop_layers(teacher, device)
    try:
        if cfg.student == "config":
            scfg, how = llama.LlamaConfig(**{**overrides, "vocab_size": vocab}), "fresh, model.* shape"
        else:
            scfg, how = _shrink(teacher.config, overrides), "fresh, the teacher's architecture with model.* widths"
    except ValueError as e:
        raise UserError(f"student={cfg.student}: {e}") from None
    return scfg, llama.init(scfg, cfg.seed, device=device), how


def _drop_layers(teacher: LoadedModel, device):
    """Every other teacher layer (0, 2, 4, ...) with the teacher's embeddings and norms (DistilBERT's init)."""
    n = teacher.config.n_layers
    keep = list(range(0, n, 2))
    weights = compute_view(teacher.params)   # a bf16 teacher still gives an fp32 student
    layers = tree_map(lambda w: w[keep].clone(), weights["layers"])
    params = {**{k: v.clone() for k, v in weights.items() if k != "layers"}, "layers": layers}
    return (replace(teacher.config, n_layers=len(keep)), cast(params, device=device),
            f"teacher layers 0, 2, ..., {keep[-1]} ({len(keep)} of {n}), initialized from their weights")


def _shrink(tcfg: llama.LlamaConfig, overrides: dict) -> llama.LlamaConfig:
    """The teacher's config with ``overrides``; head/MLP widths and KV heads follow new widths unless set."""
    base = dataclasses.asdict(tcfg)
    for derived, inputs in WIDTH_DEPENDENTS.items():
        if derived not in overrides and any(k in overrides for k in inputs):
            base[derived] = 0                          # recomputed from the new widths by LlamaConfig
    if "n_heads" in overrides and "n_kv_heads" not in overrides:
        base["n_kv_heads"] = max(1, overrides["n_heads"] // (tcfg.n_heads // tcfg.n_kv_heads))   # same grouping
    return llama.LlamaConfig(**{**base, **overrides})
