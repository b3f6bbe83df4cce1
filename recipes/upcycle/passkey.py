"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention", arXiv 2305.16300): a random 5-digit number
hidden at a random depth in repeated filler text; the model must say it after the question. No downloaded data.

Prompt (tokenized piece by piece with the models' tokenizer, filler repeated to reach the context length)::

    There is a pass key hidden inside a lot of irrelevant text. Find it and remember it.
    The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.   (x k)
    The pass key is 71432. Remember it. 71432 is the pass key.
    The grass is green. ...                                                                      (x n - k)
    What is the pass key? The pass key is

Greedy decoding (``sweep.greedy``), a trial is correct when the first run of key characters in the continuation is
the key. Keys and depths come from ``random.Random(seed)``: the same trials for teacher and student, and for every
rerun.

Any tokenizer (``recipes/upcycle/spelling.py``): the key is written in digits when the tokenizer spells all ten,
else in the first ten letters it spells of ``A-Z``, then of ``a-z`` (digit d -> the d-th of them: with all of
``A-J`` the key 71432 is ``HBEDC``);
the fixed texts keep every character it spells (a missing one in its other case, else left out, said in one line).
A tokenizer with no such ten characters, or that cannot write the texts at all, skips the passkey with one line.
"""
from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

import torch

from purestep.recipes.upcycle.spelling import adapt, describe, spell
from purestep.recipes.upcycle.sweep import greedy

INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and remember it.\n"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "What is the pass key? The pass key is"
KEY_CHARACTERS = (string.digits, string.ascii_uppercase, string.ascii_lowercase)


def trials(n: int, seed: int) -> list[tuple[int, float]]:
    """``n`` (key, depth in [0, 1]) pairs from ``seed``."""
    rng = random.Random(seed)
    return [(rng.randint(10000, 99999), rng.random()) for _ in range(n)]


@dataclass(frozen=True)
class Texts:
    """The passkey's texts as one tokenizer writes them, and the ten characters its keys are written in."""

    tokenizer: object
    intro: str
    filler: str
    needle: str            # with {key} twice
    question: str
    alphabet: str          # digit d of a key is written alphabet[d]
    note: str = ""         # how the texts differ from the English ones ("" when they do not)

    @classmethod
    def build(cls, tokenizer) -> tuple[Texts | None, str]:
        """``(texts, note)`` for ``tokenizer``, or ``(None, why)`` when the passkey cannot run on it."""
        alphabet = next((a for a in (''.join(c for c in group if spell(tokenizer, c)[0] is not None)[:10]
                                     for group in KEY_CHARACTERS) if len(a) == 10), None)
        if alphabet is None:
            return None, (f"the {tokenizer.name} tokenizer spells neither the ten digits nor ten letters of A-Z or "
                          f"a-z to write a key in")
        texts, changed = {}, {}
        for name, text in (("intro", INTRO), ("filler", FILLER), ("needle", NEEDLE), ("question", QUESTION)):
            pieces = [adapt(tokenizer, piece) for piece in text.split("{key}")]
            texts[name] = "{key}".join(p for p, _ in pieces)
            for _, c in pieces:
                changed.update(c)
            bare = texts[name].replace("{key}", "")
            if not bare.strip() or spell(tokenizer, bare)[0] is None:
                return None, (f"the {tokenizer.name} tokenizer cannot write the passkey's {name} text "
                              f"({spell(tokenizer, text.replace('{key}', ''))[1]})")
        notes = ([f"key written in {alphabet[0]}-{alphabet[-1]} (no digits)"] if alphabet != string.digits else []) \
            + ([describe(changed)] if changed else [])
        return cls(tokenizer, alphabet=alphabet, note="; ".join(notes), **texts), ""

    def key(self, key: int) -> str:
        return "".join(self.alphabet[int(d)] for d in str(key))

    def prompt(self, context: int, key: int, depth: float) -> list[int] | None:
        """Token ids of at most ``context`` tokens with the key at ``depth`` of the filler; None when the fixed
        parts alone do not fit."""
        enc = self.tokenizer.encode
        intro, filler, question = enc(self.intro), enc(self.filler), enc(self.question)
        needle = enc(self.needle.format(key=self.key(key)))
        room = context - len(intro) - len(needle) - len(question)
        if room < 0:
            return None
        n = room // len(filler)
        k = round(depth * n)
        return intro + filler * k + needle + filler * (n - k) + question

    def answer_tokens(self) -> int:
        """Tokens greedy decoding writes: the key after a space, and two more."""
        return len(self.tokenizer.encode(adapt(self.tokenizer, " ")[0] + self.key(12345))) + 2

    def correct(self, continuation: str, key: int) -> bool:
        """Whether the first run of key characters in ``continuation`` is the key."""
        found = re.search(f"[{re.escape(self.alphabet)}]+", continuation)
        return bool(found) and found.group() == self.key(key)


def run_passkey(models: list, tokenizer, contexts, n_trials: int, seed: int, device, chunk: int,
                trained_context: int, say) -> tuple[list[dict], str]:
    """One row per model and context: accuracy over the trials, with the trials, seed and context facts; and why
    the passkey was skipped ("" when it ran)."""
    texts, why = Texts.build(tokenizer)
    if texts is None:
        say(f"benchmark: passkey skipped: {why}")
        return [], why
    if texts.note:
        say(f"benchmark: passkey in what the {tokenizer.name} tokenizer writes: {texts.note}")
    rows, cases = [], trials(n_trials, seed)
    answer_len = texts.answer_tokens()
    for context in contexts:
        prompts = [(key, texts.prompt(context, key, depth)) for key, depth in cases]
        for m in models:
            correct, length = 0, 0
            for key, ids in prompts:
                if ids is None:
                    break
                length = len(ids)
                out = greedy(m, torch.tensor([ids], device=device), answer_len, chunk)
                correct += texts.correct(tokenizer.decode(out[0].tolist()), key)
            fits = bool(prompts) and prompts[0][1] is not None
            limit = getattr(m.cfg, "max_context", 0)
            rows.append({"model": m.name, "context": context, "prompt_tokens": length,
                         "status": "ok" if fits else "too_short", "trials": n_trials if fits else 0,
                         "correct": correct, "accuracy": correct / n_trials if fits and n_trials else None,
                         "seed": seed, "within_student_training": context <= trained_context,
                         "within_model_max": not limit or context <= limit, "key_characters": texts.alphabet})
        say(f"benchmark: passkey at {context} tokens: " + ", ".join(
            f"{r['model']} {r['correct']}/{r['trials']}" for r in rows[-len(models):]))
    return rows, ""
