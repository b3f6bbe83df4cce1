"""A written-out MLA forward (DeepSeek-V2, arXiv 2405.04434, ``modeling_deepseek.py``'s DeepseekV2Attention without
q_lora) over ``models.mla``'s param layout, for testing ``models/mla_surgery.py`` independently of ``models/mla.py``:
wq [L, H*(nope+rope), d], wkv_a [L, r+rope, d], kv_norm [L, r], wkv_b [L, H*(nope+v), r], wo [L, d, H*v];
score = (q_nope . k_nope + R q_rope . R k_rope) * (nope + rope)^-1/2, rotate-half RoPE at frequencies
``llama.rope_frequencies`` of head_dim = rope; the latent's RMSNorm at DeepSeek's eps (``models.mla.KV_NORM_EPS``).
``latent_norm=False`` skips that norm (the surgery's linear part alone)."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from purestep.models import llama
from purestep.models.llama import LlamaConfig
from purestep.models.mla import KV_NORM_EPS


@dataclass
class RefConfig(LlamaConfig):
    kv_lora_rank: int = 8
    qk_rope_head_dim: int = 4
    qk_nope_head_dim: int = 4
    v_head_dim: int = 8
    latent_norm: bool = True

    @classmethod
    def from_teacher(cls, teacher: LlamaConfig, latent_norm: bool = True, **dims) -> "RefConfig":
        base = {k: v for k, v in dataclasses.asdict(teacher).items() if k in LlamaConfig.__dataclass_fields__}
        return cls(**base, **dims, latent_norm=latent_norm)


def attention(p: dict, x: torch.Tensor, cos, sin, cfg: RefConfig, cache=None, past_len: int = 0) -> torch.Tensor:
    B, T, _ = x.shape
    H, r, dr, dn, dv = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    q = F.linear(x, p["wq"]).view(B, T, H, dn + dr).transpose(1, 2)
    q_nope, q_rope = q.split([dn, dr], dim=-1)
    c, k_rope = F.linear(x, p["wkv_a"]).split([r, dr], dim=-1)
    if cfg.latent_norm:
        c = llama.rms_norm(c, p["kv_norm"], KV_NORM_EPS)
    kv = F.linear(c, p["wkv_b"]).view(B, T, H, dn + dv).transpose(1, 2)
    k_nope, v = kv.split([dn, dv], dim=-1)
    k_rope = llama.apply_rope(k_rope[:, None], cos, sin).expand(B, H, T, dr)
    q = torch.cat([q_nope, llama.apply_rope(q_rope, cos, sin)], dim=-1)
    k = torch.cat([k_nope, k_rope], dim=-1)
    y = llama.causal_attention(q, k, v, scale=(dn + dr) ** -0.5)
    return F.linear(y.transpose(1, 2).reshape(B, T, H * dv), p["wo"])


def block(p, x, cos, sin, cfg, key=None, cache=None, past_len: int = 0):
    return llama.block(p, x, cos, sin, cfg, key, cache, past_len, attend=attention)


def apply(params: dict, tokens: torch.Tensor, cfg: RefConfig) -> torch.Tensor:
    rope_cfg = dataclasses.replace(cfg, head_dim=cfg.qk_rope_head_dim)
    positions = torch.arange(tokens.shape[1])
    tables = llama.rope_tables(llama.rope_frequencies(rope_cfg), positions, params["embed"].dtype)
    return llama.apply_with(params, tokens, cfg, itertools.repeat(tables), block)
