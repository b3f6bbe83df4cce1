"""Write purestep params as a GGUF file llama.cpp runs: the inverse of ``models.gguf``.

Follows llama.cpp's ``convert_hf_to_gguf.py`` and its ``gguf-py`` package (``gguf.GGUFWriter``,
``gguf.constants``). What is written:

- Architecture ``llama`` for a Llama-family model without biases (``LlamaModel``): the Q and K projection rows
  permuted by ``LlamaModel.permute`` (:func:`permute_rows`, the inverse of ``models.gguf.unpermute_rows``),
  because llama.cpp's llama rotates adjacent pairs. Architecture ``qwen2`` for a model with q/k/v biases
  (``Qwen2Model``): ``blk.N.attn_q.bias`` ... and NO permutation (llama.cpp rotates Qwen2 NEOX-style, in the
  Hugging Face "rotate half" order we use).
- Tensor names of ``gguf-py/gguf/tensor_mapping.py`` (``token_embd``, ``blk.N.attn_q``, ``output_norm``,
  ``output`` only when the embeddings are untied). Llama 3 rope scaling becomes a ``rope_freqs.weight``
  tensor by ``LlamaModel.generate_extra_tensors``' rule (:func:`llama3_rope_factors`); rope scaling already
  given as per-pair factors (read from a GGUF) is written back as that tensor as is.
- Tensor types as ``ModelBase.prepare_tensors`` picks them: norms, biases and every 1-D tensor float32; 2-D
  matrices in ``dtype`` (f32, f16, bf16 or q8_0). A matrix whose rows are not a multiple of Q8_0's 32-value
  block falls back to f16, as ``convert_hf_to_gguf.py`` does on ``gguf.QuantError``.
- Metadata: ``general.architecture``/``name``/``file_type``/``quantization_version``, ``{arch}.context_length``
  (``cfg.max_context``, else ``models.hf.DEFAULT_CONTEXT``), ``embedding_length``, ``block_count``,
  ``feed_forward_length``, ``attention.head_count``/``head_count_kv``, ``attention.key_length``/``value_length``
  (when head_dim is not d_model / n_heads), ``rope.dimension_count``, ``rope.freq_base``,
  ``attention.layer_norm_rms_epsilon``, ``vocab_size``; with a tokenizer the ``tokenizer.ggml.*`` vocabulary of
  ``models.tokenizer_export.gguf_vocab`` (model ``gpt2``; pre as ``tokenizer_export.llama_cpp_pre`` names it:
  the source GGUF's own, e.g. ``smollm``, else ``gpt-2``), BOS/EOS ids, add_bos/add_eos and the chat template.
  Without a tokenizer no ``tokenizer.*`` key is written (llama.cpp then needs one supplied). No metadata array
  is empty (gguf-py's writer, and so its ``gguf-new-metadata``, refuses one).

A DBA student that is a plain Llama (``models.dba_llama``: shared RoPE pairs, no semantic keys) is written as
that Llama, its kept pairs' frequencies as ``rope_freqs`` (``recipe=export`` converts it first).
Refused with the reason: a sliding-window model (llama.cpp's llama has no window; format=hf writes it as
Mistral), any other DBA student (llama.cpp has no such attention; format=hf with remote code), q/k/v biases with rope
scaling (llama.cpp's qwen2 reads no ``rope_freqs``). The file is written to a temporary name in the target
folder and renamed into place, so an error leaves nothing behind.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch

from purestep.core.io.cache import publish_file
from purestep.core.config import UserError
from purestep.models import hf
from purestep.models.dba import DBAConfig
from purestep.models.dba_llama import why_not_llama
from purestep.models.gguf import BLOCK_TENSORS, TOP_TENSORS, _require_gguf
from purestep.models.llama import LlamaConfig
from purestep.models.mla import MLAConfig
from purestep.models.tokenizer_export import adds_bos_eos, as_bpe, gguf_vocab, llama_cpp_pre

DTYPES = ("f32", "f16", "bf16", "q8_0")
HF_TO_GGUF = {v: k for k, v in TOP_TENSORS.items()}
HF_BLOCK_TO_GGUF = {v: k for k, v in BLOCK_TENSORS.items()}


def permute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``convert_hf_to_gguf.py``'s ``LlamaModel.permute``: view the rows as (heads, 2, head_dim/2), swap the last
    two row axes and flatten back (Hugging Face's rotate-half halves -> llama.cpp's adjacent pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg: LlamaConfig) -> np.ndarray:
    """``convert_hf_to_gguf.py``'s ``LlamaModel.generate_extra_tensors`` for llama3 rope scaling (float32, as
    there; written out independently of ``models.llama``): the ``rope_freqs.weight`` a Llama 3.1 GGUF carries,
    each rotary pair's angle divided by its factor."""
    s = cfg.rope_scaling
    freqs = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float32) / cfg.head_dim))
    factor, low_ff, high_ff = s.get("factor", 8.0), s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_context = s.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_context / low_ff, old_context / high_ff
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low_ff) / (high_ff - low_ff)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_arch(cfg: LlamaConfig) -> str:
    """``llama`` or ``qwen2`` (q/k/v biases); a model llama.cpp would not compute the same is refused."""
    if isinstance(cfg, MLAConfig):
        raise UserError("an MLA model is llama.cpp's deepseek2, not a Llama: write it with "
                        "models.mla_gguf.export_mla_gguf (recipe=export does)")
    if isinstance(cfg, DBAConfig):
        reason = why_not_llama(cfg)
        if not reason:
            raise UserError("this DBA student is a plain Llama: convert it with models.dba_llama.as_llama first "
                            "(recipe=export does)")
        raise UserError(f"a DBA student (decoupled bottleneck attention) with {reason} has no GGUF form: llama.cpp "
                        f"has no such attention. Export with format=hf (remote code) instead, or upcycle with "
                        f"rope_pairs_shared=true for a student that is a plain Llama")
    if cfg.sliding_window:
        raise UserError(f"a sliding-window model (sliding_window={cfg.sliding_window}) has no GGUF form here: "
                        f"llama.cpp's llama architecture has no sliding window. Export with format=hf "
                        f"(written as Mistral) instead")
    kind = (cfg.rope_scaling or {}).get("rope_type", (cfg.rope_scaling or {}).get("type", "default"))
    if kind not in ("default", "llama3", "factors"):
        raise UserError(f"rope_scaling type {kind!r} has no GGUF form here (supported: llama3, factors)")
    if cfg.qkv_bias:
        if kind != "default":
            raise UserError("a model with q/k/v biases is written as llama.cpp's qwen2, which reads no rope_freqs: "
                            "its rope scaling would be lost. Export with format=hf instead")
        return "qwen2"
    return "llama"


