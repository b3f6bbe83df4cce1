"""Multi-head latent attention (MLA): a Llama whose keys and values come from one small latent per token, shared by
all of a layer's heads, plus one shared RoPE key, so the KV cache holds ``kv_lora_rank + qk_rope_head_dim`` values
per token and layer.

This is DeepSeek-V2's attention (DeepSeek-AI 2024, arXiv 2405.04434, sec. 2.1) without the query compression
(``q_lora_rank=None``, as DeepSeek-V2-Lite) and without YaRN, computed as transformers'
``models/deepseek_v2/modeling_deepseek_v2.py`` (``DeepseekV2Attention``) computes it, and it is the form MHA2MLA
(Ji et al. 2025, arXiv 2502.14837) and TransMLA (Meng et al. 2025, arXiv 2502.07864) convert a Llama into: the
upcycle recipe's MLA student. ``models/mla_hf.py`` and ``models/mla_gguf.py`` write it in DeepSeek-V2's own formats.

Per layer, for a block input x (after the attention RMSNorm), query head h::

    [q_nope_h | q_rope_h] = W_q,h x                 [qk_nope_head_dim | qk_rope_head_dim]
    [c | k_rope]          = W_kv_a x                [kv_lora_rank | qk_rope_head_dim]   (shared by all heads)
    c_n                   = RMSNorm(c) * kv_norm    (DeepSeek's kv_a_layernorm, eps = KV_NORM_EPS = 1e-6)
    [k_nope_h | v_h]      = W_kv_b,h c_n            [qk_nope_head_dim | v_head_dim]
    score_ij = (q_nope_h,i . k_nope_h,j + R_i q_rope_h,i . R_j k_rope_j) / sqrt(qk_nope_head_dim + qk_rope_head_dim)
    y = W_o [softmax(score) v  for every head]      W_o: [d, n_heads * v_head_dim]

The latent's RMSNorm takes eps 1e-6 whatever ``norm_eps`` is: DeepSeek's ``modeling_deepseek.py`` and transformers'
``DeepseekV2Attention`` both build ``DeepseekV2RMSNorm(kv_lora_rank)`` with its default eps, 1e-6, and never pass
``rms_norm_eps`` to it. llama.cpp's ``deepseek2`` normalizes it at ``rms_norm_eps`` instead; ``models.mla_gguf``
makes the two agree by scaling the latent rows of W_kv_a (RMSNorm_e(a c) = RMSNorm_{e / a^2}(c)).

RoPE rotates the ``qk_rope_head_dim`` dims at inverse frequencies ``rope_theta ** (-2i / qk_rope_head_dim)`` with the
config's ``rope_scaling`` applied (``llama.rope_frequencies`` of a config whose head_dim is qk_rope_head_dim, so
llama3 scaling carries over), in the rotate-half layout of ``models/llama.py`` (pair i = dims i, i + d_r/2). DeepSeek
rotates interleaved pairs (2i, 2i+1; transformers' ``apply_rotary_emb`` through ``view_as_complex``, llama.cpp's
"normal" RoPE): the exports permute the rope rows of W_q and W_kv_a, nothing here does.

Params (torch ``(out, in)`` layout, stacked along a leading layer axis; everything outside ``layers.attn`` has
exactly ``models.llama``'s names and shapes)::

    layers.attn.wq       [L, n_heads * (qk_nope_head_dim + qk_rope_head_dim), d]   per head [q_nope | q_rope]
    layers.attn.wkv_a    [L, kv_lora_rank + qk_rope_head_dim, d]                   [latent c | shared k_rope]
    layers.attn.kv_norm  [L, kv_lora_rank]
    layers.attn.wkv_b    [L, n_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]   per head [k_nope | v]
    layers.attn.wo       [L, d, n_heads * v_head_dim]

A per-layer KV budget (``kv_ranks``, ``models/kv_budget.py``) keeps this one stacked shape at kv_lora_rank =
max(kv_ranks): layer l's latent rows r >= kv_ranks[l] of wkv_a, its kv_norm entries there and its wkv_b columns
there are zero, so those latent dims are zero, their gradients are exactly zero (d c_n / d c is zero through a zero
kv_norm entry, d rms / d c_i is proportional to c_i = 0, and wkv_b's column gradient is c_n,i = 0 times the output
gradient), and AdamW keeps them zero (zero moments; decoupled decay of zero is zero). The forward is unchanged: a
latent of live width r zero-padded to R has rms_R(c)^2 + e = (r/R) (rms_r(c)^2 + e R/r), so RMSNorm over R with
eps e is sqrt(R/r) times RMSNorm over the live dims with eps e R/r; ``models.mla_surgery`` folds sqrt(r/R) into
kv_norm (the eps stays 1e-6 in R's units: in live units e R/r, a relative change of order e R/r / mean(c^2)).

Decoding (``new_cache``/``decoder``) caches only ``c_n`` [B, max_len, kv_lora_rank] and the rotated ``k_rope``
[B, max_len, qk_rope_head_dim] per layer and absorbs the up-projections (DeepSeek-V2 sec. 2.1.2): W_uk,h (the k_nope
rows of W_kv_b) moves onto the query, ``q~_h = W_uk,h^T q_nope_h``, so the scores are taken against ``c_n`` itself
(``q~_h . c_n,j = q_nope_h . k_nope_h,j``), and the attention output over ``c_n`` is up-projected by W_uv,h (the v
rows) before W_o. The full forward (no cache) expands keys and values per head, as transformers does.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from purestep.core.config import option
from purestep.core.layers import Layers
from purestep.models import llama
from purestep.models.sampling import decoding
from purestep.models.llama import LlamaConfig, apply_rope, rms_norm

KV_NORM_EPS = 1e-6   # DeepseekV2RMSNorm's default, which DeepSeek-V2's kv_a_layernorm is built with


@dataclass
class MLAConfig(LlamaConfig):
    """A LlamaConfig (the teacher's numbers; its head_dim and n_kv_heads are informational, MLA's heads are n_heads)
    plus the latent and head widths of DeepSeek-V2's attention."""
    kv_lora_rank: int = option(64, "width of the latent every head's keys and values are projected from", min=1)
    qk_rope_head_dim: int = option(16, "width of the RoPE part of a query head and of the shared RoPE key (even)",
                                   min=2)
    qk_nope_head_dim: int = option(16, "width of the no-RoPE part of a query/key head", min=0)
    v_head_dim: int = option(32, "width of a value head", min=1)
    kv_ranks: tuple[int, ...] = option((), "per-layer live latent widths, each at most kv_lora_rank (a per-layer "
                                       "KV budget, models/kv_budget.py; empty: every layer kv_lora_rank)", min=1)

    def __post_init__(self):
        super().__post_init__()
        if self.kv_lora_rank < 1 or self.qk_nope_head_dim < 0 or self.v_head_dim < 1:
            raise ValueError(f"need kv_lora_rank >= 1, qk_nope_head_dim >= 0, v_head_dim >= 1 (got "
                             f"{self.kv_lora_rank}, {self.qk_nope_head_dim}, {self.v_head_dim})")
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and >= 2 (rotary pairs)")
        if self.sliding_window:
            raise ValueError(f"sliding_window={self.sliding_window}: MLA attends to the whole causal context "
                             f"(DeepSeek-V2 has no window); use sliding_window=0")
        if self.qkv_bias:
            raise ValueError("qkv_bias=true: MLA has no attention biases (DeepSeek-V2's format has no query bias)")
        if self.kv_ranks and (len(self.kv_ranks) != self.n_layers or max(self.kv_ranks) > self.kv_lora_rank):
            raise ValueError(f"kv_ranks={self.kv_ranks}: need one live latent width per layer ({self.n_layers}), "
                             f"each at most kv_lora_rank={self.kv_lora_rank}")
        rope_frequencies(self)   # a rope_scaling that does not fit qk_rope_head_dim fails here, by name

    @classmethod
    def from_teacher(cls, teacher: LlamaConfig, *, kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int,
                     v_head_dim: int, kv_ranks: Optional[tuple] = None) -> "MLAConfig":
        base = {k: v for k, v in asdict(teacher).items() if k in LlamaConfig.__dataclass_fields__}
        return cls(**base, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                   qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, kv_ranks=tuple(kv_ranks or ()))


