"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention", arXiv 2305.16300): a random 5-digit number
hidden at a random depth in repeated filler text; the model must say it after the question. No downloaded data.

Prompt (tokenized piece by piece with the models' tokenizer, filler repeated to reach the context length)::

    There is a pass key hidden inside a lot of irrelevant text. Find it and remember it.
    The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.   (x k)
    The pass key is 71432. Remember it. 71432 is the pass key.
    The grass is green. ...                                                                      (x n - k)
    What is the pass key? The pass key is

Greedy decoding (``sweep.greedy``), a trial is correct when the first run of digits in the continuation is the key.
Keys and depths come from ``random.Random(seed)``: the same trials for teacher and student, and for every rerun.
"""
from __future__ import annotations

import random
import re

import torch

from recipes.upcycle.sweep import greedy

INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and remember it.\n"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "What is the pass key? The pass key is"


def trials(n: int, seed: int) -> list[tuple[int, float]]:
    """``n`` (key, depth in [0, 1]) pairs from ``seed``."""
    rng = random.Random(seed)
    return [(rng.randint(10000, 99999), rng.random()) for _ in range(n)]


def prompt(tokenizer, context: int, key: int, depth: float) -> list[int] | None:
    """Token ids of at most ``context`` tokens with the key at ``depth`` of the filler; None when the fixed parts
    alone do not fit."""
    intro, filler, question = (tokenizer.encode(s) for s in (INTRO, FILLER, QUESTION))
    needle = tokenizer.encode(NEEDLE.format(key=key))
    room = context - len(intro) - len(needle) - len(question)
    if room < 0:
        return None
    n = room // len(filler)
    k = round(depth * n)
    return intro + filler * k + needle + filler * (n - k) + question


def run_passkey(models: list, tokenizer, contexts, n_trials: int, seed: int, device, chunk: int,
                trained_context: int, say) -> list[dict]:
    """One row per model and context: accuracy over the trials, with the trials, seed and context facts."""
    rows, cases = [], trials(n_trials, seed)
    answer_len = len(tokenizer.encode(" 12345")) + 2
    for context in contexts:
        prompts = [(key, prompt(tokenizer, context, key, depth)) for key, depth in cases]
        for m in models:
            correct, length = 0, 0
            for key, ids in prompts:
                if ids is None:
                    break
                length = len(ids)
                out = greedy(m, torch.tensor([ids], device=device), answer_len, chunk)
                digits = re.search(r"\d+", tokenizer.decode(out[0].tolist()))
                correct += bool(digits) and digits.group() == str(key)
            fits = bool(prompts) and prompts[0][1] is not None
            limit = getattr(m.cfg, "max_context", 0)
            rows.append({"model": m.name, "context": context, "prompt_tokens": length,
                         "status": "ok" if fits else "too_short", "trials": n_trials if fits else 0,
                         "correct": correct, "accuracy": correct / n_trials if fits and n_trials else None,
                         "seed": seed, "within_student_training": context <= trained_context,
                         "within_model_max": not limit or context <= limit})
        say(f"benchmark: passkey at {context} tokens: " + ", ".join(
            f"{r['model']} {r['correct']}/{r['trials']}" for r in rows[-len(models):]))
    return rows
