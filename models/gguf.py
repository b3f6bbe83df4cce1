"""Load a Llama or Qwen2 GGUF file (llama.cpp's format) into purestep params, config and tokenizer.

Follows, in reverse, llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel``): its tensor names
(``token_embd``, ``blk.N.attn_q`` ...), its metadata keys (``llama.block_count`` ...) and the row permutation
it applies to the Q and K projections (``LlamaModel.permute``: Meta's interleaved rotary pairs, so that
llama.cpp's RoPE can rotate adjacent rows). That permutation is undone here, which gives the Hugging Face
"rotate half" layout our ``models.llama`` uses. Quantized tensors are dequantized to float32 with the
``gguf`` package (``gguf.dequantize``); they come out in torch's ``(out, in)`` order.

A ``qwen2`` file (``convert_hf_to_gguf.py``'s ``Qwen2Model``) is the same decoder under ``qwen2.*`` keys with
biases on the q/k/v projections (``blk.N.attn_q.bias`` ...; ``LlamaConfig.qkv_bias``) and NO Q/K permutation:
llama.cpp rotates Qwen2 in the NEOX ("rotate half") layout, which is ours already. A sliding window
(``{arch}.attention.sliding_window``) or any other key ``models.llama`` does not compute is refused by name.

The tokenizer comes from the file's embedded vocabulary the way transformers builds it
(``integrations/gguf/gguf_tokenizer_mapping.py``: ``byte_level_tokenizer`` + ``add_gguf_special_tokens``):
a byte-level BPE over the file's tokens and merges, control tokens (type 3) as special added tokens,
user-defined tokens (type 4) as plain added tokens, no normalizer, GPT-2's ByteLevel pre-tokenizer and
decoder. Only ``tokenizer.ggml.model == "gpt2"`` with the GPT-2 split regex (``pre`` gpt-2, smollm, or gpt2 as
purestep's exports wrote it before they used llama.cpp's name) is built; anything else is refused rather than
tokenized differently from the model's training. The file's ``pre`` is kept on the tokenizer (``gguf_pre``) for
``models.gguf_export``.

Needs the optional ``gguf`` and ``tokenizers`` packages (``pip install purestep[hf]``).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch

from purestep.core.config import UserError
from purestep.core.data.tokenizers import BPETokenizer
from purestep.core.tree import cast
from purestep.models import hf
from purestep.models.llama import LlamaConfig
from purestep.models.tokenizer_export import bytes_to_unicode

# GGUF tensor name -> Hugging Face name (llama.cpp's ``gguf-py/gguf/tensor_mapping.py``, for Llama)
BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
QKV = ("attn_q", "attn_k", "attn_v")
TOP_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
ARCHS = ("llama", "qwen2")  # Qwen2: Llama plus q/k/v biases, Q/K not permuted (llama.cpp rotates it NEOX-style)
GPT2_REGEX_PRE = (None, "gpt-2", "gpt2", "smollm")   # tokenizer.ggml.pre values that split with GPT-2's regex
CONTROL, USER_DEFINED = 3, 4                # llama.cpp token types


def _require_gguf():
    try:
        import gguf
    except ImportError:
        raise UserError("reading a .gguf file needs the optional 'gguf' package: pip install purestep[hf]") from None
    return gguf


def open_gguf(path) -> "gguf.GGUFReader":
    gguf = _require_gguf()
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/struct errors on a bad magic or a truncated file
        raise UserError(f"{path}: not a readable GGUF file ({e})") from None


def metadata(reader, key: str, default=None):
    """The value of a metadata field (str, number, bool or list), or ``default`` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _float(value) -> float:
    """A float32 metadata value as the decimal it was written from (``1e-05``, not ``9.99999974e-06``)."""
    return float(str(np.float32(value)))


def _need(reader, path, key: str):
    value = metadata(reader, key)
    if value is None:
        raise UserError(f"{path}: GGUF metadata field {key!r} is missing")
    return value


# ----------------------------------------------------------------------------------------------------------
# config