def live_ranks(cfg: MLAConfig) -> list:
    """Each layer's live latent width: ``kv_ranks``, or kv_lora_rank for every layer."""
    return list(cfg.kv_ranks) or [cfg.kv_lora_rank] * cfg.n_layers


def qk_head_dim(cfg: MLAConfig) -> int:
    return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim


def softmax_scale(cfg: MLAConfig) -> float:
    """DeepSeek-V2's score scale, 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)."""
    return qk_head_dim(cfg) ** -0.5


def rope_frequencies(cfg: MLAConfig, device=None) -> torch.Tensor:
    """Inverse frequencies (float64) of the qk_rope_head_dim / 2 rotary pairs, the config's rope_scaling applied."""
    rope = LlamaConfig(d_model=cfg.qk_rope_head_dim, n_heads=1, rope_theta=cfg.rope_theta,
                       rope_scaling=cfg.rope_scaling)
    return llama.rope_frequencies(rope, device)


# ----------------------------------------------------------------------------------------------------------
# parameters

def init(cfg: MLAConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
         device: torch.device | str | None = None) -> dict:
    """``llama.init`` (embedding, norms, MLP, head) with the attention replaced: Normal(0, init_std) projections,
    W_o scaled by 1/sqrt(2 * n_layers) as llama's, the latent's norm ones."""
    params = llama.init(cfg, seed, dtype, device)
    g = torch.Generator().manual_seed(seed + 1)
    L, d, H, r = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.kv_lora_rank

    def normal(*shape, s=cfg.init_std):
        return (torch.randn(*shape, generator=g) * s).to(dtype=dtype, device=device)

    params["layers"]["attn"] = {
        "wq": normal(L, H * qk_head_dim(cfg), d),
        "wkv_a": normal(L, r + cfg.qk_rope_head_dim, d),
        "kv_norm": torch.ones(L, r, dtype=dtype, device=device),
        "wkv_b": normal(L, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), r),
        "wo": normal(L, d, H * cfg.v_head_dim, s=cfg.init_std / math.sqrt(2 * L)),
    }
    return params


