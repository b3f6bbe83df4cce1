"""Log-likelihoods of continuations given contexts, batched, as lm-evaluation-harness's Hugging Face backend computes
them (``lm_eval/api/model.py: TemplateLM._encode_pair``, ``lm_eval/models/huggingface.py: _loglikelihood_tokens``).

Tokens. The harness moves the context's trailing whitespace onto the continuation, encodes the whole text and the
context alone, and takes the whole text's tokens past the context's as the continuation (so a merge across the
boundary lands in the continuation). It encodes as the tokenizer does by default (``tokenizer.encode(text)``: the
special tokens the tokenizer's post-processor adds, none for most byte-level BPE tokenizers such as SmolLM2's; none
when the text already starts with the BOS string): :func:`encode_pair`. A request longer than ``max_length + 1``
tokens keeps its last ones, as the harness's left truncation does.

Scores. The model reads ``(context + continuation)[:-1]`` and the continuation's log-probability is the sum of the
log-softmax (fp32) of its tokens at the positions before them. Rows are sorted longest first (the harness's order)
and right-padded into batches of ``batch_size``: under causal attention a pad after a row's last token never reaches
its real positions, so a score does not depend on its batch. For the model families that share Llama's final norm
and head (``llama``, ``dba``, ``mla``: ``models.llama.apply_with``) the head runs only on the continuation positions
(the ``return_hidden="only"`` stream, then the norm and the head), as ``recipes/upcycle/quality.py`` does; any other
architecture goes through its ``module.apply`` logits. Requests whose inputs are the same tokens (one-token
continuations after one context) share a row, as the harness's one-token-continuation cache does; other choices of
one question are rows of their own (a shared context's keys and values are not reused).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from purestep.core.gradients import autocast
from purestep.models import llama

HEAD_SHARED = ("llama", "dba", "mla")      # architectures whose logits are llama.apply_with's norm + head


def harness_encoder(tokenizer) -> Callable[[str], list[int]]:
    """The ids ``transformers``' ``tokenizer.encode(text)`` gives, as the harness calls it: the tokenizer's own
    special tokens (``encode_special``), but plain ``encode`` for a text that starts with the BOS string."""
    bos_id = getattr(tokenizer, "bos_id", None)
    eos_id = getattr(tokenizer, "eos_id", None)
    prefix = bos_id if bos_id is not None else eos_id
    prefix_text = tokenizer.decode([prefix]) if prefix is not None else None

    def encode(text: str) -> list[int]:
        if prefix_text and text.startswith(prefix_text):
            return tokenizer.encode(text)
        return tokenizer.encode_special(text)
    return encode


def encode_pair(encode: Callable[[str], list[int]], context: str, continuation: str) -> tuple[list[int], list[int]]:
    """``(context ids, continuation ids)`` as the harness's ``_encode_pair`` splits them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, head = encode(context + continuation), encode(context)
    return head, whole[len(head):]


def _logprobs(model, tokens: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """log-softmax [N, vocab] (fp32) of the next token at ``tokens[rows, cols]``."""
    if model.arch in HEAD_SHARED:
        hidden = model.module.apply(model.params, tokens, model.config, return_hidden="only")[-1][rows, cols]
        logits = F.linear(llama.rms_norm(hidden, model.params["norm"], model.config.norm_eps),
                          llama.lm_head(model.params))
    else:
        logits = model.module.apply(model.params, tokens, model.config)[rows, cols]
    return F.log_softmax(logits.float(), dim=-1)


def batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Request indices longest first (ties by index), in groups of ``batch_size``."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


@torch.no_grad()
def loglikelihoods(model, requests: Sequence[tuple[list[int], list[int]]], *, batch_size: int = 16,
                   dtype: str = "fp32", max_length: int = 2048,
                   report: Callable[[int, int], None] | None = None) -> list[float]:
    """The summed log-likelihood of each ``(context ids, continuation ids)`` request (a ``LoadedModel``'s params,
    on their device). Requests whose model inputs are the same tokens (one-token continuations of one context, as
    BoolQ's ``no``/``yes``) share one row, as the harness's ``group_by="contexts"`` does. ``report(done, total)``
    (requests) is called after every batch."""
    device = model.params["embed"].device
    inputs, users, spans = {}, [], []          # unique input -> its index; per unique input, the requests reading it
    for i, (ctx, cont) in enumerate(requests):
        if not 0 < len(cont) <= max_length:
            raise ValueError(f"a continuation of {len(cont)} tokens (the harness takes 1 to max_length={max_length})")
        ids = (list(ctx) + list(cont))[-(max_length + 1):]
        u = inputs.setdefault(tuple(ids[:-1]), len(inputs))
        if u == len(users):
            users.append([])
        users[u].append(i)
        spans.append((ids[-len(cont):], len(ids) - 1 - len(cont)))     # the targets, the position before them
    rows_ids = list(inputs)
    out, done = [0.0] * len(requests), 0
    for group in batches([len(x) for x in rows_ids], batch_size):
        x = torch.zeros(len(group), len(rows_ids[group[0]]), dtype=torch.long)
        readers, rows, cols, targets, owner = [], [], [], [], []
        for r, u in enumerate(group):
            x[r, :len(rows_ids[u])] = torch.tensor(rows_ids[u])
            for i in users[u]:
                tgt, start = spans[i]
                rows += [r] * len(tgt)
                cols += range(start, start + len(tgt))
                targets += tgt
                owner += [len(readers)] * len(tgt)
                readers.append(i)
        with autocast(dtype, device.type):
            logp = _logprobs(model, x.to(device), torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        picked = logp.gather(1, torch.tensor(targets, device=device)[:, None])[:, 0].double()
        sums = torch.zeros(len(readers), dtype=torch.float64, device=device).index_add_(
            0, torch.tensor(owner, device=device), picked)
        for i, value in zip(readers, sums.tolist()):
            out[i] = value
        done += len(readers)
        if report is not None:
            report(done, len(requests))
    return out


def progress_reporter(label: str, emit: Callable[[str], None], every: float = 10.0) -> Callable[[int, int], None]:
    """A ``report`` for :func:`loglikelihoods` that emits ``label: done/total requests, s`` at most every ``every``
    seconds and at the end."""
    start = time.monotonic()
    last = [start]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - last[0] >= every:
            last[0] = now
            emit(f"{label}: {done}/{total} requests, {now - start:.0f} s")
    return report
