"""Decoupled bottleneck attention (DBA): a Llama whose attention keys are split into a small semantic part
without RoPE and a small geometric part with RoPE, so the KV cache shrinks while the teacher's weights still fit.

This is the student architecture of the upcycle recipe (``models/surgery.py`` builds one from a Llama). It
follows DeepSeek-V2's MLA with decoupled RoPE (a no-RoPE "content" score plus a small rotary score, because a
rotation R_m does not commute with a low-rank factor) and MHA2MLA's partial RoPE (Ji et al. 2025, arXiv
2502.14837: keep RoPE only on the frequency pairs that matter, per head, at the *teacher's* frequencies). Unlike
MLA the key and value bottlenecks are per KV head, which keeps the teacher's grouped-query layout (Ainslie et al.
2023): query head h reads KV head ``h // (n_heads / n_kv_heads)``, as in ``models/llama.py``.

Per layer, for a block input x (after the attention RMSNorm), query head h and its KV head g::

    q_s = W_qs,h x   [sem_dim]      k_s = W_ks,g x   [sem_dim]      (no RoPE)
    q_g = W_qg,h x   [geo_dim]      k_g = W_kg,g x   [geo_dim]      (RoPE, pairs of KV head g)
    v   = W_v,g  x   [v_dim]
    score_ij = q_s,i . k_s,j + R_i q_g,i . R_j k_g,j          (no 1/sqrt(d): the scale lives in W_qs, W_qg)
    y = W_o [softmax(score) v  for every head]                  W_o: [d, n_heads * v_dim]

The teacher's 1/sqrt(head_dim) is folded into the query weights, so surgery can copy the teacher's score
exactly; SDPA is called with ``scale=1``. A freshly initialised model folds 1/sqrt(sem_dim + geo_dim) into
its query init instead.

RoPE on the geometric path: the rotate-half layout inside the geo_dim slice (pair j = dims j, j + geo_dim/2),
where pair j of KV head g in layer l rotates at the teacher's inverse frequency of the teacher pair
``cfg.rope_pairs[l][g][j]`` (``llama.rope_frequencies(cfg)`` indexed, so llama3 scaling carries over). The pair
indices live in the **config**, not in params: they are structural integers chosen once by surgery, must never
receive gradients or weight decay, and travel with the config into checkpoints. Query heads use their KV head's
pairs. The default (no surgery) spreads the kept pairs evenly over the teacher's spectrum (MHA2MLA "uniform").

Params (torch ``(out, in)`` layout, stacked along a leading layer axis; everything outside ``layers.attn`` has
exactly the teacher's names and shapes, so surgery copies it)::

    layers.attn.wq_s   [L, n_heads * sem_dim, d]
    layers.attn.wq_g   [L, n_heads * geo_dim, d]
    layers.attn.wk_s   [L, n_kv_heads * sem_dim, d]
    layers.attn.wk_g   [L, n_kv_heads * geo_dim, d]
    layers.attn.wv     [L, n_kv_heads * v_dim, d]
    layers.attn.wo     [L, d, n_heads * v_dim]
    layers.attn.q_s_bias  [L, n_heads * sem_dim]       (the biases only when qkv_bias, a Qwen2 teacher's: zeros
    layers.attn.q_g_bias  [L, n_heads * geo_dim]        from ``init``, set by surgery; each is added to its
    layers.attn.k_s_bias  [L, n_kv_heads * sem_dim]     projection before RoPE, as Qwen2's q/k/v biases are;
    layers.attn.k_g_bias  [L, n_kv_heads * geo_dim]     "bias" in the name keeps them out of weight decay)
    layers.attn.v_bias    [L, n_kv_heads * v_dim]

A per-layer KV budget (``sem_dims``, ``v_dims``: each layer's live widths, ``models/kv_budget.py``, built by
``models.surgery``) keeps these stacked shapes at sem_dim = max(sem_dims), v_dim = max(v_dims) (geo_dim stays one
width: the RoPE pairs are uniform per layer). In layer l, the rows past sem_dims[l] of every head's wq_s and wk_s
slice (and their biases) and the rows past v_dims[l] of every KV head's wv slice (its bias) and those columns of
W_o are zero: the dead key dims add 0 to every score and the dead value dims carry 0 into W_o, so the layer computes
what a layer of the live widths computes. Their gradients are exactly zero (a dead query row's is the dead key dim,
0, times x, and the reverse; a dead wv row's is W_o's dead column, 0, times the output gradient; a dead W_o column's
is the dead value, 0), and AdamW keeps them zero (zero moments; decoupled decay of zero is zero).

KV cache per layer: ``k`` = [k_s | k_g (rotated)] of shape [B, n_kv_heads, max_len, sem_dim + geo_dim] and
``v`` [B, n_kv_heads, max_len, v_dim]: n_kv_heads * (sem_dim + geo_dim + v_dim) values per token and layer,
against the teacher's 2 * n_kv_heads * head_dim (``kv_bytes_per_token``, which counts the live widths; the cache
of :func:`new_cache`, and the HF export, hold the padded ones).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from purestep.core.config import option
from purestep.core.layers import Layers
from purestep.models import llama
from purestep.models.sampling import decoding
from purestep.models.llama import LlamaConfig, apply_rope, rope_frequencies


@dataclass
class DBAConfig(LlamaConfig):
    """A LlamaConfig (the teacher's numbers) plus the per-head bottleneck widths and the kept RoPE pairs."""
    sem_dim: int = 16            # per head, no RoPE; 0 = pure geometric attention
    geo_dim: int = 16            # per head, RoPE; even, <= head_dim; 0 = pure semantic attention
    v_dim: int = 32              # per KV head
    rope_pairs: list = field(default_factory=list)  # [L][n_kv_heads][geo_dim/2] teacher pair indices; [] = uniform
    sem_dims: tuple[int, ...] = option((), "per-layer live sem_dim, each at most sem_dim (a per-layer KV budget, "
                                       "models/kv_budget.py; empty: every layer sem_dim)", min=0)
    v_dims: tuple[int, ...] = option((), "per-layer live v_dim, each at most v_dim (empty: every layer v_dim)", min=1)

    def __post_init__(self):
        super().__post_init__()
        if self.sem_dim < 0 or self.geo_dim < 0 or self.v_dim < 1:
            raise ValueError(f"need sem_dim >= 0, geo_dim >= 0, v_dim >= 1 (got {self.sem_dim}, {self.geo_dim}, "
                             f"{self.v_dim})")
        if self.sem_dim + self.geo_dim == 0:
            raise ValueError("sem_dim + geo_dim is 0: attention would have no keys")
        if self.geo_dim % 2 or self.geo_dim > self.head_dim:
            raise ValueError(f"geo_dim={self.geo_dim} must be even and <= head_dim={self.head_dim} (it keeps "
                             f"geo_dim/2 of the teacher's {self.head_dim // 2} rotary pairs)")
        n_pairs, n_keep = self.head_dim // 2, self.geo_dim // 2
        if not self.rope_pairs:
            uniform = [i * n_pairs // n_keep for i in range(n_keep)]
            self.rope_pairs = [[list(uniform) for _ in range(self.n_kv_heads)] for _ in range(self.n_layers)]
        shape = (len(self.rope_pairs), {len(h) for h in self.rope_pairs},
                 {len(p) for h in self.rope_pairs for p in h})
        if shape[0] != self.n_layers or shape[1] != {self.n_kv_heads} or shape[2] - {n_keep}:
            raise ValueError(f"rope_pairs must be [n_layers={self.n_layers}][n_kv_heads={self.n_kv_heads}]"
                             f"[geo_dim/2={n_keep}] pair indices")
        for layer in self.rope_pairs:
            for pairs in layer:
                if len(set(pairs)) != len(pairs) or any(not 0 <= int(f) < n_pairs for f in pairs):
                    raise ValueError(f"rope_pairs entry {pairs}: need distinct pair indices in [0, {n_pairs})")
        self.sem_dims, self.v_dims = tuple(self.sem_dims), tuple(self.v_dims)
        for key, dims, low, high in [("sem_dims", self.sem_dims, 0 if self.geo_dim else 1, self.sem_dim),
                                     ("v_dims", self.v_dims, 1, self.v_dim)]:
            if dims and (len(dims) != self.n_layers or not all(low <= w <= high for w in dims)):
                raise ValueError(f"{key}={dims}: need one live width per layer ({self.n_layers}), each in "
                                 f"[{low}, {key[:-1]}={high}]")

    @classmethod
    def from_teacher(cls, teacher: LlamaConfig, *, sem_dim: int, geo_dim: int, v_dim: int,
                     rope_pairs: Optional[list] = None, sem_dims: tuple = (), v_dims: tuple = ()) -> "DBAConfig":
        base = {k: v for k, v in asdict(teacher).items() if k in LlamaConfig.__dataclass_fields__}
        return cls(**base, sem_dim=sem_dim, geo_dim=geo_dim, v_dim=v_dim, rope_pairs=rope_pairs or [],
                   sem_dims=tuple(sem_dims), v_dims=tuple(v_dims))


def live_dims(cfg: DBAConfig) -> tuple[list, list]:
    """Each layer's live (sem_dim, v_dim) widths: ``sem_dims`` / ``v_dims``, or the stacked width in every layer."""
    return (list(cfg.sem_dims) or [cfg.sem_dim] * cfg.n_layers, list(cfg.v_dims) or [cfg.v_dim] * cfg.n_layers)


def dims_for_reduction(head_dim: int, kv_reduction: float = 2.0, plain: bool = False) -> tuple[int, int, int]:
    """``(sem_dim, geo_dim, v_dim)`` whose cache is ``kv_reduction`` times smaller than a teacher head's
    ``2 * head_dim`` (floored to whole values): half of the budget for values, half for keys, and the keys all
    RoPE (geo_dim even, at most head_dim; an odd or overflowing rest goes to the no-RoPE sem_dim). The comparison
    on SmolLM2 in docs/upcycle.md (head_dim 64, 2x) found more rotary pairs better than more semantic rank (0/32/32
    beat 8/24/32, 4/20/40 and 16/16/32 after surgery). ``plain``: the dims of a student that is a plain Llama
    (``models.dba_llama``): sem_dim 0 and v_dim = geo_dim = half the budget floored to even (the same dims
    whenever the budget is a multiple of 4, e.g. head_dim 64 at 2x, 4x, 8x)."""
    if kv_reduction < 1:
        raise ValueError(f"kv_reduction={kv_reduction} must be >= 1")
    budget = int(2 * head_dim / kv_reduction + 1e-9)
    if budget < (4 if plain else 2):
        need = "4 (one rotary key pair, two values)" if plain else "2 (one key, one value)"
        raise ValueError(f"kv_reduction={kv_reduction} leaves {budget} cached values per KV head (head_dim "
                         f"{head_dim}); need at least {need}")
    if plain:
        half = budget // 2
        return 0, half - half % 2, half - half % 2
    v_dim = budget // 2
    key = budget - v_dim
    geo_dim = min(key - key % 2, head_dim)
    return key - geo_dim, geo_dim, v_dim


# ----------------------------------------------------------------------------------------------------------
# parameters

def init(cfg: DBAConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
         device: torch.device | str | None = None) -> dict:
    """The teacher's init (``llama.init``) with the attention replaced; queries carry 1/sqrt(sem_dim + geo_dim);
    the q/k/v biases (``qkv_bias``) start at zero, as the teacher's do."""
    params = llama.init(cfg, seed, dtype, device)
    g = torch.Generator().manual_seed(seed + 1)
    L, d, H, G = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads
    q_std = cfg.init_std / math.sqrt(cfg.sem_dim + cfg.geo_dim)

    def normal(*shape, s=cfg.init_std):
        return (torch.randn(*shape, generator=g) * s).to(dtype=dtype, device=device)

    params["layers"]["attn"] = {
        "wq_s": normal(L, H * cfg.sem_dim, d, s=q_std),
        "wq_g": normal(L, H * cfg.geo_dim, d, s=q_std),
        "wk_s": normal(L, G * cfg.sem_dim, d),
        "wk_g": normal(L, G * cfg.geo_dim, d),
        "wv": normal(L, G * cfg.v_dim, d),
        "wo": normal(L, d, H * cfg.v_dim, s=cfg.init_std / math.sqrt(2 * L)),
    }
    if cfg.qkv_bias:
        widths = {"q_s_bias": H * cfg.sem_dim, "q_g_bias": H * cfg.geo_dim, "k_s_bias": G * cfg.sem_dim,
                  "k_g_bias": G * cfg.geo_dim, "v_bias": G * cfg.v_dim}
        params["layers"]["attn"].update({k: torch.zeros(L, w, dtype=dtype, device=device) for k, w in widths.items()})
    return params


# ----------------------------------------------------------------------------------------------------------
# attention

def pair_frequencies(cfg: DBAConfig, device=None) -> torch.Tensor:
    """Inverse frequencies (float64) [L, n_kv_heads, geo_dim/2]: the teacher's, at the kept pairs."""
    inv_freq = rope_frequencies(cfg, device)
    index = torch.tensor(cfg.rope_pairs, dtype=torch.long, device=inv_freq.device)
    return inv_freq[index.view(cfg.n_layers, cfg.n_kv_heads, cfg.geo_dim // 2)]


def rope_tables(cfg: DBAConfig, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin [L, n_kv_heads, T, geo_dim] (rotate-half within the geo slice): ``llama.rope_tables`` of the
    kept pairs' frequencies."""
    return llama.rope_tables(pair_frequencies(cfg, positions.device), positions, dtype)


def attention(p: dict, x: torch.Tensor, cos, sin, cfg: DBAConfig, cache: Optional[dict] = None,
              past_len: int = 0) -> torch.Tensor:
    """DBA for ``x`` [B, T, d]; ``cos``/``sin`` [n_kv_heads, T, geo_dim] are this layer's tables."""
    B, T, _ = x.shape
    H, G = cfg.n_heads, cfg.n_kv_heads

    def heads(w, bias, n, width):   # the bias (Qwen2 teachers) is added before RoPE
        return F.linear(x, p[w], p.get(bias)).view(B, T, n, width).transpose(1, 2)

    q_s, q_g = heads("wq_s", "q_s_bias", H, cfg.sem_dim), heads("wq_g", "q_g_bias", H, cfg.geo_dim)
    k_s, k_g = heads("wk_s", "k_s_bias", G, cfg.sem_dim), heads("wk_g", "k_g_bias", G, cfg.geo_dim)
    v = heads("wv", "v_bias", G, cfg.v_dim)
    q_g = apply_rope(q_g.unflatten(1, (G, H // G)), cos[:, None], sin[:, None]).flatten(1, 2)  # group's pairs
    k_g = apply_rope(k_g, cos, sin)
    q, k = torch.cat([q_s, q_g], dim=-1), torch.cat([k_s, k_g], dim=-1)
    if cache is not None:
        k, v = llama.cache_append(cache, k, v, past_len)
    y = llama.causal_attention(q, k, v, past_len, scale=1.0,       # the scale is folded into the query weights
                               window=cfg.sliding_window)
    return F.linear(y.transpose(1, 2).reshape(B, T, H * cfg.v_dim), p["wo"])


def block(p: dict, x: torch.Tensor, cos, sin, cfg: DBAConfig, key=None, cache=None, past_len: int = 0):
    """``llama.block`` (norms, residuals, SwiGLU MLP, dropout) around this module's attention."""
    return llama.block(p, x, cos, sin, cfg, key, cache, past_len, attend=attention)


# ----------------------------------------------------------------------------------------------------------
# the model

def apply(params: dict, tokens: torch.Tensor, cfg: DBAConfig, *, key: Optional[torch.Tensor] = None,
          return_hidden: bool | str = False, cache: Optional[list] = None, past_len: int = 0,
          remat: bool = False, layers: Optional[Layers] = None):
    """Logits [B, T, vocab]; the keyword arguments mean what they mean in ``llama.apply`` (``return_hidden``:
    the residual stream entering every block plus the last block's output, as the teacher's, for blockwise
    distillation)."""
    cos, sin = llama.position_tables(pair_frequencies, cfg, past_len, tokens.shape[1], params["embed"].dtype,
                                     tokens.device)
    return llama.apply_with(params, tokens, cfg, zip(cos.unbind(0), sin.unbind(0)), block, key=key,
                            return_hidden=return_hidden, cache=cache, past_len=past_len, remat=remat, layers=layers)


def loss(params: dict, batch: dict, cfg: DBAConfig, key: Optional[torch.Tensor] = None,
         remat: bool = False, layers: Optional[Layers] = None) -> torch.Tensor:
    """Mean next-token cross entropy of ``batch = {"x": [B, T], "y": [B, T]}`` (targets < 0 are ignored)."""
    x = apply(params, batch["x"], cfg, key=key, remat=remat, layers=layers, return_hidden="only")[-1]
    return llama.next_token_loss(params, x, batch["y"], cfg, layers)


# ----------------------------------------------------------------------------------------------------------
# KV cache for generation

def new_cache(cfg: DBAConfig, batch: int, max_len: int, dtype=torch.float32, device=None) -> list:
    """Per layer ``k`` = [k_s | rotated k_g] [B, n_kv_heads, max_len, sem_dim + geo_dim] and ``v`` [..., v_dim]."""
    def zeros(width):
        return torch.zeros(batch, cfg.n_kv_heads, max_len, width, dtype=dtype, device=device)
    return [{"k": zeros(cfg.sem_dim + cfg.geo_dim), "v": zeros(cfg.v_dim)} for _ in range(cfg.n_layers)]


def decoder(params: dict, cfg: DBAConfig, batch: int, max_len: int):
    """``forward(tokens, past_len) -> logits`` over a fresh KV cache, for ``models.sampling.generate``;
    ``forward.cache`` is that cache (to measure it): ``models.sampling.decoding`` of this module's ``apply``."""
    leaf = params["embed"]
    return decoding(apply, params, cfg, new_cache(cfg, batch, max_len, dtype=leaf.dtype, device=leaf.device))


def kv_bytes_per_token(cfg: DBAConfig, dtype_bytes: int = 2) -> int:
    """Cached bytes per token over all layers: n_kv_heads * (sem_dim + geo_dim + v_dim) per layer at the live widths
    (:func:`live_dims`; the teacher: ``llama.kv_bytes_per_token``, 2 * n_kv_heads * head_dim). With ``sem_dims`` /
    ``v_dims`` this is what a cache of live widths holds; :func:`new_cache` holds the padded widths in every layer."""
    sem, v = live_dims(cfg)
    return cfg.n_kv_heads * (sum(sem) + cfg.n_layers * cfg.geo_dim + sum(v)) * dtype_bytes