# ----------------------------------------------------------------------------------------------------------
# attention

def project(p: dict, x: torch.Tensor, cos, sin, cfg: MLAConfig):
    """``(q_nope [B, H, T, dn], q_rope [B, H, T, dr], c_n [B, T, r], k_rope [B, 1, T, dr])``, the RoPE parts
    rotated."""
    B, T, _ = x.shape
    q = F.linear(x, p["wq"]).view(B, T, cfg.n_heads, qk_head_dim(cfg)).transpose(1, 2)
    q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    c, k_rope = F.linear(x, p["wkv_a"]).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    c_n = rms_norm(c, p["kv_norm"], KV_NORM_EPS)
    return q_nope, apply_rope(q_rope, cos, sin), c_n, apply_rope(k_rope[:, None], cos, sin)


def up_projections(p: dict, cfg: MLAConfig):
    """W_uk [H, dn, r] and W_uv [H, dv, r]: the per-head k_nope and v rows of W_kv_b."""
    w = p["wkv_b"].view(cfg.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return w.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)


def attention(p: dict, x: torch.Tensor, cos, sin, cfg: MLAConfig, cache: Optional[dict] = None,
              past_len: int = 0, doc: Optional[torch.Tensor] = None) -> torch.Tensor:
    """MLA for ``x`` [B, T, d]; ``cos``/``sin`` [T, qk_rope_head_dim] ([B, 1, T, .] with ``doc``, packed
    documents' ids). Without a cache, keys and values expanded per head (transformers' ``DeepseekV2Attention``);
    with one, the absorbed form over the cached latent."""
    if cache is not None:
        return absorbed_attention(p, x, cos, sin, cfg, cache, past_len)
    B, T, _ = x.shape
    q_nope, q_rope, c_n, k_rope = project(p, x, cos, sin, cfg)
    kv = F.linear(c_n, p["wkv_b"]).view(B, T, cfg.n_heads, -1).transpose(1, 2)
    k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
    q = torch.cat([q_nope, q_rope], dim=-1)
    k = torch.cat([k_nope, k_rope.expand(B, cfg.n_heads, T, cfg.qk_rope_head_dim)], dim=-1)
    y = llama.causal_attention(q, k, v, scale=softmax_scale(cfg), doc=doc)
    return F.linear(y.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.v_head_dim), p["wo"])


def absorbed_attention(p: dict, x: torch.Tensor, cos, sin, cfg: MLAConfig, cache: dict,
                       past_len: int) -> torch.Tensor:
    """MLA over ``cache`` (``{"latent", "k_rope"}``, this step's entries written at ``past_len``) with W_uk absorbed
    into the queries and W_uv applied after the attention (DeepSeek-V2 sec. 2.1.2): one shared key/value head of
    width kv_lora_rank (+ the RoPE key), as multi-query attention."""
    B, T, _ = x.shape
    q_nope, q_rope, c_n, k_rope = project(p, x, cos, sin, cfg)
    end = past_len + T
    cache["latent"][:, past_len:end] = c_n
    cache["k_rope"][:, past_len:end] = k_rope[:, 0]
    latent, keys_rope = cache["latent"][:, None, :end], cache["k_rope"][:, None, :end]   # [B, 1, S, .]
    w_uk, w_uv = up_projections(p, cfg)
    q = torch.cat([torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk), q_rope], dim=-1)
    k = torch.cat([latent, keys_rope], dim=-1)
    y = llama.causal_attention(q, k, latent, past_len, scale=softmax_scale(cfg))      # [B, H, T, r]
    y = torch.einsum("bhtr,hvr->bthv", y, w_uv)
    return F.linear(y.reshape(B, T, cfg.n_heads * cfg.v_head_dim), p["wo"])


