"""PurestepDBAForCausalLM: purestep's DBA student (decoupled bottleneck attention) as a transformers model.

Self-contained remote code (imports only torch and transformers): purestep's ``export_dba_hf`` copies this file
next to ``config.json``, whose ``auto_map`` names it, the way DeepSeek-V2 (MLA with decoupled RoPE, DeepSeek-AI
2024, arXiv 2405.04434) ships ``modeling_deepseek.py``; load with
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``. The layout follows transformers'
``models/llama/modeling_llama.py`` (pre-norm blocks, RMSNorm, SwiGLU MLP, GQA, tied or untied head, the
``model.layers.N.*`` names); only the attention differs. It computes what purestep's ``models/dba.py`` computes.

Per layer, for the normed block input x, query head h and its KV head g = h // (num_heads / num_kv_heads)::

    q_s = q_s_proj(x)_h [sem_dim]      k_s = k_s_proj(x)_g [sem_dim]      (no RoPE)
    q_g = q_g_proj(x)_h [geo_dim]      k_g = k_g_proj(x)_g [geo_dim]      (RoPE, KV head g's kept pairs)
    v   = v_proj(x)_g   [v_dim]
    score = q_s . k_s + R q_g . R k_g          (scale 1: the 1/sqrt(d) is folded into the query weights)
    y = o_proj([softmax(score) v for every head])

RoPE on the geometric slice is the rotate-half layout (pair j = dims j, j + geo_dim/2); pair j of KV head g in
layer l turns at the teacher's inverse frequency of the teacher pair ``config.rope_pairs[l][g][j]`` (llama3
scaling included), computed in float64 as purestep does. Query heads use their KV head's pairs. A projection of
width 0 (``sem_dim`` or ``geo_dim`` 0) is absent. Biases (``qkv_bias``) are added before RoPE.

KV cache: transformers' ``Cache`` (``DynamicCache``), one entry per layer with keys [k_s | rotated k_g]
(width sem_dim + geo_dim) and values of width v_dim; with ``sliding_window`` the cache may keep only the last
window of positions, and the mask follows the positions of the keys it returns. Attention is always
``F.scaled_dot_product_attention`` (``attn_implementation`` is not consulted: keys and values differ in width).
``attention_mask`` is the 2D padding mask (1 = token); positions are ``position_ids`` when given, else counted
from the cache, as Llama's. Not supported: 4D masks (refused), ``output_attentions`` / ``output_hidden_states``
(ignored), gradient checkpointing, legacy tuple caches (refused).
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_purestep_dba import PurestepDBAConfig


# ----------------------------------------------------------------------------------------------------------
# RoPE at the kept pairs

def rope_frequencies(config) -> torch.Tensor:
    """The teacher's inverse frequencies (float64) of its head_dim / 2 rotary pairs, llama3 scaling applied."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "llama3":
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def pair_frequencies(config) -> torch.Tensor:
    """[num_hidden_layers, num_key_value_heads, geo_dim / 2] float64: the teacher's, at the kept pairs."""
    index = torch.tensor(config.rope_pairs, dtype=torch.long).view(
        config.num_hidden_layers, config.num_key_value_heads, config.geo_dim // 2)
    return rope_frequencies(config)[index]


def rope_tables(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos, sin [B, G, T, 2n] for one layer's ``inv_freq`` [G, n] at ``position_ids`` [B, T] (angles in float64,
    float32 on MPS, then cast to ``dtype``)."""
    wide = torch.float32 if position_ids.device.type == "mps" else torch.float64
    angles = position_ids.to(wide)[:, None, :, None] * inv_freq.to(position_ids.device, wide)[None, :, None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def build_mask(T: int, S: int, past_len: int, window: Optional[int], padding: Optional[torch.Tensor], device):
    """(bool mask [B or 1, 1, T, S] or None, is_causal) for T queries at positions past_len .. past_len + T - 1
    over the last S of the past_len + T positions (a sliding cache returns fewer than all): causal, with
    ``window`` only the last ``window`` positions (key j visible to query i iff i - window < j <= i), and with
    ``padding`` [B, past_len + T] (1 = token, 0 = padding) no padded keys (a query still sees itself)."""
    total, window = past_len + T, window or 0
    if padding is None and (not window or window >= total):
        if past_len == 0 and T == S:
            return None, True
        if T == 1:
            return None, False
    qpos = torch.arange(past_len, total, device=device)[:, None]
    kpos = torch.arange(total - S, total, device=device)[None, :]
    mask = kpos <= qpos
    if window:
        mask = mask & (kpos > qpos - window)
    if padding is None:
        return mask, False
    mask = mask[None, None] & padding[:, None, None, -S:].bool()
    return mask | (kpos == qpos), False


# ----------------------------------------------------------------------------------------------------------
# modules

class PurestepDBARMSNorm(nn.Module):
    """``LlamaRMSNorm``, computed in at least float32 (float64 stays float64, as purestep's ``rms_norm``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.to(torch.promote_types(hidden_states.dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(hidden_states.dtype)


class PurestepDBAMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PurestepDBAAttention(nn.Module):
    """Decoupled bottleneck attention for one layer (see the module docstring)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.sem_dim, self.geo_dim, self.v_dim = config.sem_dim, config.geo_dim, config.v_dim
        d, bias = config.hidden_size, bool(config.qkv_bias)

        def proj(n, width):
            return nn.Linear(d, n * width, bias=bias) if width else None
        self.q_s_proj, self.k_s_proj = proj(self.n_heads, self.sem_dim), proj(self.n_kv, self.sem_dim)
        self.q_g_proj, self.k_g_proj = proj(self.n_heads, self.geo_dim), proj(self.n_kv, self.geo_dim)
        self.v_proj = proj(self.n_kv, self.v_dim)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, d, bias=False)

    def forward(self, x, cos, sin, cache: Optional[Cache], past_len: int, window, padding):
        B, T, _ = x.shape
        H, G = self.n_heads, self.n_kv

        def heads(proj, n, width):
            return proj(x).view(B, T, n, width).transpose(1, 2)
        q, k = [], []
        if self.sem_dim:
            q.append(heads(self.q_s_proj, H, self.sem_dim))
            k.append(heads(self.k_s_proj, G, self.sem_dim))
        if self.geo_dim:
            q_g = heads(self.q_g_proj, H, self.geo_dim).unflatten(1, (G, H // G))     # a group: its KV head's pairs
            q.append(apply_rope(q_g, cos[:, :, None], sin[:, :, None]).flatten(1, 2))
            k.append(apply_rope(heads(self.k_g_proj, G, self.geo_dim), cos, sin))
        q, k = torch.cat(q, dim=-1), torch.cat(k, dim=-1)
        v = heads(self.v_proj, G, self.v_dim)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        mask, causal = build_mask(T, k.shape[-2], past_len, window, padding, x.device)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=H != G, scale=1.0)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * self.v_dim))


class PurestepDBADecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = PurestepDBAAttention(config, layer_idx)
        self.mlp = PurestepDBAMLP(config)
        self.input_layernorm = PurestepDBARMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = PurestepDBARMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, cos, sin, cache, past_len, window, padding):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, past_len, window, padding)
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------------------------------------
# the model

def _output(cls, cache, **fields):
    """``cls(**fields)`` with the cache under the field name this transformers uses (5.x: ``cache``)."""
    name = "cache" if "cache" in getattr(cls, "__dataclass_fields__", {}) else "past_key_values"
    return cls(**fields, **{name: cache})


class PurestepDBAPreTrainedModel(PreTrainedModel):
    config_class = PurestepDBAConfig
    config: PurestepDBAConfig
    base_model_prefix = "model"
    _no_split_modules = ["PurestepDBADecoderLayer"]
    _supports_sdpa = True
    _supports_cache_class = True


class PurestepDBAModel(PurestepDBAPreTrainedModel):
    def __init__(self, config: PurestepDBAConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(PurestepDBADecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = PurestepDBARMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, cache=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = _new_cache(self.config)
        if cache is not None and not isinstance(cache, Cache):
            raise TypeError(f"past_key_values / cache must be a transformers Cache (got {type(cache).__name__})")
        B, T, _ = x.shape
        past_len = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + T, device=x.device)[None]
        padding = _padding(attention_mask, past_len + T)
        window = self.config.sliding_window
        # float64 frequencies computed per call (a few numbers), not a buffer that ``model.to(dtype)`` would round
        freqs = pair_frequencies(self.config) if self.config.geo_dim else None
        for i, layer in enumerate(self.layers):
            cos = sin = None
            if freqs is not None:
                cos, sin = rope_tables(freqs[i], position_ids, x.dtype)
            x = layer(x, cos, sin, cache, past_len, window, padding)
        return _output(BaseModelOutputWithPast, cache if use_cache else None, last_hidden_state=self.norm(x))


def _new_cache(config) -> Cache:
    try:
        return DynamicCache(config=config)   # transformers >= 4.56: sliding layers when sliding_window is set
    except TypeError:
        return DynamicCache()


def _padding(attention_mask, total: int) -> Optional[torch.Tensor]:
    """The 2D padding mask [B, total], or None when it masks nothing."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[-1] != total:
        raise ValueError(f"attention_mask must be 2D [batch, {total}] (1 = token, 0 = padding), got "
                         f"{tuple(attention_mask.shape)}")
    return None if bool(attention_mask.bool().all()) else attention_mask


class PurestepDBAForCausalLM(PurestepDBAPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: PurestepDBAConfig):
        super().__init__(config)
        self.model = PurestepDBAModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, cache=None, **kwargs):
        """Logits [B, T, vocab] (the last ``logits_to_keep`` positions when > 0); with ``labels``, the mean
        next-token cross entropy (labels shifted inside, -100 ignored)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, use_cache=use_cache,
                         cache=cache if cache is not None else past_key_values)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        cache = out["cache"] if "cache" in out else out.get("past_key_values")
        return _output(CausalLMOutputWithPast, cache, loss=loss, logits=logits)
