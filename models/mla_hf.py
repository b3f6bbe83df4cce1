"""The MLA student (``models/mla.py``) as a Hugging Face folder in DeepSeek-V2's own format, and back.

transformers computes it as ``DeepseekV2ForCausalLM`` (``models/deepseek_v2/modeling_deepseek_v2.py``, built in
since transformers 4.57: no remote code)::

    AutoModelForCausalLM.from_pretrained(folder)

``config.json`` is ``DeepseekV2Config`` (``configuration_deepseek_v2.py``) with the query uncompressed
(``q_lora_rank: null``, as DeepSeek-V2-Lite), ``kv_lora_rank``, ``qk_rope_head_dim``, ``qk_nope_head_dim``,
``v_head_dim``, ``num_key_value_heads`` = ``num_attention_heads`` and every layer dense
(``first_k_dense_replace`` = ``num_hidden_layers``, ``n_routed_experts`` 0: ``DeepseekV2MLP`` of
``intermediate_size``), no biases, RoPE base and scaling (default or llama3; transformers derives its frequencies
from ``head_dim`` = ``qk_rope_head_dim``, as ``models.mla.rope_frequencies`` does). Tensors are Llama's names
outside the attention and ``self_attn.{q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}.weight``
inside it; the RoPE rows of ``q_proj`` (the last qk_rope_head_dim of every head) and of ``kv_a_proj_with_mqa`` (its
last qk_rope_head_dim) are permuted from our rotate-half pairs (i, i + d_r/2) to DeepSeek's interleaved pairs
(2i, 2i+1) by ``convert_hf_to_gguf.py``'s ``LlamaModel.permute`` (``models.gguf_export.permute_rows``), and back
on reading (``models.gguf.unpermute_rows``). llama.cpp's ``deepseek2`` rotates the same interleaved pairs, so the
GGUF (``models.mla_gguf``) takes these rows as they are.

``models.loading`` reads a folder whose ``config.json`` says ``model_type: deepseek_v2`` with :func:`load_mla_hf`
(arch ``mla``). Refused by name: query compression (``q_lora_rank``), experts, YaRN or other rope types, biases,
activations other than SiLU. The teacher's head_dim and n_kv_heads (informational in ``MLAConfig``) are not part of
the format: read back, they are d_model / n_heads and n_heads.

A student with a per-layer KV budget (``MLAConfig.kv_ranks``) is written at its padded width: DeepSeek-V2's format
has one ``kv_lora_rank`` for every layer, so the folder carries kv_lora_rank = max(kv_ranks) with each layer's dead
latent dims as zero rows/columns (the same function; a cache built from it holds the padded width), and reads back
with ``kv_ranks`` empty.
"""
from __future__ import annotations

from pathlib import Path

import torch

from purestep.core.config import UserError
from purestep.core.tree import cast, flatten_dict, unflatten_dict
from purestep.models import hf
from purestep.models.gguf import unpermute_rows
from purestep.models.gguf_export import permute_rows
from purestep.models.mla import MLAConfig

MODEL_TYPE, ARCHITECTURE = "deepseek_v2", "DeepseekV2ForCausalLM"
# purestep leaf under "layers" -> Hugging Face name inside "model.layers.N."
LAYER_NAMES = {**{k: v for k, v in hf.LAYER_NAMES.items() if not k.startswith("attn.")},
               "attn.wq": "self_attn.q_proj.weight", "attn.wkv_a": "self_attn.kv_a_proj_with_mqa.weight",
               "attn.kv_norm": "self_attn.kv_a_layernorm.weight", "attn.wkv_b": "self_attn.kv_b_proj.weight",
               "attn.wo": "self_attn.o_proj.weight"}
ROPE_TYPES = ("default", "llama3")


# ----------------------------------------------------------------------------------------------------------
# RoPE row order: ours (rotate-half) <-> DeepSeek's (interleaved)

def rope_rows(w: torch.Tensor, cfg: MLAConfig, leaf: str, to_deepseek: bool) -> torch.Tensor:
    """``wq`` [H * (dn + dr), d] or ``wkv_a`` [r + dr, d] with the RoPE rows of every head reordered between
    rotate-half and interleaved pairs (``to_deepseek``) or back; a copy, the other rows unchanged."""
    dr = cfg.qk_rope_head_dim
    heads = w.reshape(cfg.n_heads, -1, w.shape[-1]) if leaf == "wq" else w[None]
    order = permute_rows if to_deepseek else unpermute_rows
    rope = torch.stack([order(h[-dr:], 1) for h in heads])
    return torch.cat([heads[:, :-dr], rope], dim=1).reshape(w.shape)


