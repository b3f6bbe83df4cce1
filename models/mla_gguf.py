"""The MLA student (``models/mla.py``) as a GGUF file of llama.cpp's architecture ``deepseek2``.

Follows llama.cpp's ``convert_hf_to_gguf.py`` (``conversion/deepseek.py``, class ``DeepseekV2Model``) and its loader
(``src/models/deepseek2.cpp``, ``llama_model_deepseek2::load_arch_hparams`` / ``load_arch_tensors``), as vendored
in llama-cpp-python 0.3.36. What is written, and why:

- Tensors under ``gguf-py``'s names: ``token_embd``, ``output_norm``, ``output`` (only when untied: the loader
  falls back to ``token_embd``), and per block ``attn_norm``, ``attn_q`` (the dense query; the loader takes it when
  ``q_lora_rank`` is 0), ``attn_kv_a_mqa`` ([latent | k_rope] rows), ``attn_kv_a_norm``, the split up-projection
  ``attn_k_b`` (numpy [H, kv_lora_rank, qk_nope_head_dim]: the k_nope rows of ``kv_b_proj`` per head, transposed)
  and ``attn_v_b`` ([H, v_head_dim, kv_lora_rank]) as the converter writes them, so llama.cpp runs the absorbed MLA
  over a cache of kv_lora_rank + qk_rope_head_dim values per token (the legacy unsplit ``attn_kv_b`` would make it
  cache per-head keys and values), ``attn_output``, ``ffn_norm``, ``ffn_gate``/``ffn_up``/``ffn_down``. The RoPE rows
  are Hugging Face's (``models.mla_hf.state_dict``: DeepSeek's interleaved pairs), which llama.cpp's "normal" RoPE
  of ``deepseek2`` rotates.
- Metadata: the keys ``models.gguf_export`` writes for any model, with ``attention.head_count_kv`` 1,
  ``attention.key_length`` / ``value_length`` = kv_lora_rank + qk_rope_head_dim / kv_lora_rank (the absorbed MQA
  head, as the converter writes), ``attention.key_length_mla`` / ``value_length_mla`` = the per-head widths,
  ``attention.kv_lora_rank``, ``rope.dimension_count`` = qk_rope_head_dim, and for an all-dense model
  ``leading_dense_block_count`` = n_layers, no ``expert_count`` (the loader asserts no used experts without
  experts), ``expert_feed_forward_length`` = ffn_dim and ``expert_shared_count`` 0 (both read unconditionally).
- ``attention.q_lora_rank`` = 0: the loader *requires* that key unless the block count is one of its "lite" counts
  (26, 27, or 48 with a 128256 vocabulary), and the converter writes none for DeepSeek-V2-Lite's ``q_lora_rank:
  null``; 0 makes it load ``attn_q`` and compute ``q = W_q x`` exactly, where a factorized query would be inexact
  (llama.cpp normalizes the compressed query with ``attn_q_a_norm``).
- The latent rows of ``attn_kv_a_mqa`` multiplied by sqrt(norm_eps / 1e-6) (``latent_scale``): llama.cpp normalizes
  the latent at ``rms_norm_eps`` where DeepSeek-V2 (and ``models.mla``) take 1e-6 (``models.mla.KV_NORM_EPS``), and
  RMSNorm_e(a c) = RMSNorm_{e / a^2}(c); 1 (no change) when norm_eps is 1e-6, as DeepSeek-V2's own.
- ``qk_nope_head_dim`` 0: llama.cpp asserts at least one no-RoPE dim per head, so the file gets one that contributes
  nothing (a zero query row and a zero ``attn_k_b`` column per head) and the RoPE query rows are multiplied by
  sqrt((qk_rope_head_dim + 1) / qk_rope_head_dim), undoing the 1/sqrt(qk_rope_head_dim + 1) llama.cpp then scales by.

:func:`load_mla_gguf` reads such a file back (``models.loading`` on a ``deepseek2`` GGUF: arch ``mla``), the inverse
of the above: a dense query (``q_lora_rank`` 0 or absent), every block dense, the split ``attn_k_b``/``attn_v_b``
(or the legacy ``attn_kv_b``), no RoPE scaling; anything else is refused by name. A file written for
``qk_nope_head_dim`` 0 reads back as the equivalent model with its one inert no-RoPE dim.

Refused with the reason: RoPE scaling (llama.cpp's ``deepseek2`` graph passes no ``rope_freqs`` to its RoPE, so
llama3 scaling would be lost; ``format=hf`` keeps it). Tensor types and the file's atomic write are
``models.gguf_export``'s (``encode_tensor``, ``write_file``).

A per-layer KV budget (``MLAConfig.kv_ranks``) is written at its padded width: ``attention.kv_lora_rank`` is one
number for every layer, max(kv_ranks), each layer's dead latent dims zero, so llama.cpp's cache holds the padded
width per token and layer; the file reads back with ``kv_ranks`` empty (the same function).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from purestep.core.config import UserError
from purestep.core.tree import cast
from purestep.models import gguf as gguf_read, hf
from purestep.models.gguf_export import HF_TO_GGUF, check_dtype, file_type, write_file
from purestep.models.mla import KV_NORM_EPS, MLAConfig
from purestep.models.mla_hf import check_exportable, params_from_state_dict, state_dict

ARCH = "deepseek2"
BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
         "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
         "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}


def check_gguf(params: dict, cfg: MLAConfig) -> None:
    """A ``UserError`` naming what llama.cpp's ``deepseek2`` would not compute as ``models.mla`` does."""
    check_exportable(params, cfg)
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default":
        raise UserError(f"rope_scaling type {kind!r}: llama.cpp's deepseek2 applies no per-pair RoPE factors "
                        f"(rope_freqs), so the scaling would be lost; export with format=hf instead")


