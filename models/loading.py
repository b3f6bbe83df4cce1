"""Load a model (params, config, tokenizer) from a file, saying which format was detected.

Formats: a purestep checkpoint (``*.msgpack`` written by any recipe; its ``model`` entry records the
architecture and config, its ``tokenizer`` entry the tokenizer). Every recipe's ``init=``/``teacher=``
key goes through :func:`load_model`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from core import checkpoint as ckpt
from core.config import UserError, from_dict
from core.tokenizers import tokenizer_from_dict
from models import llama


@dataclass
class LoadedModel:
    params: dict
    config: llama.LlamaConfig
    tokenizer: Optional[Any]
    format: str          # what was detected, for the user
    source: str


def model_entry(cfg: llama.LlamaConfig) -> dict:
    """What a checkpoint stores under ``model`` so it can be loaded without the recipe's config."""
    return {"arch": "llama", "config": asdict(cfg)}


def load_model(path: str, device=None) -> LoadedModel:
    p = Path(path)
    if not p.exists():
        raise UserError(f"{path}: no such file or folder")
    if p.is_dir():
        found = ckpt.latest(p)
        if found is None:
            raise UserError(f"{path}: no purestep checkpoint in this folder")
        p = found
    return _load_purestep(p, device)


def _load_purestep(p: Path, device=None) -> LoadedModel:
    top = ckpt.load(p, device=device)
    model = top.get("model")
    if not isinstance(model, dict) or model.get("arch") != "llama":
        raise UserError(f"{p}: a purestep checkpoint without a Llama model entry (written by which recipe?)")
    cfg = from_dict(llama.LlamaConfig, model["config"])
    params = top["state"]["params"]
    tok = tokenizer_from_dict(top["tokenizer"]) if top.get("tokenizer") else None
    return LoadedModel(params, cfg, tok, f"purestep checkpoint (step {top['step']})", str(p))
