"""The DBA student that is a plain grouped-query Llama, and that Llama: what standard formats hold.

A DBA student (``models/dba.py``) with no semantic key dims (``sem_dim == 0``), values as wide as the rotary keys
(``v_dim == geo_dim``) and one set of kept RoPE pairs for every layer and KV head (surgery's
``shared_pairs=True``) computes exactly a Llama whose ``head_dim`` is ``geo_dim`` (the route TransMLA and
MHA2MLA leave open for partial-RoPE students without a no-RoPE part):

- **Q/K/V/O**: ``wq = sqrt(geo_dim) * wq_g`` (the student scores with scale 1, its teacher's 1/sqrt(head_dim)
  folded into ``wq_g``; a Llama applies 1/sqrt(head_dim) = 1/sqrt(geo_dim), so it is folded back out),
  ``wk = wk_g``, ``wv = wv``, ``wo = wo``; q/k/v biases likewise (a Qwen2 teacher's student: ``q_g_bias`` scaled
  the same). Query head h reads KV head ``h // (n_heads / n_kv_heads)`` in both, and both rotate in the
  rotate-half layout (pair j = dims j, j + head_dim/2: ``llama.apply_rope`` on the geo slice, transformers'
  ``rotate_half``), so no row moves; GGUF's adjacent-pair layout is ``models.gguf_export``'s Llama permutation.
- **RoPE**: the student's pair j turns at the teacher's inverse frequency of teacher pair ``rope_pairs[j]``
  (``dba.pair_frequencies``: llama3 or per-pair scaling of the teacher included). A Llama with ``head_dim =
  geo_dim`` and the teacher's theta turns pair j at ``theta^(-2j/geo_dim) / factor_j``: per-pair factors, the
  ``rope_scaling`` type ``factors`` that ``models.llama`` computes, GGUF holds as its ``rope_freqs`` tensor (which
  llama.cpp divides each pair's angle by, as for Llama 3.1) and ``models.hf`` writes as transformers' ``longrope``
  with equal short and long factors and attention factor 1. A student that keeps every pair keeps the teacher's
  own RoPE (and scaling).

Everything outside the attention (embeddings, norms, MLP, head, window, biases flag) is the teacher's own and is
carried over as is.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from purestep.models import dba
from purestep.models.dba import DBAConfig
from purestep.models.llama import LlamaConfig


def why_not_llama(cfg: DBAConfig) -> str:
    """Why this student is not a plain Llama ("" when it is)."""
    reasons = []
    if cfg.sem_dim:
        reasons.append(f"sem_dim={cfg.sem_dim} no-RoPE key dims")
    if cfg.v_dim != cfg.geo_dim:
        reasons.append(f"v_dim={cfg.v_dim} differs from geo_dim={cfg.geo_dim}")
    if len({tuple(int(i) for i in pairs) for layer in cfg.rope_pairs for pairs in layer}) > 1:
        reasons.append("RoPE pairs chosen per layer and KV head")
    return ", ".join(reasons)


def rope_factors(cfg: DBAConfig) -> list[float]:
    """Per-pair factors f_j (float64) with ``theta^(-2j/geo_dim) / f_j`` = the student's inverse frequency of
    pair j, for a student :func:`why_not_llama` passes."""
    wanted = dba.pair_frequencies(cfg)[0, 0]                             # [geo_dim/2], the same for every head
    base = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.geo_dim, 2, dtype=torch.float64) / cfg.geo_dim)
    return (base / wanted).tolist()


def llama_config(cfg: DBAConfig) -> LlamaConfig:
    """The Llama this student is (``ValueError`` naming why when it is not one)."""
    reason = why_not_llama(cfg)
    if reason:
        raise ValueError(f"the DBA student is not a plain Llama: {reason}")
    base = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(LlamaConfig)}
    if [int(i) for i in cfg.rope_pairs[0][0]] == list(range(cfg.head_dim // 2)):
        scaling = cfg.rope_scaling            # every pair kept, in order: the teacher's own RoPE
    else:
        scaling = {"rope_type": "factors", "factors": rope_factors(cfg)}
    return LlamaConfig(**{**base, "head_dim": cfg.geo_dim, "rope_scaling": scaling})


def as_llama(params: dict, cfg: DBAConfig) -> tuple[dict, LlamaConfig]:
    """``(params, LlamaConfig)`` of the Llama that computes ``dba.apply(params, ., cfg)`` (module docstring);
    leaves outside the attention are shared, not copied. ``ValueError`` when the student is not a Llama."""
    out_cfg = llama_config(cfg)
    attn = params["layers"]["attn"]
    scale = math.sqrt(cfg.geo_dim)

    def scaled(t):   # in at least fp32, back to the leaf's dtype
        return (t.to(torch.promote_types(t.dtype, torch.float32)) * scale).to(t.dtype)
    new = {"wq": scaled(attn["wq_g"]), "wk": attn["wk_g"], "wv": attn["wv"], "wo": attn["wo"]}
    if cfg.qkv_bias:
        new.update(q_bias=scaled(attn["q_g_bias"]), k_bias=attn["k_g_bias"], v_bias=attn["v_bias"])
    layers = {**params["layers"], "attn": new}
    return {**params, "layers": layers}, out_cfg
