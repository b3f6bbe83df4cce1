"""The DBA student (``models/dba.py``) as a Hugging Face folder with its own modeling code (``trust_remote_code``).

transformers has no architecture with decoupled semantic / geometric keys, so the folder carries one, as
DeepSeek-V2 (MLA with decoupled RoPE, arXiv 2405.04434) ships ``configuration_deepseek.py`` and
``modeling_deepseek.py`` next to its ``config.json``: the two self-contained files of ``models/hf_remote/``
(torch + transformers only, written after transformers' ``models/llama/modeling_llama.py``) are copied verbatim
and ``config.json``'s ``auto_map`` points ``AutoConfig`` / ``AutoModelForCausalLM`` at them::

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

Tensor names are Llama's (``model.layers.N.input_layernorm.weight``, ``...mlp.gate_proj.weight``, ``model.norm``,
``lm_head`` absent when tied) with the attention's own: ``self_attn.{q_s,q_g,k_s,k_g,v,o}_proj.weight`` (and
``.bias`` of the first five with ``qkv_bias``; a projection of width 0 has no tensor). Configs the modeling file
cannot express are refused with a ``UserError``: RoPE scaling other than llama3 (a GGUF teacher's per-pair
``factors``), params whose attention leaves do not match the config (biases without ``qkv_bias`` or the reverse),
a head that contradicts ``tie_embeddings``.

A student with a per-layer KV budget (``DBAConfig.sem_dims`` / ``v_dims``) is written at its padded widths: the
modeling file has one sem_dim and v_dim for every layer, so the folder carries their max with each layer's dead dims
as zero rows/columns (the same function; its cache holds the padded widths), and ``config.json`` has no per-layer
widths.

The folder is written whole or not at all (``core.io.cache.build_folder``: a temporary sibling folder, fsynced,
then renamed into place). An existing folder is replaced only if it is empty or an earlier DBA export (its
``config.json`` says ``model_type: purestep_dba`` and it holds nothing but the files an export writes); anything
else is refused, so an export never deletes files it did not write.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from purestep.core.io.cache import build_folder
from purestep.core.config import UserError
from purestep.core.tree import flatten_dict
from purestep.models import hf
from purestep.models.dba import DBAConfig

REMOTE = Path(__file__).resolve().parent / "hf_remote"
CONFIG_FILE, MODELING_FILE = "configuration_purestep_dba.py", "modeling_purestep_dba.py"
MODEL_TYPE, ARCHITECTURE = "purestep_dba", "PurestepDBAForCausalLM"
AUTO_MAP = {"AutoConfig": "configuration_purestep_dba.PurestepDBAConfig",
            "AutoModelForCausalLM": "modeling_purestep_dba.PurestepDBAForCausalLM"}
EXPORT_FILES = {"config.json", "generation_config.json", hf.SINGLE_FILE, "tokenizer.json", "tokenizer_config.json",
                CONFIG_FILE, MODELING_FILE}
# purestep leaf under "layers.attn" -> (Hugging Face name inside "model.layers.N.", the width it needs > 0)
ATTN_NAMES = {"wq_s": ("self_attn.q_s_proj.weight", "sem_dim"), "wq_g": ("self_attn.q_g_proj.weight", "geo_dim"),
              "wk_s": ("self_attn.k_s_proj.weight", "sem_dim"), "wk_g": ("self_attn.k_g_proj.weight", "geo_dim"),
              "wv": ("self_attn.v_proj.weight", "v_dim"), "wo": ("self_attn.o_proj.weight", "v_dim")}
BIAS_NAMES = {"q_s_bias": ("self_attn.q_s_proj.bias", "sem_dim"), "q_g_bias": ("self_attn.q_g_proj.bias", "geo_dim"),
              "k_s_bias": ("self_attn.k_s_proj.bias", "sem_dim"), "k_g_bias": ("self_attn.k_g_proj.bias", "geo_dim"),
              "v_bias": ("self_attn.v_proj.bias", "v_dim")}


def layer_names(cfg: DBAConfig) -> dict[str, str]:
    """Our leaf under ``layers`` -> its Hugging Face name inside ``model.layers.N.`` (no zero-width projections)."""
    out = {k: v for k, v in hf.LAYER_NAMES.items() if not k.startswith("attn.")}
    attn = {**ATTN_NAMES, **(BIAS_NAMES if cfg.qkv_bias else {})}
    out.update({f"attn.{k}": name for k, (name, width) in attn.items() if getattr(cfg, width)})
    return out


def state_dict(params: dict, cfg: DBAConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensor names -> tensors (views of the stacked leaves, one per layer); no ``lm_head`` when tied."""
    flat = flatten_dict(params["layers"])
    out = {hf.TOP_NAMES["embed"]: params["embed"]}
    for i in range(cfg.n_layers):
        for ours, theirs in layer_names(cfg).items():
            out[f"model.layers.{i}.{theirs}"] = flat[ours][i]
    out[hf.TOP_NAMES["norm"]] = params["norm"]
    if "lm_head" in params:
        out[hf.TOP_NAMES["lm_head"]] = params["lm_head"]
    return out