def check_exportable(params: dict, cfg: MLAConfig) -> None:
    """A ``UserError`` naming what DeepSeek-V2's format cannot hold as ``models.mla`` computes it."""
    if not isinstance(cfg, MLAConfig):
        raise UserError(f"the DeepSeek-V2 export writes an MLA model (an MLAConfig), got {type(cfg).__name__}")
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UserError(f"rope_scaling type {kind!r} has no DeepSeek-V2 config.json form here (supported: "
                        f"{', '.join(ROPE_TYPES)})")
    found, expected = set(params["layers"]["attn"]), {k.split(".", 1)[1] for k in LAYER_NAMES if k.startswith("attn.")}
    if found != expected:
        raise UserError(f"the attention params are {', '.join(sorted(found))}; an MLA model has "
                        f"{', '.join(sorted(expected))}")
    if ("lm_head" in params) == cfg.tie_embeddings:
        raise UserError(f"tie_embeddings={cfg.tie_embeddings} but the params "
                        f"{'have' if 'lm_head' in params else 'lack'} an lm_head")


# ----------------------------------------------------------------------------------------------------------
# config

def config_to_hf(cfg: MLAConfig, dtype: torch.dtype, max_position_embeddings: int,
                 bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """``DeepseekV2Config``'s ``config.json``: the shared decoder fields, MLA's widths, every layer dense."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        **hf.decoder_fields(cfg, dtype, max_position_embeddings, bos_id, eos_id),
        "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.qk_rope_head_dim,          # what DeepseekV2Config sets: the RoPE frequencies' width
        "q_lora_rank": None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "first_k_dense_replace": cfg.n_layers,
        "n_routed_experts": 0,
        "n_shared_experts": 0,
        "num_experts_per_tok": None,
        "moe_intermediate_size": cfg.ffn_dim,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "norm_topk_prob": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
    }


def config_from_hf(conf: dict, source="config.json") -> MLAConfig:
    """``MLAConfig`` from a dense, uncompressed-query ``DeepseekV2Config`` dict; anything else refused by name."""
    if conf.get("q_lora_rank") is not None:
        raise UserError(f"{source}: q_lora_rank={conf['q_lora_rank']}: a compressed query (q_a_proj, q_a_layernorm, "
                        f"q_b_proj) is not supported; models.mla has a dense query (q_lora_rank null)")
    n_layers = int(conf.get("num_hidden_layers", 0))
    if conf.get("n_routed_experts") and int(conf.get("first_k_dense_replace") or 0) < n_layers:
        raise UserError(f"{source}: n_routed_experts={conf['n_routed_experts']} with first_k_dense_replace="
                        f"{conf.get('first_k_dense_replace', 0)}: mixture-of-experts layers are not supported")
    for flag in ("attention_bias", "mlp_bias"):
        if conf.get(flag):
            raise UserError(f"{source}: {flag}=true is not supported (models.mla has no biases)")
    if conf.get("hidden_act", "silu") != "silu":
        raise UserError(f"{source}: hidden_act={conf['hidden_act']!r} is not supported (only 'silu')")
    rope = dict(conf.get("rope_parameters") or {})                 # transformers 5
    theta = rope.pop("rope_theta", conf.get("rope_theta", 10000.0))
    scaling = rope or dict(conf.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UserError(f"{source}: rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    try:
        return MLAConfig(
            vocab_size=int(conf["vocab_size"]), d_model=int(conf["hidden_size"]), n_layers=n_layers,
            n_heads=int(conf["num_attention_heads"]), ffn_dim=int(conf["intermediate_size"]),
            rope_theta=float(theta), rope_scaling=hf.llama3_scaling(scaling) if kind == "llama3" else {},
            norm_eps=float(conf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(conf.get("tie_word_embeddings")),
            max_context=int(conf.get("max_position_embeddings") or 0), init_std=float(conf.get("initializer_range",
                                                                                               0.02)),
            kv_lora_rank=int(conf["kv_lora_rank"]), qk_rope_head_dim=int(conf["qk_rope_head_dim"]),
            qk_nope_head_dim=int(conf["qk_nope_head_dim"]), v_head_dim=int(conf["v_head_dim"]))
    except KeyError as e:
        raise UserError(f"{source}: missing field {e.args[0]!r}") from None
    except ValueError as e:
        raise UserError(f"{source}: {e}") from None


# ----------------------------------------------------------------------------------------------------------
# weights

def state_dict(params: dict, cfg: MLAConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensor names -> tensors (RoPE rows in DeepSeek's order); no ``lm_head`` when tied."""
    flat = flatten_dict(params["layers"])
    out = {hf.TOP_NAMES["embed"]: params["embed"]}
    for i in range(cfg.n_layers):
        for ours, theirs in LAYER_NAMES.items():
            w = flat[ours][i]
            if ours in ("attn.wq", "attn.wkv_a"):
                w = rope_rows(w, cfg, ours[5:], to_deepseek=True)
            out[f"model.layers.{i}.{theirs}"] = w
    out[hf.TOP_NAMES["norm"]] = params["norm"]
    if "lm_head" in params:
        out[hf.TOP_NAMES["lm_head"]] = params["lm_head"]
    return out


def shapes(cfg: MLAConfig, untied: bool) -> dict[str, tuple]:
    d, f, H, r, dr = cfg.d_model, cfg.ffn_dim, cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    per_layer = {"attn_norm": (d,), "attn.wq": (H * (cfg.qk_nope_head_dim + dr), d), "attn.wkv_a": (r + dr, d),
                 "attn.kv_norm": (r,), "attn.wkv_b": (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), r),
                 "attn.wo": (d, H * cfg.v_head_dim), "mlp_norm": (d,), "mlp.w_gate": (f, d), "mlp.w_up": (f, d),
                 "mlp.w_down": (d, f)}
    out = {hf.TOP_NAMES["embed"]: (cfg.vocab_size, d), hf.TOP_NAMES["norm"]: (d,)}
    for i in range(cfg.n_layers):
        out.update({f"model.layers.{i}.{LAYER_NAMES[k]}": s for k, s in per_layer.items()})
    if untied:
        out[hf.TOP_NAMES["lm_head"]] = (cfg.vocab_size, d)
    return out


