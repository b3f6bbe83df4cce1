"""The same Llama written the ordinary PyTorch way: ``nn.Module`` blocks in an ``nn.ModuleList``.

This file shares no code with ``models/llama.py`` on purpose: it is the independent reference the
functional model is tested against (forward to 1e-5, gradients against ``.backward()``) and the
"plain PyTorch" baseline the benchmarks time against (``nn.Module`` + ``torch.optim.AdamW``). As nanoGPT's
``GPT.forward(idx, targets)``, ``forward(tokens, targets)`` returns the loss, so ``torch.compile(module)`` compiles the
cross entropy with the model: the strongest plain way, the one the benchmarks' ``plain`` baselines take. It follows
Hugging Face's ``modeling_llama.py`` structure (per-layer ``q_proj``/``k_proj``/... Linear layers,
``repeat_kv`` for grouped-query attention, rotate-half RoPE).
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep: int):
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.n_heads // self.n_kv_heads
        if self.window:   # Mistral: a query sees itself and the window - 1 positions before it
            pos = torch.arange(T, device=x.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.window)
            y = F.scaled_dot_product_attention(q, repeat_kv(k, rep), repeat_kv(v, rep), attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, repeat_kv(k, rep), repeat_kv(v, rep), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModule(nn.Module):
    """Takes a ``LlamaConfig`` (only its numbers); no llama3 rope scaling, no dropout."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # cos and sin precomputed for the first positions, as torchtitan's and gpt-fast's freqs_cis buffers are
        # (cast with the module: float64 -> the module's dtype rounds once, as computing them in forward does)
        cos, sin = self._tables(max(cfg.max_context, 2048))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, T: int):
        freqs = torch.outer(torch.arange(T, device=self.inv_freq.device, dtype=torch.float64), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, tokens, targets=None):
        """The logits ``[B, T, vocab]``; given ``targets`` ``[B, T]``, their mean cross entropy instead, as nanoGPT's
        ``GPT.forward(idx, targets)`` returns it (``model.py``: ``F.cross_entropy(logits.view(-1, V), targets.view(-1),
        ignore_index=-1)``; nanoGPT returns the logits beside it, here only the loss leaves the module, so under
        ``torch.compile`` no logits outlive its graph). The logits are taken in float32 at least (bf16 autocast's
        upcast, as ``models.losses.cross_entropy``); targets of -1 are ignored, as nanoGPT's."""
        T = tokens.shape[1]
        cos, sin = (self.cos[:T], self.sin[:T]) if T <= self.cos.shape[0] else self._tables(T)
        x = self.embed_tokens(tokens)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)


def load_params(module: LlamaModule, params: dict) -> LlamaModule:
    """Copy a functional-Llama params pytree into the module (layer axis unbound into the ModuleList)."""
    L = params["layers"]
    with torch.no_grad():
        module.embed_tokens.weight.copy_(params["embed"])
        module.norm.weight.copy_(params["norm"])
        if "lm_head" in params:
            module.lm_head.weight.copy_(params["lm_head"])
        for i, layer in enumerate(module.layers):
            layer.input_layernorm.weight.copy_(L["attn_norm"][i])
            layer.post_attention_layernorm.weight.copy_(L["mlp_norm"][i])
            layer.self_attn.q_proj.weight.copy_(L["attn"]["wq"][i])
            layer.self_attn.k_proj.weight.copy_(L["attn"]["wk"][i])
            layer.self_attn.v_proj.weight.copy_(L["attn"]["wv"][i])
            layer.self_attn.o_proj.weight.copy_(L["attn"]["wo"][i])
            for name in ("q", "k", "v") if "q_bias" in L["attn"] else ():
                getattr(layer.self_attn, f"{name}_proj").bias.copy_(L["attn"][f"{name}_bias"][i])
            layer.mlp.gate_proj.weight.copy_(L["mlp"]["w_gate"][i])
            layer.mlp.up_proj.weight.copy_(L["mlp"]["w_up"][i])
            layer.mlp.down_proj.weight.copy_(L["mlp"]["w_down"][i])
    return module


def grads_as_params(module: LlamaModule) -> dict:
    """The module's ``.grad`` tensors arranged in the functional params layout (layers stacked)."""
    layers = module.layers
    stack = lambda get: torch.stack([get(layer).grad for layer in layers])  # noqa: E731
    grads = {
        "embed": module.embed_tokens.weight.grad,
        "norm": module.norm.weight.grad,
        "layers": {
            "attn_norm": stack(lambda l: l.input_layernorm.weight),
            "mlp_norm": stack(lambda l: l.post_attention_layernorm.weight),
            "attn": {"wq": stack(lambda l: l.self_attn.q_proj.weight), "wk": stack(lambda l: l.self_attn.k_proj.weight),
                     "wv": stack(lambda l: l.self_attn.v_proj.weight), "wo": stack(lambda l: l.self_attn.o_proj.weight)},
            "mlp": {"w_gate": stack(lambda l: l.mlp.gate_proj.weight), "w_up": stack(lambda l: l.mlp.up_proj.weight),
                    "w_down": stack(lambda l: l.mlp.down_proj.weight)},
        },
    }
    if module.cfg.qkv_bias:
        grads["layers"]["attn"].update({f"{n}_bias": stack(lambda l, n=n: getattr(l.self_attn, f"{n}_proj").bias)
                                        for n in ("q", "k", "v")})
    if not module.cfg.tie_embeddings:
        grads["lm_head"] = module.lm_head.weight.grad
    return grads