def gguf_tensors(params: dict, cfg: LlamaConfig, arch: str) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 array in ``(out, in)`` order, Q/K permuted for ``llama``."""
    out = {}
    for name, t in hf.state_dict(params, cfg).items():
        w = t.detach().to(device="cpu", dtype=torch.float32)
        if name in HF_TO_GGUF:
            out[HF_TO_GGUF[name]] = w
            continue
        _, _, layer, rest = name.split(".", 3)              # model.layers.N.self_attn.q_proj.weight
        part, kind = rest.rsplit(".", 1)
        gname = HF_BLOCK_TO_GGUF[part]
        if arch == "llama" and gname in ("attn_q", "attn_k"):
            w = permute_rows(w, cfg.n_heads if gname == "attn_q" else cfg.n_kv_heads)
        out[f"blk.{layer}.{gname}.{kind}"] = w
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        out["rope_freqs.weight"] = torch.from_numpy(llama3_rope_factors(cfg))
    elif kind == "factors":
        out["rope_freqs.weight"] = torch.tensor(scaling["factors"], dtype=torch.float32)
    return {k: np.ascontiguousarray(v.numpy()) for k, v in out.items()}


def encode_tensor(gguf, name: str, data: np.ndarray, dtype: str):
    """``(array, GGML type)`` for one tensor (``ModelBase.prepare_tensors``' choice of type)."""
    Q = gguf.GGMLQuantizationType
    if data.ndim <= 1 or name.endswith("_norm.weight") or dtype == "f32":
        return data.astype(np.float32), Q.F32
    if dtype == "q8_0":
        try:
            return gguf.quants.quantize(data, Q.Q8_0), Q.Q8_0
        except gguf.QuantError:   # rows not a multiple of the 32-value block: f16, as convert_hf_to_gguf.py
            dtype = "f16"
    qtype = Q.F16 if dtype == "f16" else Q.BF16
    return gguf.quants.quantize(data, qtype), qtype


def _write_metadata(w, cfg: LlamaConfig, name: str, file_type: int, gguf) -> None:
    w.add_name(name)
    w.add_context_length(cfg.max_context or hf.DEFAULT_CONTEXT)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    if cfg.head_dim != cfg.d_model // cfg.n_heads:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_tokenizer(w, tokenizer, vocab_size: int) -> None:
    """``tokenizer.ggml.*`` and the chat template; ids past the tokenizer (FIM sentinels, padding) as
    ``[PAD{id}]`` of type UNUSED, as ``convert_hf_to_gguf.py`` pads a vocabulary to the embedding's rows."""
    bpe = as_bpe(tokenizer)
    tokens, types, merges = gguf_vocab(bpe)
    if len(tokens) > vocab_size:
        raise UserError(f"the tokenizer has {len(tokens)} tokens but the model's embedding only {vocab_size} rows")
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [5] * (vocab_size - len(types))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(llama_cpp_pre(bpe))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)          # never empty: gguf_vocab gives a vocabulary without merges an inert one
    if bpe.bos_id is not None:
        w.add_bos_token_id(bpe.bos_id)
    if bpe.eos_id is not None:
        w.add_eos_token_id(bpe.eos_id)
    add_bos, add_eos = adds_bos_eos(bpe)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(add_eos)
    if bpe.chat_template:
        w.add_chat_template(bpe.chat_template)