def params_from_state_dict(sd: dict[str, torch.Tensor], cfg: MLAConfig, source="safetensors") -> dict:
    """Stack ``model.layers.N.*`` along a leading layer axis (RoPE rows back to ours); every shape checked."""
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    expected = shapes(cfg, untied=hf.TOP_NAMES["lm_head"] in sd)
    unknown, missing = sorted(set(sd) - set(expected)), [k for k in expected if k not in sd]
    if unknown or missing:
        what = f"unexpected tensor(s) {', '.join(unknown[:3])}" if unknown else \
            f"missing tensor(s) {', '.join(missing[:3])}"
        raise UserError(f"{source}: {what}")
    for name, shape in expected.items():
        if tuple(sd[name].shape) != shape:
            raise UserError(f"{source}: {name} has shape {tuple(sd[name].shape)}, config.json implies {shape}")

    def layer(ours, theirs, i):
        w = sd[f"model.layers.{i}.{theirs}"]
        return rope_rows(w, cfg, ours[5:], to_deepseek=False) if ours in ("attn.wq", "attn.wkv_a") else w
    flat = {f"layers.{ours}": torch.stack([layer(ours, theirs, i) for i in range(cfg.n_layers)])
            for ours, theirs in LAYER_NAMES.items()}
    flat.update({ours: sd[theirs] for ours, theirs in hf.TOP_NAMES.items() if theirs in sd})
    params = unflatten_dict(flat)
    return {k: params[k] for k in ("embed", "layers", "norm", "lm_head") if k in params}


# ----------------------------------------------------------------------------------------------------------
# the two directions

def load_mla_hf(folder, device=None, dtype: torch.dtype | None = None):
    """``(params, config, tokenizer or None, description)`` of a DeepSeek-V2 folder of this module's form."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    cfg = config_from_hf(hf._read_json(cfg_path), cfg_path)
    st = hf._safetensors(folder)
    files = hf.safetensors_files(folder)
    sd: dict = {}
    for f in files:
        sd.update(hf._load_safetensors(st, f))
    if hf.TOP_NAMES["lm_head"] not in sd:
        cfg.tie_embeddings = True
    elif cfg.tie_embeddings:
        del sd[hf.TOP_NAMES["lm_head"]]
    params = cast(params_from_state_dict(sd, cfg, str(folder)), dtype=dtype, device=device)
    stored = sorted({str(v.dtype).removeprefix("torch.") for v in sd.values()})
    what = f"{len(files)} safetensors shards" if len(files) > 1 else "1 safetensors file"
    return params, cfg, hf.load_tokenizer(folder), f"Hugging Face DeepSeek-V2 folder ({what}, {'/'.join(stored)})"


def export_mla_hf(params: dict, cfg: MLAConfig, folder, tokenizer=None, dtype: torch.dtype | None = None) -> Path:
    """Write ``config.json``, ``generation_config.json``, ``model.safetensors`` (in ``dtype``, default the params'
    own) and, for a BPE tokenizer, ``tokenizer.json`` + ``tokenizer_config.json`` into ``folder``. The stated
    maximum context is ``cfg.max_context``, else ``models.hf.DEFAULT_CONTEXT``. Returns the folder."""
    check_exportable(params, cfg)
    folder = Path(folder)
    hf._safetensors(folder)
    folder.mkdir(parents=True, exist_ok=True)
    max_position_embeddings = cfg.max_context or hf.DEFAULT_CONTEXT
    dtype = dtype or params["embed"].dtype
    bos, eos = getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None)
    hf.write_safetensors(state_dict(params, cfg), folder / hf.SINGLE_FILE, dtype)
    hf.write_json(folder / "config.json", config_to_hf(cfg, dtype, max_position_embeddings, bos, eos))
    hf.write_tokenizer_files(folder, tokenizer, max_position_embeddings)
    return folder
