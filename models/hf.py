"""Hugging Face Llama and Qwen2 folders (``config.json`` + safetensors) to and from purestep params.

Follows transformers' ``models/llama/modeling_llama.py`` / ``configuration_llama.py`` (tensor names
``model.layers.N.self_attn.q_proj.weight`` ..., config fields ``hidden_size``, ``num_key_value_heads``,
``rope_theta``/``rope_scaling`` or, since transformers 5, ``rope_parameters``) and the folder layout
``save_pretrained`` writes (``model.safetensors``, or ``model-0000N-of-0000M.safetensors`` listed in
``model.safetensors.index.json``). Weights are already in torch's ``(out, in)`` layout and in the
"rotate half" RoPE order (``convert_llama_weights_to_hf.py`` permuted Meta's Q/K once, for good), so a
tensor maps one to one onto a slice of our stacked ``layers.*`` leaves.

Qwen2 (transformers' ``models/qwen2/modeling_qwen2.py``) is the same decoder with biases on the q/k/v
projections (``LlamaConfig.qkv_bias``); a model with those biases is written back as Qwen2, since Llama's
``attention_bias`` would add an ``o_proj`` bias too. Mistral (``models/mistral``) is the same decoder with
a sliding attention window on every layer (``LlamaConfig.sliding_window``); a windowed model is written
back as Mistral. Anything ``models.llama`` does not compute (another architecture, Llama's attention or MLP
biases, a Qwen2 window on some layers only, an activation other than SiLU, RoPE scaling other than llama3 or
per-pair factors) is refused with a ``UserError`` naming the field. Per-pair RoPE factors (``rope_scaling`` type
``factors``: a GGUF's ``rope_freqs``, the standard-format DBA student's kept pairs, ``models.dba_llama``) are
written as, and read back from, transformers' ``longrope`` with equal short and long factors and attention
factor 1 (:func:`rope_scaling_to_hf`).
Needs the optional ``safetensors`` (and, for ``tokenizer.json``, ``tokenizers``) package.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from purestep.core.config import UserError
from purestep.core.data.tokenizers import BPETokenizer
from purestep.core.tree import cast, flatten_dict, unflatten_dict
from purestep.models.llama import LlamaConfig

# purestep leaf under "layers" -> Hugging Face name inside "model.layers.N."
LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "attn.wq": "self_attn.q_proj.weight",
    "attn.wk": "self_attn.k_proj.weight",
    "attn.wv": "self_attn.v_proj.weight",
    "attn.wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "mlp.w_gate": "mlp.gate_proj.weight",
    "mlp.w_up": "mlp.up_proj.weight",
    "mlp.w_down": "mlp.down_proj.weight",
}
BIAS_NAMES = {"attn.q_bias": "self_attn.q_proj.bias", "attn.k_bias": "self_attn.k_proj.bias",
              "attn.v_bias": "self_attn.v_proj.bias"}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
TOP_NAMES = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"
ROPE_TYPES = ("default", "llama3", "longrope")   # longrope: per-pair factors only
DEFAULT_CONTEXT = 2048   # what an export states for a model whose config records no maximum context


def _safetensors(folder: Path | None = None):
    """``safetensors.torch``, or a UserError naming ``folder`` (the one being read or written) and the extra."""
    try:
        import safetensors.torch
    except ImportError:
        where = f"{folder}: " if folder is not None else ""
        raise UserError(f"{where}Hugging Face folders need the optional 'safetensors' package: "
                        "pip install purestep[hf]") from None
    return safetensors.torch


def _load_safetensors(st, path: Path) -> dict:
    """The tensors of one safetensors file; a file that is not one (garbage, truncated) is a UserError."""
    try:
        return st.load_file(str(path))
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError for a malformed file
        raise UserError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read JSON ({e})") from None


# ----------------------------------------------------------------------------------------------------------
# config

def config_from_hf(hf: dict, source="config.json") -> LlamaConfig:
    """``LlamaConfig`` from a transformers ``LlamaConfig`` dict (transformers 4 or 5 spelling)."""
    family = hf.get("model_type", "llama")
    archs = hf.get("architectures") or [ARCHITECTURES.get(family, "?")]
    if ARCHITECTURES.get(family) not in archs:
        raise UserError(f"{source}: model_type={family!r}, architectures={archs}; supported: "
                        + ", ".join(f"{k!r} / {a}" for k, a in ARCHITECTURES.items()))
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise UserError(f"{source}: {flag}=true is not supported (models.llama has no o_proj or MLP biases)")
    window = _window(hf, family, source)
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"{source}: hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    rope = dict(hf.get("rope_parameters") or {})                 # transformers 5
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = rope or dict(hf.get("rope_scaling") or {})         # transformers 4
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UserError(f"{source}: {field}.rope_type={kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    try:
        n_heads = int(hf["num_attention_heads"])
        d_model = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or d_model // n_heads)
        return LlamaConfig(
            vocab_size=int(hf["vocab_size"]),
            d_model=d_model,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            ffn_dim=int(hf["intermediate_size"]),
            rope_theta=float(theta),
            rope_scaling=llama3_scaling(scaling) if kind == "llama3" else
            factors_scaling(scaling, head_dim, source) if kind == "longrope" else {},
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            max_context=int(hf.get("max_position_embeddings") or 0),
            sliding_window=window,
        )
    except KeyError as e:
        raise UserError(f"{source}: missing field {e.args[0]!r}") from None
    except ValueError as e:
        raise UserError(f"{source}: {e}") from None


def _window(hf: dict, family: str, source) -> int:
    """The one sliding window of every layer (0: none). Mistral slides on every layer; Qwen2 with
    ``use_sliding_window`` slides on layers ``max_window_layers`` and up (transformers' ``layer_types``), which
    ``models.llama`` computes when that is every layer or none; a mix is refused by name."""
    if family == "mistral":
        return int(hf.get("sliding_window") or 0)
    if family != "qwen2" or not hf.get("use_sliding_window") or not hf.get("sliding_window"):
        return 0
    n = int(hf.get("num_hidden_layers", 0))
    first = int(hf.get("max_window_layers", n) or 0)
    kinds = hf.get("layer_types") or ["full_attention"] * min(first, n) + ["sliding_attention"] * max(n - first, 0)
    if set(kinds) == {"sliding_attention"}:
        return int(hf["sliding_window"])
    if set(kinds) <= {"full_attention"}:
        return 0
    raise UserError(f"{source}: use_sliding_window=true with max_window_layers={first} slides on layers "
                    f"{kinds.index('sliding_attention')}-{n - 1} only; models.llama has one window for all layers "
                    f"(supported: every layer or none)")


def llama3_scaling(scaling: dict) -> dict:
    """llama3's ``rope_scaling`` dict in config.json's spelling, every field present (defaults filled in)."""
    return {"rope_type": "llama3", "factor": float(scaling["factor"]),
            "low_freq_factor": float(scaling.get("low_freq_factor", 1.0)),
            "high_freq_factor": float(scaling.get("high_freq_factor", 4.0)),
            "original_max_position_embeddings": int(scaling.get("original_max_position_embeddings", 8192))}


def factors_scaling(scaling: dict, head_dim: int, source="config.json") -> dict:
    """transformers' ``longrope`` read back as the per-pair ``factors`` it is when its short and long factors are
    equal and its attention factor is 1 (what :func:`rope_scaling_to_hf` writes); any other longrope is refused."""
    short, long = scaling.get("short_factor"), scaling.get("long_factor")
    attention = scaling.get("attention_factor", 1.0 if scaling.get("factor", 1.0) <= 1.0 else None)
    if not isinstance(short, list) or short != long or attention != 1.0 or len(short) != head_dim // 2:
        raise UserError(f"{source}: rope_type 'longrope' is supported only as per-pair factors (short_factor equal "
                        f"to long_factor, head_dim/2 = {head_dim // 2} of them, attention_factor 1)")
    return {"rope_type": "factors", "factors": [float(f) for f in short]}


def rope_scaling_to_hf(scaling: dict, max_position_embeddings: int) -> dict | None:
    """``config.json``'s ``rope_scaling``: None, llama3's, or per-pair ``factors`` as transformers' ``longrope``
    with short_factor = long_factor = the factors, factor 1, attention_factor 1 and original_max_position_embeddings
    = max_position_embeddings (``_compute_longrope_parameters``: inv_freq_j = 1 / (factor_j * theta^(2j/dim)),
    models.llama's rule; the same factors past any length, no attention scaling)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "llama3":
        return llama3_scaling(scaling)
    if kind == "factors":
        factors = [float(f) for f in scaling["factors"]]
        return {"rope_type": "longrope", "short_factor": factors, "long_factor": list(factors), "factor": 1.0,
                "attention_factor": 1.0, "original_max_position_embeddings": max_position_embeddings}
    return None


def config_to_hf(cfg: LlamaConfig, dtype: torch.dtype, max_position_embeddings: int,
                 bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """A ``config.json`` transformers 4 and 5 both read as ``LlamaForCausalLM`` (``Qwen2ForCausalLM`` with
    q/k/v biases, sliding on every layer when windowed; ``MistralForCausalLM`` with a window and no biases)."""
    kind = "qwen2" if cfg.qkv_bias else "mistral" if cfg.sliding_window else "llama"
    window = cfg.sliding_window or None
    extra = {"qwen2": {"use_sliding_window": bool(window), "sliding_window": window,
                       "max_window_layers": 0 if window else cfg.n_layers},
             "mistral": {"sliding_window": window}, "llama": {}}[kind]
    return {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        **extra,
        **decoder_fields(cfg, dtype, max_position_embeddings, bos_id, eos_id),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
    }


def decoder_fields(cfg: LlamaConfig, dtype: torch.dtype, max_position_embeddings: int,
                   bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """The ``config.json`` fields every Llama-family decoder shares (transformers' ``LlamaConfig`` names), for
    this module's families and the DBA student's remote-code config (``models.dba_hf``)."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling_to_hf(cfg.rope_scaling, max_position_embeddings),
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


# ----------------------------------------------------------------------------------------------------------
# weights

def state_dict(params: dict, cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensor names -> tensors (views of the stacked leaves); no ``lm_head`` when tied."""
    flat = flatten_dict(params["layers"])
    out = {TOP_NAMES["embed"]: params["embed"]}
    for i in range(cfg.n_layers):
        for ours, theirs in layer_names(cfg).items():
            out[f"model.layers.{i}.{theirs}"] = flat[ours][i]
    out[TOP_NAMES["norm"]] = params["norm"]
    if "lm_head" in params:
        out[TOP_NAMES["lm_head"]] = params["lm_head"]
    return out


def params_from_state_dict(sd: dict[str, torch.Tensor], cfg: LlamaConfig, source="safetensors") -> dict:
    """Stack ``model.layers.N.*`` along a leading layer axis; check every shape against ``cfg``."""
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}  # a recomputed buffer
    expected = _shapes(cfg, untied=TOP_NAMES["lm_head"] in sd)
    unknown = sorted(set(sd) - set(expected))
    if unknown:
        hint = " (biases are not supported here; Qwen2's q/k/v biases are, with model_type 'qwen2')" \
            if any(k.endswith(".bias") for k in unknown) else ""
        raise UserError(f"{source}: unexpected tensor(s) {', '.join(unknown[:3])}{hint}")
    missing = [k for k in expected if k not in sd]
    if missing:
        raise UserError(f"{source}: missing tensor(s) {', '.join(missing[:3])}")
    for name, shape in expected.items():
        if tuple(sd[name].shape) != shape:
            raise UserError(f"{source}: {name} has shape {tuple(sd[name].shape)}, config.json implies {shape}")
    flat = {f"layers.{ours}": torch.stack([sd[f"model.layers.{i}.{theirs}"] for i in range(cfg.n_layers)])
            for ours, theirs in layer_names(cfg).items()}
    flat.update({ours: sd[theirs] for ours, theirs in TOP_NAMES.items() if theirs in sd})
    params = unflatten_dict(flat)
    return {k: params[k] for k in ("embed", "layers", "norm", "lm_head") if k in params}


def layer_names(cfg: LlamaConfig) -> dict[str, str]:
    """Our leaf under ``layers`` -> its Hugging Face name inside ``model.layers.N.`` for this config."""
    return {**LAYER_NAMES, **BIAS_NAMES} if cfg.qkv_bias else LAYER_NAMES


def _shapes(cfg: LlamaConfig, untied: bool) -> dict[str, tuple]:
    d, q, kv, f = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    per_layer = {"attn_norm": (d,), "attn.wq": (q, d), "attn.wk": (kv, d), "attn.wv": (kv, d), "attn.wo": (d, q),
                 "mlp_norm": (d,), "mlp.w_gate": (f, d), "mlp.w_up": (f, d), "mlp.w_down": (d, f)}
    if cfg.qkv_bias:
        per_layer.update({"attn.q_bias": (q,), "attn.k_bias": (kv,), "attn.v_bias": (kv,)})
    names = layer_names(cfg)
    out = {TOP_NAMES["embed"]: (cfg.vocab_size, d), TOP_NAMES["norm"]: (d,)}
    for i in range(cfg.n_layers):
        out.update({f"model.layers.{i}.{names[k]}": s for k, s in per_layer.items()})
    if untied:
        out[TOP_NAMES["lm_head"]] = (cfg.vocab_size, d)
    return out


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files: the shards its index lists, or its single ``model.safetensors``."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(f"{index}: no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
    elif (folder / SINGLE_FILE).is_file():
        files = [folder / SINGLE_FILE]
    else:
        raise UserError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights are supported)")
    for f in files:
        if not f.is_file():
            raise UserError(f"{f}: listed in {INDEX_FILE} but missing")
    return files


# ----------------------------------------------------------------------------------------------------------
# tokenizer

def load_tokenizer(folder: Path) -> BPETokenizer | None:
    """``tokenizer.json`` with BOS/EOS and the chat template from ``tokenizer_config.json`` when given, else
    None without one."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    tok = BPETokenizer.from_file(str(path))
    conf_path = folder / "tokenizer_config.json"
    conf = _read_json(conf_path) if conf_path.is_file() else {}
    for attr, key in (("bos_id", "bos_token"), ("eos_id", "eos_token")):
        name = conf.get(key)
        name = name.get("content") if isinstance(name, dict) else name
        ids = tok.encode(name) if name else []
        if len(ids) == 1:
            setattr(tok, attr, ids[0])
    if isinstance(conf.get("chat_template"), str):
        tok.chat_template = conf["chat_template"]
    return tok


def _token_name(tok, token_id: int | None) -> str | None:
    return None if token_id is None else tok.decode([token_id])


# ----------------------------------------------------------------------------------------------------------
# the two directions

def load_hf(folder, device=None, dtype: torch.dtype | None = None):
    """``(params, config, tokenizer or None, description)`` of a Hugging Face Llama folder.

    Tensors keep the dtype they are stored in unless ``dtype`` is given; they are placed on ``device``.
    """
    folder = Path(folder)
    cfg_path = folder / "config.json"
    cfg = config_from_hf(_read_json(cfg_path), cfg_path)
    st = _safetensors(folder)
    files = safetensors_files(folder)
    sd: dict = {}
    for f in files:
        sd.update(_load_safetensors(st, f))
    if TOP_NAMES["lm_head"] not in sd:
        cfg.tie_embeddings = True
    elif cfg.tie_embeddings:  # tied, but the file also stores the (identical) head: keep one copy
        del sd[TOP_NAMES["lm_head"]]
    params = params_from_state_dict(sd, cfg, str(folder))
    params = cast(params, dtype=dtype, device=device)
    stored = sorted({str(v.dtype).removeprefix("torch.") for v in sd.values()})
    what = f"{len(files)} safetensors shards" if len(files) > 1 else "1 safetensors file"
    return params, cfg, load_tokenizer(folder), f"Hugging Face folder ({what}, {'/'.join(stored)})"


def export_hf(params: dict, cfg: LlamaConfig, folder, tokenizer=None, dtype: torch.dtype | None = None,
              max_position_embeddings: int | None = None) -> Path:
    """Write ``config.json``, ``generation_config.json``, ``model.safetensors`` (in ``dtype``, default the
    params' own) and, for a BPE tokenizer, ``tokenizer.json`` + ``tokenizer_config.json`` into ``folder``.
    The stated maximum context is ``max_position_embeddings``, else ``cfg.max_context``, else 2048."""
    max_position_embeddings = max_position_embeddings or cfg.max_context or DEFAULT_CONTEXT
    folder = Path(folder)
    _safetensors(folder)    # missing package: refuse before creating the folder
    folder.mkdir(parents=True, exist_ok=True)
    dtype = dtype or params["embed"].dtype
    bos = getattr(tokenizer, "bos_id", None)
    eos = getattr(tokenizer, "eos_id", None)
    write_safetensors(state_dict(params, cfg), folder / SINGLE_FILE, dtype)
    write_json(folder / "config.json", config_to_hf(cfg, dtype, max_position_embeddings, bos, eos))
    write_tokenizer_files(folder, tokenizer, max_position_embeddings)
    return folder


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, dtype: torch.dtype) -> None:
    """``tensors`` (name -> tensor) as one safetensors file, each copied to the host in ``dtype``."""
    host = {k: v.detach().to(device="cpu", dtype=dtype, copy=True) for k, v in tensors.items()}
    _safetensors().save_file(host, str(path), metadata={"format": "pt"})


def write_tokenizer_files(folder: Path, tokenizer, max_position_embeddings: int) -> None:
    """``generation_config.json`` (the tokenizer's BOS/EOS, or none) and, for a BPE tokenizer, ``tokenizer.json``
    + ``tokenizer_config.json`` (chat template included)."""
    bos = getattr(tokenizer, "bos_id", None)
    eos = getattr(tokenizer, "eos_id", None)
    write_json(folder / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    if isinstance(tokenizer, BPETokenizer):
        (folder / "tokenizer.json").write_text(tokenizer.json, encoding="utf-8")
        write_json(folder / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": _token_name(tokenizer, bos),
            "eos_token": _token_name(tokenizer, eos),
            "model_max_length": max_position_embeddings,
            "clean_up_tokenization_spaces": False,
            **({"chat_template": tokenizer.chat_template} if tokenizer.chat_template else {}),
        })


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