def export_gguf(params: dict, cfg: LlamaConfig, path, tokenizer=None, dtype: str = "f32",
                name: str | None = None) -> Path:
    """Write ``params`` as the GGUF file ``path`` (``dtype``: f32, f16, bf16 or q8_0 for the 2-D matrices);
    ``name`` is ``general.name`` (default: the file's stem). Returns the path."""
    check_dtype(dtype)
    arch = gguf_arch(cfg)

    def metadata(writer, gguf):
        _write_metadata(writer, cfg, name or Path(path).stem, file_type(gguf, dtype), gguf)
    return write_file(path, arch, metadata, lambda: gguf_tensors(params, cfg, arch), tokenizer, cfg.vocab_size, dtype)


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise UserError(f"GGUF dtype {dtype!r} is not supported (choose one of {', '.join(DTYPES)})")


def file_type(gguf, dtype: str) -> int:
    """``general.file_type`` of an export whose matrices are ``dtype``."""
    return int({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])


def write_file(path, arch: str, metadata, tensors, tokenizer, vocab_size: int, dtype: str) -> Path:
    """The one GGUF writer of every export (``models.mla_gguf``'s too): ``metadata(writer, gguf)`` adds the
    architecture's keys, then the tokenizer's (when given), then the tensors ``tensors()`` returns (name -> float32
    array, each encoded by :func:`encode_tensor`), into a temporary name in the target folder renamed into place, so
    an error leaves nothing behind. Returns the path."""
    gguf = _require_gguf()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        metadata(writer, gguf)
        if tokenizer is not None:
            _write_tokenizer(writer, tokenizer, vocab_size)
        for tname, data in tensors().items():
            array, qtype = encode_tensor(gguf, tname, data, dtype)
            writer.add_tensor(tname, array, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(tmp, "rb") as f:      # the writer closes without an fsync: make the bytes durable first
            os.fsync(f.fileno())
        publish_file(tmp, path)          # the one atomic rename (core.io.cache), then the temporary name goes
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return path
