"""Generate text from a trained model: ``purestep recipe=generate init=PATH prompt="..."``.

The prompt is processed once (prefill) and every new token costs one position of the KV cache
(``models.sampling.generate``). Sampling is temperature / top-k / top-p with an explicit seed, and the
text streams to stdout as it is produced. ``chat=true`` renders the prompt with the model's chat template
(``core.data.chat``; the plain template for a tokenizer without one) and its generation prompt: ``prompt=`` is then
one user message, or a whole chat as a JSON list of ``{"role", "content"}`` messages (a prompt that is such a
list is a chat even without ``chat=true``); generation stops at the tokenizer's EOS (the end of the turn).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch

from purestep.core.data.chat import check_messages, render, template_of
from purestep.core.data.tokenizers import DataError
from purestep.core.config import UserError, option
from purestep.core.device import DEVICES, check_fits, resolve_device
from purestep.core.io.logging import progress
from purestep.core.gradients import autocast
from purestep.models.loading import load_model
from purestep.models.sampling import generate

DESCRIPTION = "generate text from a checkpoint with a KV cache (temperature, top_k, top_p)"


@dataclass
class Config:
    init: str = option("", "checkpoint (file or run folder) to generate from")
    prompt: str = option("", "text to continue (empty: start from the tokenizer's BOS/newline), or a chat as a "
                         "JSON list of {\"role\", \"content\"} messages")
    chat: bool = option(False, "render the prompt with the model's chat template (prompt: a user message or a chat)")
    max_new_tokens: int = option(200, "tokens to generate", min=1)
    temperature: float = option(0.8, "softmax temperature (0: greedy)", min=0)
    top_k: int = option(0, "sample among the k most likely tokens (0: all)", min=0)
    top_p: float = option(1.0, "nucleus sampling: smallest set with this much probability (1: all)", above=0, max=1)
    seed: int = option(1337, "sampling seed: same seed, same text", min=0)
    device: str = option("auto", "where to run", choices=DEVICES)
    dtype: str = option("fp32", "compute precision", choices=("fp32", "bf16", "fp16"))


def check_cache(model, tokens: int, what: str, device) -> None:
    """Refuse a generation whose KV cache of ``tokens`` positions (the model's own ``new_cache``, built on the meta
    device: shapes only) exceeds the device's memory (``core.device.check_fits``)."""
    new_cache = getattr(model.module, "new_cache", None)
    if new_cache is None:
        return
    dtype = getattr(model.params.get("embed"), "dtype", torch.float32)     # what the decoder builds it in
    cache = new_cache(model.config, 1, tokens, dtype=dtype, device="meta")
    nbytes = sum(t.numel() * t.element_size() for layer in cache for t in layer.values())
    check_fits(f"{what} (a KV cache of {tokens:,} positions)", nbytes, device)


def run(cfg: Config) -> str:
    if not cfg.init:
        raise UserError("recipe=generate needs init=PATH (a checkpoint or a run folder)")
    if not 0.0 < cfg.top_p <= 1.0:
        raise UserError(f"bad value for 'top_p': {cfg.top_p}; it must be in (0, 1]")
    device = resolve_device(cfg.device)
    model = load_model(cfg.init, device=device)
    tok = model.tokenizer
    if tok is None:
        raise UserError(f"{model.source}: no tokenizer stored with this model")
    messages = chat_messages(cfg.prompt, cfg.chat)
    if messages is not None:
        try:
            ids = tok.encode(render(template_of(tok), messages, tok, add_generation_prompt=True))
        except DataError as e:        # the model's own template: say whose it is
            raise DataError(f"{model.source}: {e}") from None
    elif cfg.prompt:
        ids = tok.encode(cfg.prompt)
    else:
        ids = [tok.bos_id if tok.bos_id is not None else tok.encode("\n")[0]]
    check_cache(model, len(ids) + cfg.max_new_tokens, f"max_new_tokens={cfg.max_new_tokens}", device)
    progress(f"[{model.format}: {model.source}]")
    printed = tok.decode(ids)
    sys.stdout.write(printed if cfg.prompt else "")
    generated = list(ids)

    def stream(token: int):
        nonlocal printed
        generated.append(token)
        text = tok.decode(generated)
        if not text.endswith("\ufffd"):          # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text

    decode = model.module.decoder(model.params, model.config, 1, len(ids) + cfg.max_new_tokens)   # llama, dba, mla
    with autocast(cfg.dtype, device.type):
        generate(decode, torch.tensor([ids], device=device), cfg.max_new_tokens, temperature=cfg.temperature,
                 top_k=cfg.top_k, top_p=cfg.top_p, generator=torch.Generator(device).manual_seed(cfg.seed),
                 eos_id=tok.eos_id, on_token=stream)
    text = tok.decode(generated)
    sys.stdout.write(text[len(printed):] + "\n")
    return text


def chat_messages(prompt: str, chat: bool):
    """The chat ``prompt`` names: a JSON list of messages, or (with ``chat``) one user message; None: plain text."""
    if prompt.lstrip().startswith("["):
        try:
            parsed = json.loads(prompt)
        except (ValueError, RecursionError):   # not JSON, or nested deeper than the decoder goes: plain text
            parsed = None
        if isinstance(parsed, list):
            return check_messages(parsed, "prompt")
    return [{"role": "user", "content": prompt}] if chat else None