def nope_dims(cfg: MLAConfig) -> int:
    """The file's qk_nope_head_dim: the model's, or the one inert dim llama.cpp needs at least."""
    return max(cfg.qk_nope_head_dim, 1)


def latent_scale(cfg: MLAConfig) -> float:
    """What the latent rows of W_kv_a are multiplied by in the file, so that llama.cpp's RMSNorm at norm_eps
    computes models.mla's at KV_NORM_EPS."""
    return 1.0 if cfg.norm_eps == KV_NORM_EPS else math.sqrt(cfg.norm_eps / KV_NORM_EPS)


def gguf_tensors(params: dict, cfg: MLAConfig) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 array (numpy order: the ggml shape reversed)."""
    H, dn, dr, dv, r = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    pad = nope_dims(cfg) - dn
    out = {}
    for name, t in state_dict(params, cfg).items():
        w = t.detach().to(device="cpu", dtype=torch.float32)
        if name in HF_TO_GGUF:
            out[HF_TO_GGUF[name]] = w
            continue
        _, _, layer, rest = name.split(".", 3)              # model.layers.N.self_attn.q_proj.weight
        part, kind = rest.rsplit(".", 1)
        if part == "self_attn.kv_b_proj":
            k_b, v_b = w.view(H, dn + dv, r).split([dn, dv], dim=1)
            k_b = torch.cat([k_b, k_b.new_zeros(H, pad, r)], dim=1)
            out[f"blk.{layer}.attn_k_b.{kind}"] = k_b.transpose(1, 2)
            out[f"blk.{layer}.attn_v_b.{kind}"] = v_b
            continue
        if part == "self_attn.kv_a_proj_with_mqa" and latent_scale(cfg) != 1.0:
            w = torch.cat([w[:r] * latent_scale(cfg), w[r:]])
        if part == "self_attn.q_proj" and pad:
            heads = w.view(H, dr, -1) * math.sqrt((dr + pad) / dr)
            w = torch.cat([heads.new_zeros(H, pad, heads.shape[-1]), heads], dim=1).reshape(-1, heads.shape[-1])
        out[f"blk.{layer}.{BLOCK[part]}.{kind}"] = w
    return {k: np.ascontiguousarray(v.numpy()) for k, v in out.items()}


def _write_metadata(w, cfg: MLAConfig, name: str, ftype: int, gguf) -> None:
    r, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    w.add_name(name)
    w.add_context_length(cfg.max_context or hf.DEFAULT_CONTEXT)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(1)                     # the absorbed form: one shared latent "head" (the converter's)
    w.add_key_length(r + dr)
    w.add_value_length(r)
    w.add_key_length_mla(nope_dims(cfg) + dr)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_q_lora_rank(0)                       # required outside the "lite" block counts; 0: the dense attn_q
    w.add_kv_lora_rank(r)
    w.add_rope_dimension_count(dr)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_leading_dense_block_count(cfg.n_layers)
    w.add_expert_feed_forward_length(cfg.ffn_dim)
    w.add_expert_shared_count(0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def export_mla_gguf(params: dict, cfg: MLAConfig, path, tokenizer=None, dtype: str = "f32",
                    name: str | None = None) -> Path:
    """Write the MLA model as the ``deepseek2`` GGUF file ``path`` (``dtype``: f32, f16, bf16 or q8_0 for the
    matrices); ``name`` is ``general.name`` (default: the file's stem). Returns the path."""
    check_dtype(dtype)
    check_gguf(params, cfg)

    def metadata(writer, gguf):
        _write_metadata(writer, cfg, name or Path(path).stem, file_type(gguf, dtype), gguf)
    return write_file(path, ARCH, metadata, lambda: gguf_tensors(params, cfg), tokenizer, cfg.vocab_size, dtype)


# ----------------------------------------------------------------------------------------------------------
# reading one back

def config_from_gguf(reader, path="GGUF file") -> MLAConfig:
    """``MLAConfig`` from a ``deepseek2`` file's metadata; a compressed query, experts or RoPE scaling refused."""
    def get(key, default=None):
        return gguf_read.metadata(reader, f"{ARCH}.{key}", default)

    def need(key):
        return gguf_read._need(reader, path, f"{ARCH}.{key}")
    n_layers = int(need("block_count"))
    if int(get("attention.q_lora_rank", 0)):
        raise UserError(f"{path}: {ARCH}.attention.q_lora_rank={get('attention.q_lora_rank')}: a compressed query "
                        f"is not supported (models.mla has a dense attn_q)")
    if int(get("expert_count", 0)) and int(get("leading_dense_block_count", 0)) < n_layers:
        raise UserError(f"{path}: {ARCH}.expert_count={get('expert_count')}: mixture-of-experts blocks are not "
                        f"supported")
    for key in ("rope.scaling.type", "rope.scaling.yarn_log_multiplier"):
        if get(key, "none") not in ("none", 0, 0.0):
            raise UserError(f"{path}: {ARCH}.{key}={get(key)!r}: RoPE scaling is not supported")
    dr, k_mla = int(need("rope.dimension_count")), int(need("attention.key_length_mla"))
    try:
        return MLAConfig(
            vocab_size=gguf_read._embedding_rows(reader, path), d_model=int(need("embedding_length")),
            n_layers=n_layers, n_heads=int(need("attention.head_count")), ffn_dim=int(need("feed_forward_length")),
            rope_theta=gguf_read._float(get("rope.freq_base", 10000.0)),
            norm_eps=gguf_read._float(need("attention.layer_norm_rms_epsilon")),
            tie_embeddings="output.weight" not in {t.name for t in reader.tensors},
            max_context=int(get("context_length", 0)), kv_lora_rank=int(need("attention.kv_lora_rank")),
            qk_rope_head_dim=dr, qk_nope_head_dim=k_mla - dr, v_head_dim=int(need("attention.value_length_mla")))
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None


def hf_state_dict(reader, cfg: MLAConfig, path="GGUF file") -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under its Hugging Face name, ``attn_k_b``/``attn_v_b`` joined into
    ``kv_b_proj`` (per head [k_nope | v] rows)."""
    gguf = gguf_read._require_gguf()
    to_hf = {v: k for k, v in BLOCK.items()}
    H, dn, dv, r = cfg.n_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    sd, split = {}, {}
    for t in reader.tensors:
        w = torch.from_numpy(np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32))
        block, layer, part, kind = (t.name.split(".") + ["", "", "", ""])[:4]
        if t.name in gguf_read.TOP_TENSORS:
            sd[gguf_read.TOP_TENSORS[t.name]] = w
        elif block == "blk" and layer.isdigit() and kind == "weight" and part in to_hf:
            if part == "attn_kv_a_mqa" and latent_scale(cfg) != 1.0:
                w = torch.cat([w[:r] / latent_scale(cfg), w[r:]])
            sd[f"model.layers.{layer}.{to_hf[part]}.weight"] = w
        elif block == "blk" and layer.isdigit() and kind == "weight" and part in ("attn_kv_b", "attn_k_b", "attn_v_b"):
            split.setdefault(int(layer), {})[part] = w
        else:
            raise UserError(f"{path}: unsupported tensor {t.name!r} (a dense deepseek2 file has none such)")
    for layer, parts in split.items():
        if "attn_kv_b" not in parts:
            if set(parts) != {"attn_k_b", "attn_v_b"} or parts["attn_k_b"].shape != (H, r, dn) \
                    or parts["attn_v_b"].shape != (H, dv, r):
                raise UserError(f"{path}: block {layer}'s attn_k_b/attn_v_b are not [{H}, {r}, {dn}] and "
                                f"[{H}, {dv}, {r}]")
            parts["attn_kv_b"] = torch.cat([parts["attn_k_b"].transpose(1, 2), parts["attn_v_b"]], 1).reshape(-1, r)
        sd[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = parts["attn_kv_b"]
    return sd


def load_mla_gguf(path, device=None):
    """``(params, config, tokenizer or None, description)`` of a ``deepseek2`` GGUF; params float32 on ``device``."""
    path = Path(path)
    reader = gguf_read.open_gguf(path)
    cfg = config_from_gguf(reader, path)
    params = params_from_state_dict(hf_state_dict(reader, cfg, path), cfg, str(path))
    tok = gguf_read.tokenizer_from_gguf(reader, path) if gguf_read.metadata(reader, "tokenizer.ggml.model") else None
    quant = gguf_read.quantization(reader)
    return (cast(params, device=device), cfg, tok,
            f"GGUF ({ARCH}, {quant})" if quant == "F32" else f"GGUF ({ARCH}, {quant} dequantized)")
