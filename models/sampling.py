"""Autoregressive sampling: temperature, top-k (Fan et al. 2018) and nucleus/top-p (Holtzman et al. 2020).

``generate(forward, prompt, ...)`` is model-agnostic: ``forward(tokens, past_len) -> logits`` owns its KV
cache, so the prompt is processed once (prefill) and every new token costs one position (decode). Any
model that offers such a decoder (``models.llama.decoder``, the DBA student) generates through it.
Randomness comes from an explicit ``torch.Generator``: the same seed, the same text; or one generator per row,
so that a row of a batch draws what it would draw alone (on-policy distillation's rollouts,
``recipes.distill.on_policy``, each row with its own seed).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

Generators = Union[torch.Generator, Sequence[torch.Generator], None]


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k and outside the smallest set with probability >= top_p to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p   # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next token ids [B] from logits [B, V]; ``temperature=0`` is greedy."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_rows(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: Generators = None) -> torch.Tensor:
    """:func:`sample` with ``generator`` one ``torch.Generator`` for the batch, or a sequence of them, one per row:
    row ``i`` then draws from ``generator[i]`` exactly as a batch of that row alone would."""
    if generator is None or isinstance(generator, torch.Generator):
        return sample(logits, temperature, top_k, top_p, generator)
    if len(generator) != logits.shape[0]:
        raise ValueError(f"{len(generator)} generators for {logits.shape[0]} rows")
    return torch.cat([sample(logits[i:i + 1], temperature, top_k, top_p, g) for i, g in enumerate(generator)])


@torch.no_grad()
def generate(forward: Callable[[torch.Tensor, int], torch.Tensor], prompt: torch.Tensor, max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             generator: Generators = None, eos_id: Optional[int] = None,
             on_token: Optional[Callable[[int], None]] = None) -> torch.Tensor:
    """Continue ``prompt`` [B, T]; returns the new tokens [B, <= max_new_tokens].

    ``generator``: one for the batch or one per row (:func:`sample_rows`). ``on_token(id)`` streams batch row 0 as
    it is produced; generation stops early when every row has produced ``eos_id``.
    """
    logits = forward(prompt, 0)[:, -1]
    past, out = prompt.shape[1], []
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for i in range(max_new_tokens):
        token = sample_rows(logits, temperature, top_k, top_p, generator)
        out.append(token)
        if on_token is not None:
            on_token(int(token[0]))
        if eos_id is not None:
            done |= token == eos_id
            if bool(done.all()):
                break
        if i + 1 == max_new_tokens:   # the last token needs no forward pass of its own
            break
        logits = forward(token[:, None], past)[:, -1]
        past += 1
    return torch.stack(out, dim=1) if out else prompt[:, :0]


def decoding(apply_fn: Callable, params: dict, cfg, cache: list):
    """``forward(tokens, past_len) -> logits``, what :func:`generate` calls: ``apply_fn`` (a model module's
    ``apply``) over ``cache``, which ``forward.cache`` holds (to measure it). Every model's ``decoder`` is this over
    a fresh cache of its own form."""
    def forward(tokens, past_len):
        return apply_fn(params, tokens, cfg, cache=cache, past_len=past_len)
    forward.cache = cache
    return forward