def config_from_gguf(reader, path="GGUF file") -> LlamaConfig:
    """``LlamaConfig`` from the ``{arch}.*`` metadata (arch ``llama`` or ``qwen2``, whose q/k/v projections have
    biases); refuses features ``models.llama`` does not implement."""
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHS:
        raise UserError(f"{path}: general.architecture is {arch!r}; only {' and '.join(map(repr, ARCHS))} GGUF "
                        f"files are supported")
    n_heads = int(_need(reader, path, f"{arch}.attention.head_count"))
    d_model = int(_need(reader, path, f"{arch}.embedding_length"))
    head_dim = int(metadata(reader, f"{arch}.attention.key_length", d_model // n_heads))
    value_dim = int(metadata(reader, f"{arch}.attention.value_length", head_dim))
    rope_dim = int(metadata(reader, f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim:
        raise UserError(f"{path}: {arch}.attention.value_length={value_dim} differs from key_length={head_dim}; "
                        f"unsupported")
    if rope_dim != head_dim:
        raise UserError(f"{path}: {arch}.rope.dimension_count={rope_dim} rotates part of a {head_dim}-dim head; "
                        f"only full rotary embeddings are supported")
    scaling = metadata(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise UserError(f"{path}: {arch}.rope.scaling.type={scaling!r} is not supported (only llama3 rope scaling "
                        f"is, as a rope_freqs.weight tensor or from a Hugging Face config.json)")
    window = metadata(reader, f"{arch}.attention.sliding_window")
    if window:
        raise UserError(f"{path}: {arch}.attention.sliding_window={window} is not supported (no attention window "
                        f"is read from a GGUF file; a Mistral Hugging Face folder carries one)")
    factors = _rope_factors(reader, head_dim, path)
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    vocab = _embedding_rows(reader, path)
    if tokens and len(tokens) != vocab:
        raise UserError(f"{path}: tokenizer.ggml.tokens lists {len(tokens)} tokens but token_embd.weight has "
                        f"{vocab} rows")
    names = {t.name for t in reader.tensors}
    return LlamaConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_layers=int(_need(reader, path, f"{arch}.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(metadata(reader, f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(_need(reader, path, f"{arch}.feed_forward_length")),
        rope_theta=_float(metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=_float(_need(reader, path, f"{arch}.attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in names,
        qkv_bias=arch == "qwen2",
        max_context=int(metadata(reader, f"{arch}.context_length", 0)),
        rope_scaling={"rope_type": "factors", "factors": factors} if factors else {},
    )


def _rope_factors(reader, head_dim: int, path="GGUF file") -> list:
    """The ``rope_freqs.weight`` tensor (llama.cpp's form of Llama 3.1's rope scaling: each rotary pair's angle
    divided by its factor) as a list of floats, or [] when the file has none."""
    gguf = _require_gguf()
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            factors = np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1).tolist()
            if len(factors) != head_dim // 2:
                raise UserError(f"{path}: rope_freqs.weight has {len(factors)} entries, head_dim / 2 is {head_dim // 2}")
            if not all(f > 0 for f in factors):
                raise UserError(f"{path}: rope_freqs.weight holds a factor <= 0 (each divides a rotary frequency)")
            return factors
    return []


def _embedding_rows(reader, path="GGUF file") -> int:
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[-1])  # GGUF lists dimensions innermost first
    raise UserError(f"{path}: no token_embd.weight tensor")


# ----------------------------------------------------------------------------------------------------------
# weights

def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo ``convert_hf_to_gguf.py``'s ``LlamaModel.permute``: view the rows as (heads, head_dim/2, 2), swap the
    last two row axes to (heads, 2, head_dim/2) and flatten back."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_state_dict(reader, cfg: LlamaConfig, path="GGUF file") -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under its Hugging Face name, Q and K un-permuted (llama only: a
    qwen2 file keeps Hugging Face's row order, and its q/k/v biases)."""
    gguf = _require_gguf()
    heads = {} if cfg.qkv_bias else {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads}
    suffixes = ("weight", "bias") if cfg.qkv_bias else ("weight",)
    sd = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":   # read into the config (rope_scaling "factors")
            continue
        w = torch.from_numpy(np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32))  # a copy
        block, layer, part, kind = (t.name.split(".") + ["", "", "", ""])[:4]
        if t.name in TOP_TENSORS:
            sd[TOP_TENSORS[t.name]] = w
        elif block == "blk" and layer.isdigit() and part in BLOCK_TENSORS and kind in suffixes \
                and (kind == "weight" or part in QKV):
            if part in heads:
                if w.shape[0] != heads[part] * cfg.head_dim:
                    raise UserError(f"{path}: {t.name} has {w.shape[0]} rows, the metadata implies "
                                    f"{heads[part]} heads x {cfg.head_dim}")
                w = unpermute_rows(w, heads[part])
            sd[f"model.layers.{layer}.{BLOCK_TENSORS[part]}.{kind}"] = w
        else:
            hint = " (attention/MLP biases are not supported, apart from a qwen2 file's q/k/v biases)" \
                if t.name.endswith(".bias") else ""
            raise UserError(f"{path}: unsupported tensor {t.name!r}{hint}")
    return sd


def params_from_gguf(reader, cfg: LlamaConfig, path="GGUF file", device=None) -> dict:
    """float32 params on ``device``, blocks stacked along a leading layer axis (shapes checked by ``models.hf``)."""
    params = hf.params_from_state_dict(hf_state_dict(reader, cfg, path), cfg, str(path))
    return cast(params, device=device)


def quantization(reader) -> str:
    """The file's quantization as llama.cpp names it (``general.file_type``), e.g. ``Q4_1``."""
    gguf = _require_gguf()
    file_type = metadata(reader, "general.file_type")
    if file_type is not None:
        try:
            return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    counts = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    return counts.most_common(1)[0][0] if counts else "F32"


# ----------------------------------------------------------------------------------------------------------
# tokenizer

def tokenizer_json(reader, path="GGUF file") -> str:
    """A Hugging Face ``tokenizer.json`` for the file's embedded byte-level BPE vocabulary."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise UserError("building a GGUF tokenizer needs the optional 'tokenizers' package: "
                        "pip install purestep[hf]") from None
    kind = metadata(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UserError(f"{path}: tokenizer.ggml.model={kind!r}; only byte-level BPE ('gpt2') is supported")
    pre = metadata(reader, "tokenizer.ggml.pre")
    if pre not in GPT2_REGEX_PRE:
        raise UserError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported "
                        f"(supported: {', '.join(p for p in GPT2_REGEX_PRE if p)})")
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    merges = metadata(reader, "tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise UserError(f"{path}: the GGUF has no embedded tokenizer (tokenizer.ggml.tokens / merges)")
    types = metadata(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
             for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], fuse_unk=False,
                               byte_fallback=False, continuing_subword_prefix="", end_of_word_suffix=""))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab])
    tok.post_processor = _template(reader, tokens)
    return tok.to_str()


def _template(reader, tokens):
    """Post-processor adding BOS/EOS when the file asks for it (``add_bos_token``/``add_eos_token``)."""
    from tokenizers import processors
    added = {}
    for which in ("bos", "eos"):
        token_id = metadata(reader, f"tokenizer.ggml.{which}_token_id")
        if metadata(reader, f"tokenizer.ggml.add_{which}_token", False) and token_id is not None:
            added[which] = (tokens[token_id], int(token_id))
    bos = [added["bos"][0]] if "bos" in added else []
    eos = [added["eos"][0]] if "eos" in added else []
    single = bos + ["$A:0"] + eos
    pair = single + [f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos]
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                         special_tokens=list(added.values()))


def tokenizer_from_gguf(reader, path="GGUF file") -> BPETokenizer:
    """The embedded tokenizer with the file's own BOS/EOS ids (``tokenizer.ggml.bos_token_id``/``eos_token_id``)."""
    tok = BPETokenizer(tokenizer_json(reader, path), source=str(path),
                       chat_template=metadata(reader, "tokenizer.chat_template"),
                       gguf_pre=metadata(reader, "tokenizer.ggml.pre"))
    for attr, key in (("bos_id", "tokenizer.ggml.bos_token_id"), ("eos_id", "tokenizer.ggml.eos_token_id")):
        value = metadata(reader, key)
        if value is not None:
            setattr(tok, attr, int(value))
    return tok


def special_tokens(reader) -> dict:
    """``{"bos_token": "<|im_start|>", ...}`` from the file's special token ids, for ``tokenizer_config.json``."""
    tokens = metadata(reader, "tokenizer.ggml.tokens") or []
    out = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        value = metadata(reader, f"tokenizer.ggml.{key}")
        if value is not None and value < len(tokens):
            out[name] = tokens[value]
    template = metadata(reader, "tokenizer.chat_template")
    if template:
        out["chat_template"] = template
    return out


# ----------------------------------------------------------------------------------------------------------

def load_gguf(path, device=None) -> tuple[dict, LlamaConfig, BPETokenizer | None, str]:
    """``(params, config, tokenizer, description)`` of a llama or qwen2 GGUF; params are float32 on ``device``."""
    path = Path(path)
    reader = open_gguf(path)
    cfg = config_from_gguf(reader, path)
    params = params_from_gguf(reader, cfg, path, device)
    tok = tokenizer_from_gguf(reader, path) if metadata(reader, "tokenizer.ggml.model") else None
    quant, arch = quantization(reader), metadata(reader, "general.architecture")
    return params, cfg, tok, f"GGUF ({arch}, {quant})" if quant == "F32" else f"GGUF ({arch}, {quant} dequantized)"