def block(p: dict, x: torch.Tensor, cos, sin, cfg: MLAConfig, key=None, cache=None, past_len: int = 0,
          doc: Optional[torch.Tensor] = None):
    """``llama.block`` (norms, residuals, SwiGLU MLP, dropout) around this module's attention."""
    return llama.block(p, x, cos, sin, cfg, key, cache, past_len, attend=attention, doc=doc)


# ----------------------------------------------------------------------------------------------------------
# the model

def apply(params: dict, tokens: torch.Tensor, cfg: MLAConfig, *, key: Optional[torch.Tensor] = None,
          return_hidden: bool | str = False, cache: Optional[list] = None, past_len: int = 0,
          remat: bool = False, doc: Optional[torch.Tensor] = None, layers: Optional[Layers] = None):
    """Logits [B, T, vocab]; the keyword arguments mean what they mean in ``llama.apply`` (``cache``: from
    :func:`new_cache`, the absorbed decode; ``doc`` [B, T]: packed documents' ids, attention inside a document and
    RoPE positions restarting at each one)."""
    if doc is None:
        tables = llama.position_tables(rope_frequencies, cfg, past_len, tokens.shape[1], params["embed"].dtype,
                                       tokens.device).unbind(0)
    else:
        B, T = doc.shape
        cos, sin = llama.rope_tables(rope_frequencies(cfg), llama.doc_positions(doc).flatten(), params["embed"].dtype)
        tables = cos.view(B, 1, T, -1), sin.view(B, 1, T, -1)
    return llama.apply_with(params, tokens, cfg, itertools.repeat(tables), block, key=key, return_hidden=return_hidden,
                            cache=cache, past_len=past_len, remat=remat, doc=doc, layers=layers)


def loss(params: dict, batch: dict, cfg: MLAConfig, key: Optional[torch.Tensor] = None,
         remat: bool = False, layers: Optional[Layers] = None) -> torch.Tensor:
    """Mean next-token cross entropy of ``batch = {"x": [B, T], "y": [B, T]}`` (targets < 0 are ignored), with
    ``batch["doc"]`` [B, T] the packed documents' ids when present (``core.data.documents``)."""
    x = apply(params, batch["x"], cfg, key=key, remat=remat, doc=batch.get("doc"), layers=layers,
              return_hidden="only")[-1]
    return llama.next_token_loss(params, x, batch["y"], cfg, layers)


# ----------------------------------------------------------------------------------------------------------
# the latent cache for generation

def new_cache(cfg: MLAConfig, batch: int, max_len: int, dtype=torch.float32, device=None) -> list:
    """Per layer ``latent`` (the normalized c_n) [B, max_len, kv_lora_rank] and ``k_rope`` (rotated)
    [B, max_len, qk_rope_head_dim]: nothing per head."""
    def zeros(width):
        return torch.zeros(batch, max_len, width, dtype=dtype, device=device)
    return [{"latent": zeros(cfg.kv_lora_rank), "k_rope": zeros(cfg.qk_rope_head_dim)} for _ in range(cfg.n_layers)]


def decoder(params: dict, cfg: MLAConfig, batch: int, max_len: int):
    """``forward(tokens, past_len) -> logits`` over a fresh latent cache, for ``models.sampling.generate``;
    ``forward.cache`` is that cache (to measure it): ``models.sampling.decoding`` of this module's ``apply``."""
    leaf = params["embed"]
    return decoding(apply, params, cfg, new_cache(cfg, batch, max_len, dtype=leaf.dtype, device=leaf.device))


def kv_bytes_per_token(cfg: MLAConfig, dtype_bytes: int = 2) -> int:
    """Cached bytes per token over all layers: the live latent width (``kv_ranks[l]``, else kv_lora_rank) +
    qk_rope_head_dim per layer (the teacher: ``llama.kv_bytes_per_token``, 2 * n_kv_heads * head_dim). With
    ``kv_ranks`` this is what a cache of live widths holds; :func:`new_cache` (and DeepSeek-V2's format) hold the
    padded kv_lora_rank in every layer."""
    return (sum(live_ranks(cfg)) + cfg.n_layers * cfg.qk_rope_head_dim) * dtype_bytes
