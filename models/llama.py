"""A Llama-family decoder as plain functions over a params pytree.

Follows Meta's Llama / Hugging Face ``LlamaForCausalLM`` numerics: RMSNorm (Zhang & Sennrich 2019),
rotary position embeddings in the "rotate half" layout with optional llama3 frequency scaling
(Su et al. 2021; Llama 3.1 ``rope_scaling``), grouped-query attention (Ainslie et al. 2023), SwiGLU MLP
(Shazeer 2020), tied or untied embeddings. It reads top to bottom like nanoGPT's ``model.py``, except that
nothing here owns state: ``init(cfg, seed) -> params`` and ``apply(params, tokens, cfg) -> logits``.

Params (weights in torch's ``(out, in)`` layout, so Hugging Face tensors map one to one)::

    embed                [vocab, d]
    layers.attn_norm     [L, d]
    layers.attn.wq       [L, n_heads * head_dim, d]
    layers.attn.wk       [L, n_kv_heads * head_dim, d]
    layers.attn.wv       [L, n_kv_heads * head_dim, d]
    layers.attn.wo       [L, d, n_heads * head_dim]
    layers.attn.q_bias   [L, n_heads * head_dim]      (q/k/v biases only when qkv_bias, as Qwen2)
    layers.attn.k_bias   [L, n_kv_heads * head_dim]
    layers.attn.v_bias   [L, n_kv_heads * head_dim]
    layers.mlp_norm      [L, d]
    layers.mlp.w_gate    [L, ffn, d]
    layers.mlp.w_up      [L, ffn, d]
    layers.mlp.w_down    [L, d, ffn]
    norm                 [d]
    lm_head              [vocab, d]   (absent when tie_embeddings)

Blocks are stacked along a leading layer axis (Flax ``nn.scan``, Levanter ``Stacked``) and unbound once
per forward with ``torch.unbind``, unless the caller hands the model ``layers`` (``core.layers.Layers``: the train
step's compiled block, its per-layer gradients or gathered shards, applied from outside the model).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F

from purestep.core import rng
from purestep.core.config import option
from purestep.core.layers import Layers
from purestep.core.remat import checkpoint
from purestep.core.tree import unstack
from purestep.models import losses
from purestep.models.sampling import decoding


@dataclass
class LlamaConfig:
    vocab_size: int = option(0, "vocabulary size (0: a recipe sets it from the tokenizer)", min=0)
    d_model: int = option(128, "model width", min=1)
    n_layers: int = option(4, "transformer blocks", min=1)
    n_heads: int = option(4, "query heads", min=1)
    n_kv_heads: int = option(0, "key/value heads, grouped-query attention (0: n_heads)", min=0)
    head_dim: int = option(0, "width of a head (0: d_model // n_heads)", min=0)
    ffn_dim: int = option(0, "SwiGLU hidden width (0: the Llama rule, 8/3 d_model rounded up to 64)", min=0)
    rope_theta: float = option(10000.0, "RoPE base frequency", above=0)
    rope_scaling: dict = option({}, "RoPE frequency scaling: {} or llama3's (factor, low_freq_factor, ...)")
    norm_eps: float = option(1e-5, "RMSNorm epsilon", above=0)
    tie_embeddings: bool = option(True, "the output head shares the token embedding's weights")
    qkv_bias: bool = option(False, "biases on the query/key/value projections (Qwen2)")
    max_context: int = option(0, "the longest context the model was released or trained for, carried to exported "
                                 "configs (0: not recorded; an export then states 2048)", min=0)
    sliding_window: int = option(0, "each token attends to at most this many positions, itself included "
                                    "(Mistral; 0: the whole causal context)", min=0)
    dropout: float = option(0.0, "dropout probability (0: off)", min=0, below=1)
    init_std: float = option(0.02, "standard deviation of the normal init", above=0)

    def __post_init__(self):
        if self.n_kv_heads == 0:
            self.n_kv_heads = self.n_heads
        if self.head_dim == 0:
            if self.d_model % self.n_heads:
                raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
            self.head_dim = self.d_model // self.n_heads
        if self.ffn_dim == 0:
            self.ffn_dim = 64 * math.ceil(8 * self.d_model / 3 / 64)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")


# ----------------------------------------------------------------------------------------------------------
# parameters

def init(cfg: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
         device: torch.device | str | None = None) -> dict:
    """Normal(0, init_std) matrices, output projections scaled by 1/sqrt(2 * n_layers) (GPT-2), ones for norms."""
    if cfg.vocab_size <= 0:
        raise ValueError("LlamaConfig.vocab_size is 0: set it (recipes take it from the tokenizer)")
    g = torch.Generator().manual_seed(seed)
    L, d, hd = cfg.n_layers, cfg.d_model, cfg.head_dim
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)

    def normal(*shape, s=std):
        return (torch.randn(*shape, generator=g) * s).to(dtype=dtype, device=device)

    def ones(*shape):
        return torch.ones(*shape, dtype=dtype, device=device)

    params = {
        "embed": normal(cfg.vocab_size, d),
        "layers": {
            "attn_norm": ones(L, d),
            "attn": {
                "wq": normal(L, cfg.n_heads * hd, d),
                "wk": normal(L, cfg.n_kv_heads * hd, d),
                "wv": normal(L, cfg.n_kv_heads * hd, d),
                "wo": normal(L, d, cfg.n_heads * hd, s=out_std),
            },
            "mlp_norm": ones(L, d),
            "mlp": {
                "w_gate": normal(L, cfg.ffn_dim, d),
                "w_up": normal(L, cfg.ffn_dim, d),
                "w_down": normal(L, d, cfg.ffn_dim, s=out_std),
            },
        },
        "norm": ones(d),
    }
    if cfg.qkv_bias:   # zeros, as transformers' Qwen2 initializes them
        params["layers"]["attn"].update(q_bias=torch.zeros(L, cfg.n_heads * hd, dtype=dtype, device=device),
                                        k_bias=torch.zeros(L, cfg.n_kv_heads * hd, dtype=dtype, device=device),
                                        v_bias=torch.zeros(L, cfg.n_kv_heads * hd, dtype=dtype, device=device))
    if not cfg.tie_embeddings:
        params["lm_head"] = normal(cfg.vocab_size, d)
    return params


def lm_head(params: dict) -> torch.Tensor:
    return params["lm_head"] if "lm_head" in params else params["embed"]


# ----------------------------------------------------------------------------------------------------------
# building blocks

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in (at least) float32 and cast back, as Hugging Face's ``LlamaRMSNorm``."""
    xf = x.to(upcast(x.dtype))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def upcast(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, the dtype itself for float32/float64 (norms and losses never go below fp32)."""
    return torch.promote_types(dtype, torch.float32)


def rope_frequencies(cfg: LlamaConfig, device=None) -> torch.Tensor:
    """Inverse frequencies (float64) of the head_dim / 2 rotary pairs, with llama3 scaling when configured, on
    ``device`` (on the CPU for MPS, which has no float64)."""
    device = torch.device("cpu") if device is None or torch.device(device).type == "mps" else device
    pairs = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device=device)
    inv_freq = 1.0 / (cfg.rope_theta ** (pairs / cfg.head_dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", ""))
    if kind in ("", "default"):
        return inv_freq
    if kind == "factors":   # llama.cpp's rope_freqs tensor (a GGUF's Llama 3.1 scaling): theta_i / factor_i
        factors = torch.tensor(scaling["factors"], dtype=torch.float64, device=device)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_scaling.factors has {factors.numel()} entries, head_dim / 2 is {inv_freq.numel()}")
        return inv_freq / factors
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, factors)")
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin of shape [..., T, 2n] for ``inv_freq`` [..., n] (leading dims, e.g. DBA's per layer and KV
    head, broadcast), in the rotate-half layout (pair i is dims i, i + n/2).

    Angles are computed in float64 (float32 on MPS, which has no float64) and then cast to ``dtype``.
    """
    wide = torch.float32 if positions.device.type == "mps" else torch.float64
    angles = positions.to(wide)[:, None] * inv_freq.to(device=positions.device, dtype=wide)[..., None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def position_tables(frequencies: Callable, cfg, start: int, length: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """``rope_tables(frequencies(cfg), arange(start, start + length))`` stacked as one tensor ``[2, ..., length,
    D]`` (cos, sin), computed by one opaque op (:func:`_tables`) that a compiled graph calls once and whose result
    its kernels read. Traced inline, inductor recomputes the float64 cos and sin inside every kernel that reads the
    tables (on the CPU it keeps only exp and sigmoid results), a visible part of the one-graph step at nanoGPT's
    shape (docs/design.md, 'Measured choices'). An op rather than a trace-time constant
    (``torch.compiler.assume_constant_result``): dynamo names such a constant after the function, so a graph holding
    two models (a teacher and a student) held two constants of one name and failed to compile."""
    return _tables(frequencies(cfg, device), start, length, dtype).to(device)   # MPS: computed on the CPU


@torch.library.custom_op("purestep::rope_tables", mutates_args=())
def _tables(inv_freq: torch.Tensor, start: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`rope_tables` of ``inv_freq`` at positions ``start .. start + length - 1``, stacked ``[2, ..., T, D]``
    on ``inv_freq``'s device. No ``torch.device`` argument: torch 2.11's C++ wrapper cannot pass one to an op."""
    positions = torch.arange(start, start + length, device=inv_freq.device)
    return torch.stack(rope_tables(inv_freq, positions, dtype))


@_tables.register_fake
def _tables_shape(inv_freq: torch.Tensor, start: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    return inv_freq.new_empty((2, *inv_freq.shape[:-1], length, 2 * inv_freq.shape[-1]), dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, T, D] by position; ``cos``/``sin`` are [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention_mask(T: int, S: int, past_len: int = 0, window: int = 0, device=None,
                   doc: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Which of ``S`` keys each of ``T`` queries (at positions ``past_len .. past_len + T - 1``) may see:
    causal, and with ``window`` > 0 only the last ``window`` positions, itself included (Mistral's sliding
    window: key ``j`` is visible to query ``i`` iff ``i - window < j <= i``), and with ``doc`` [B, T] (the
    document id of every token of a packed row; no cache) only keys of the query's own document: the mask is
    then [B, 1, T, S]. None when SDPA's own ``is_causal`` (``T == S``, no past) or no mask at all (one query,
    the whole cache visible) says it."""
    if doc is None and (not window or window >= past_len + T):
        if past_len == 0 and T == S:
            return None
        if T == 1:
            return None
    qpos = torch.arange(past_len, past_len + T, device=device)[:, None]
    kpos = torch.arange(S, device=device)[None, :]
    mask = kpos <= qpos
    if window:
        mask = mask & (kpos > qpos - window)
    if doc is not None:   # packed documents (torchtune's packed mask; transformers' position-id packing)
        mask = mask & (doc[:, None, :, None] == doc[:, None, None, :])
    return mask


def doc_positions(doc: torch.Tensor) -> torch.Tensor:
    """RoPE positions [B, T] that restart at 0 where each document of a packed row ``doc`` [B, T] starts."""
    idx = torch.arange(doc.shape[-1], device=doc.device).expand_as(doc)
    starts = torch.ones_like(doc, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    return idx - torch.where(starts, idx, 0).cummax(dim=-1).values


def causal_attention(q, k, v, past_len: int = 0, scale: Optional[float] = None, window: int = 0,
                     doc: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal SDPA over [B, H, T, D] queries and [B, Hkv, S, D] keys/values (GQA via ``enable_gqa``); under the
    CPU's autocast, the attention written out up to ``MATH_ATTENTION_MAX_KEYS`` keys, else SDPA in fp32.

    With a KV cache the queries sit at positions ``past_len .. past_len + T - 1`` of the ``S`` keys; ``window``
    limits each query to its last ``window`` positions and ``doc`` to its own document (:func:`attention_mask`).
    ``scale`` multiplies the scores (None: SDPA's 1/sqrt(D)); values may be narrower or wider than keys.
    """
    T, S = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    mask = attention_mask(T, S, past_len, window, q.device, doc)
    causal = mask is None and past_len == 0 and T == S
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        if S <= MATH_ATTENTION_MAX_KEYS:
            return _math_attention(q, k, v, mask, causal, scale)
        return _fp32_attention(q, k, v, mask, causal, gqa, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa, scale=scale)


# Under the CPU's autocast, attention over at most this many keys is computed as nanoGPT's manual attention
# (_math_attention); longer, as SDPA in fp32 (_fp32_attention).
MATH_ATTENTION_MAX_KEYS = 128


def _math_attention(q, k, v, mask, causal: bool, scale: Optional[float]) -> torch.Tensor:
    """Attention written out, as nanoGPT's ``CausalSelfAttention`` without flash (``model.py``) computes it under
    its autocast ``ctx`` (called under the CPU's autocast only): the scores ``q @ k^T`` and ``probs @ v`` as matrix
    products in the autocast dtype, the masked softmax in fp32, the result in the autocast dtype; GQA repeats each
    key/value head over its query heads (SDPA's ``enable_gqa``).

    At short context on the CPU this is the faster attention under bf16 autocast. A compiled graph fuses the
    scaling, mask and softmax around two batched matrix products, where SDPA is a kernel apart that needs its
    inputs in fp32 (:func:`_fp32_attention`): the bf16 train step takes less time than with fp32 SDPA at nanoGPT's
    shakespeare-char shape and at 100M, for a little more peak memory (the fp32 probabilities kept for the
    backward; docs/benchmarks.md, "Whole runs", and docs/design.md, 'Measured choices'). The scores are rounded to bf16
    before the softmax, as nanoGPT's are; SDPA in fp32 keeps them exact, and is what longer contexts take."""
    T, S = q.shape[-2], k.shape[-2]
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)).float() * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        mask = scores.new_ones(T, S, dtype=torch.bool).tril()    # like the scores: a DTensor under tensor parallel
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v   # autocast: a product in its dtype, as every matmul under it


def _fp32_attention(q, k, v, mask, causal: bool, gqa: bool, scale: Optional[float]) -> torch.Tensor:
    """SDPA in fp32 under the CPU's bf16/fp16 autocast past ``MATH_ATTENTION_MAX_KEYS`` keys, the result in the
    queries' dtype. torch's CPU flash kernel, forward and backward, is slower in bf16 than in fp32 (casts
    included) at short context and ahead only at long context (docs/design.md, 'Measured choices'). fp32 scores are
    also the more exact."""
    with torch.autocast("cpu", enabled=False):
        y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal,
                                           enable_gqa=gqa, scale=scale)
    return y.to(q.dtype)


def attention(p: dict, x: torch.Tensor, cos, sin, cfg: LlamaConfig, cache: Optional[dict] = None,
              past_len: int = 0, doc: Optional[torch.Tensor] = None) -> torch.Tensor:
    B, T, _ = x.shape
    q = F.linear(x, p["wq"], p.get("q_bias")).view(B, T, cfg.n_heads, cfg.head_dim).transpose(1, 2)
    k = F.linear(x, p["wk"], p.get("k_bias")).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
    v = F.linear(x, p["wv"], p.get("v_bias")).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cache is not None:
        k, v = cache_append(cache, k, v, past_len)
    y = causal_attention(q, k, v, past_len, window=cfg.sliding_window, doc=doc)
    return F.linear(y.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.head_dim), p["wo"])


def mlp(p: dict, x: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, p["w_gate"])) * F.linear(x, p["w_up"]), p["w_down"])


def block(p: dict, x: torch.Tensor, cos, sin, cfg: LlamaConfig, key=None, cache=None, past_len: int = 0,
          attend: Optional[Callable] = None, doc: Optional[torch.Tensor] = None):
    """Pre-norm residual block: ``x + attend(norm(x))``, then ``+ mlp(norm(x))`` (``attend``: this module's
    ``attention`` unless a variant passes its own, as ``models.dba`` does; ``doc``: packed documents' ids)."""
    extra = {} if doc is None else {"doc": doc}
    h = (attend or attention)(p["attn"], rms_norm(x, p["attn_norm"], cfg.norm_eps), cos, sin, cfg, cache, past_len,
                              **extra)
    if key is not None:
        h = rng.dropout(rng.fold_in(key, 1), h, cfg.dropout)
    x = x + h
    h = mlp(p["mlp"], rms_norm(x, p["mlp_norm"], cfg.norm_eps))
    if key is not None:
        h = rng.dropout(rng.fold_in(key, 2), h, cfg.dropout)
    return x + h


# ----------------------------------------------------------------------------------------------------------
# the model

def apply(params: dict, tokens: torch.Tensor, cfg: LlamaConfig, *, key: Optional[torch.Tensor] = None,
          return_hidden: bool | str = False, cache: Optional[list] = None, past_len: int = 0,
          remat: bool = False, doc: Optional[torch.Tensor] = None, layers: Optional[Layers] = None):
    """Logits [B, T, vocab] for ``tokens`` [B, T]. ``key`` turns on dropout (training); ``return_hidden=True``
    also returns the residual stream entering every block plus the last block's output (``L + 1`` tensors),
    ``"only"`` just that list, without the head; ``cache`` (:func:`new_cache`): an incremental decode step at
    ``past_len``; ``remat``: each block recomputed in backward (``torch.autograd`` only; dropout masks come from the
    counter-based key); ``doc`` [B, T]: packed rows' document ids (``core.data.documents``: attention inside a
    document, RoPE restarting at each); ``layers`` (``core.layers.Layers``, from the step): how the blocks run."""
    if doc is None:
        tables = position_tables(rope_frequencies, cfg, past_len, tokens.shape[1], params["embed"].dtype,
                                 tokens.device).unbind(0)
    else:
        B, T = doc.shape
        cos, sin = rope_tables(rope_frequencies(cfg), doc_positions(doc).flatten(), params["embed"].dtype)
        tables = cos.view(B, 1, T, -1), sin.view(B, 1, T, -1)
    return apply_with(params, tokens, cfg, itertools.repeat(tables), block, key=key, return_hidden=return_hidden,
                      cache=cache, past_len=past_len, remat=remat, doc=doc, layers=layers)


def apply_with(params: dict, tokens: torch.Tensor, cfg, layer_tables: Iterable, block_fn: Callable, *,
               key: Optional[torch.Tensor] = None, return_hidden: bool | str = False, cache: Optional[list] = None,
               past_len: int = 0, remat: bool = False, doc: Optional[torch.Tensor] = None,
               layers: Optional[Layers] = None):
    """The decoder every Llama variant shares (``apply`` here, ``models.dba.apply``): embedding (+ dropout),
    ``block_fn`` per layer with that layer's ``(cos, sin)`` from ``layer_tables``, the final norm and the
    (tied or untied) head. The keyword arguments are ``apply``'s (``doc`` reaches ``block_fn`` only when given)."""
    extra = {} if doc is None else {"doc": doc}
    x = F.embedding(tokens, params["embed"])
    if key is not None:
        x = rng.dropout(rng.fold_in(key, 0), x, cfg.dropout)
    stacked = unstack(params["layers"]) if layers is None else layers.unstack(params["layers"])
    block_fn = block_fn if layers is None else layers.block(block_fn)   # e.g. compiled once for every layer
    hidden = []
    for i, (lp, (cos, sin)) in enumerate(zip(stacked, layer_tables)):
        hidden.append(x)
        layer_key = None if key is None else rng.fold_in(key, 1000 + i)
        if remat and cache is None:
            x = checkpoint(block_fn, lp, x, cos, sin, cfg, layer_key, **extra)
        else:
            x = block_fn(lp, x, cos, sin, cfg, layer_key, None if cache is None else cache[i], past_len, **extra)
    hidden.append(x)
    if return_hidden == "only":
        return hidden
    logits = F.linear(rms_norm(x, params["norm"], cfg.norm_eps), lm_head(params))
    return (logits, hidden) if return_hidden else logits


def loss(params: dict, batch: dict, cfg: LlamaConfig, key: Optional[torch.Tensor] = None,
         remat: bool = False, layers: Optional[Layers] = None) -> torch.Tensor:
    """Mean next-token cross entropy of ``batch = {"x": [B, T], "y": [B, T]}`` (targets < 0 ignored; ``batch["doc"]``
    and ``layers`` as :func:`apply`'s ``doc`` and ``layers``)."""
    x = apply(params, batch["x"], cfg, key=key, remat=remat, doc=batch.get("doc"), layers=layers,
              return_hidden="only")[-1]
    return next_token_loss(params, x, batch["y"], cfg, layers)


def head_loss(x: torch.Tensor, norm: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, eps: float):
    """The loss tail (final norm, head, cross entropy): a step compiles it apart from the blocks (``Layers.head``)."""
    return losses.cross_entropy(F.linear(rms_norm(x, norm, eps), head), targets)


def next_token_loss(params: dict, x: torch.Tensor, targets: torch.Tensor, cfg, layers: Optional[Layers] = None):
    """Every Llama variant's ``loss`` from its last block's output ``x``: :func:`head_loss` under ``layers.head``."""
    tail = head_loss if layers is None else layers.head(head_loss)
    return tail(x, params["norm"], lm_head(params), targets, cfg.norm_eps)


# ----------------------------------------------------------------------------------------------------------
# KV cache for generation

def new_cache(cfg: LlamaConfig, batch: int, max_len: int, dtype=torch.float32, device=None) -> list:
    """One ``{"k", "v"}`` buffer pair per layer, [B, n_kv_heads, max_len, head_dim]."""
    shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
    return [{"k": torch.zeros(shape, dtype=dtype, device=device), "v": torch.zeros(shape, dtype=dtype, device=device)}
            for _ in range(cfg.n_layers)]


def cache_append(cache: dict, k: torch.Tensor, v: torch.Tensor, past_len: int):
    """Write this step's keys/values at ``past_len`` and return the filled prefix (the one mutable buffer)."""
    end = past_len + k.shape[-2]
    cache["k"][:, :, past_len:end] = k
    cache["v"][:, :, past_len:end] = v
    return cache["k"][:, :, :end], cache["v"][:, :, :end]


def decoder(params: dict, cfg: LlamaConfig, batch: int, max_len: int):
    """``forward(tokens, past_len) -> logits`` over a fresh KV cache, for ``models.sampling.generate``."""
    leaf = params["embed"]
    return decoding(apply, params, cfg, new_cache(cfg, batch, max_len, dtype=leaf.dtype, device=leaf.device))


def matmul_params(params: dict) -> int:
    """Parameters used in matrix products per token (for FLOPs/MFU): all but an untied input embedding."""
    from purestep.core.tree import size
    return size(params) - (params["embed"].numel() if "lm_head" in params else 0)


def kv_bytes_per_token(cfg: LlamaConfig, dtype_bytes: int = 2) -> int:
    """Cached bytes per token over all layers: 2 * n_kv_heads * head_dim per layer."""
    return cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