def check_exportable(params: dict, cfg: DBAConfig) -> None:
    """A ``UserError`` naming what the remote modeling file could not compute as ``models.dba.apply`` does."""
    if not isinstance(cfg, DBAConfig):
        raise UserError(f"export_dba_hf exports the DBA student (a DBAConfig), got {type(cfg).__name__}: "
                        f"use models.hf.export_hf for a Llama")
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "factors":
        raise UserError("rope scaling given as per-pair factors (a GGUF teacher's rope_freqs) has no config.json "
                        "form the remote model reads: give the teacher's llama3 rope_scaling instead")
    if kind not in ("", "default", "llama3"):
        raise UserError(f"rope_scaling type {kind!r} is not supported by the exported model (default, llama3)")
    expected = set(ATTN_NAMES) | (set(BIAS_NAMES) if cfg.qkv_bias else set())
    found = set(params["layers"]["attn"])
    if found != expected:
        extra, missing = sorted(found - expected), sorted(expected - found)
        raise UserError(f"the attention params do not match the config (qkv_bias={cfg.qkv_bias}): "
                        + "; ".join(filter(None, [extra and f"unexpected {', '.join(extra)}",
                                                  missing and f"missing {', '.join(missing)}"])))
    if ("lm_head" in params) == cfg.tie_embeddings:
        has = "have" if "lm_head" in params else "lack"
        raise UserError(f"tie_embeddings={cfg.tie_embeddings} but the params {has} an lm_head")
    unknown = sorted(set(params) - {"embed", "layers", "norm", "lm_head"})
    if unknown:
        raise UserError(f"params hold {', '.join(unknown)}, which the exported model has no place for")


def config_to_hf(cfg: DBAConfig, dtype: torch.dtype, max_position_embeddings: int,
                 bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """The ``config.json`` of ``PurestepDBAConfig`` (transformers' Llama fields plus the student's)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "auto_map": dict(AUTO_MAP),
        **hf.decoder_fields(cfg, dtype, max_position_embeddings, bos_id, eos_id),
        "sem_dim": cfg.sem_dim,
        "geo_dim": cfg.geo_dim,
        "v_dim": cfg.v_dim,
        "rope_pairs": [[[int(i) for i in pairs] for pairs in layer] for layer in cfg.rope_pairs],
        "sliding_window": cfg.sliding_window or None,
        "qkv_bias": cfg.qkv_bias,
    }


def export_dba_hf(params: dict, cfg: DBAConfig, folder, tokenizer=None, dtype: torch.dtype | None = None) -> Path:
    """Write the student as a Hugging Face folder: ``config.json`` (with ``auto_map``), ``generation_config.json``,
    ``model.safetensors`` (in ``dtype``, default the params' own), the two remote-code files and, for a BPE
    tokenizer, ``tokenizer.json`` + ``tokenizer_config.json``. The stated maximum context is ``cfg.max_context``,
    else ``models.hf.DEFAULT_CONTEXT``. Returns the folder."""
    check_exportable(params, cfg)
    folder = Path(folder)
    _check_target(folder)
    max_position_embeddings = cfg.max_context or hf.DEFAULT_CONTEXT
    dtype = dtype or params["embed"].dtype
    bos, eos = getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None)

    def build(builder) -> None:
        hf.write_safetensors(state_dict(params, cfg), builder.path / hf.SINGLE_FILE, dtype)
        hf.write_json(builder.path / "config.json", config_to_hf(cfg, dtype, max_position_embeddings, bos, eos))
        hf.write_tokenizer_files(builder.path, tokenizer, max_position_embeddings)
        for name in (CONFIG_FILE, MODELING_FILE):
            shutil.copyfile(REMOTE / name, builder.path / name)
    return build_folder(folder, build)


def _check_target(folder: Path) -> None:
    """Refuse a target that is a file, or a non-empty folder that is not an earlier export."""
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{folder}: exists and is not a folder")
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    config = folder / "config.json"
    try:
        earlier = json.loads(config.read_text(encoding="utf-8")).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        earlier = False
    foreign = sorted(p.name for p in folder.iterdir() if p.name not in EXPORT_FILES or not p.is_file())
    if not earlier or foreign:
        why = f"it holds {', '.join(foreign[:3])}" if earlier else "it is not an earlier DBA export"
        raise UserError(f"{folder}: not empty and {why}; export into a new or empty folder")

