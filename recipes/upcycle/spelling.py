"""What a tokenizer can write: the benchmark's prompts (passkey, behaviour cases) are built from text the teacher's
tokenizer encodes and decodes back unchanged, so they run on a byte, a BPE or a char tokenizer of any corpus.

A char tokenizer (nanoGPT's, ``core.data.tokenizers.CharTokenizer``) knows only the characters of its training text:
tiny shakespeare has no digit. ``spell`` says whether a text survives the round trip and why not; ``adapt`` turns
a fixed English text into what the tokenizer can write (a character it lacks written in its other case, a line
break as a space, else left out), for the passkey's texts, whose wording is not what the passkey measures.
"""
from __future__ import annotations

from purestep.core.config import UserError


def spell(tokenizer, text: str) -> tuple[list[int] | None, str]:
    """``(ids, "")`` when ``tokenizer`` encodes ``text`` and decodes the ids back to it; ``(None, why)`` else."""
    try:
        ids = tokenizer.encode(text)
    except UserError as e:                  # core.data.tokenizers.DataError: a character outside a char vocabulary
        return None, str(e)
    back = tokenizer.decode(ids)
    if back != text:
        return None, f"the {tokenizer.name} tokenizer does not give back {text!r} (it decodes to {back!r})"
    return ids, ""


def adapt(tokenizer, text: str) -> tuple[str, dict]:
    """``text`` as ``tokenizer`` can write it, and what changed (``{character: replacement or ""}``): unchanged
    when it spells the whole text, else character by character: kept, written in its other case (whitespace as a
    space), or left out."""
    if spell(tokenizer, text)[0] is not None:
        return text, {}
    out, changed, known = [], {}, {}
    for c in text:
        if c not in known:
            options = dict.fromkeys((c, c.swapcase(), " " if c.isspace() else ""))
            known[c] = next((v for v in options if v and spell(tokenizer, v)[0] is not None), "")
            if known[c] != c:
                changed[c] = known[c]
        out.append(known[c])
    return "".join(out), changed


def describe(changed: dict) -> str:
    """``'?' left out, 'T' written as 't'`` for the line that says how a text was adapted."""
    return ", ".join(f"{c!r} written as {v!r}" if v else f"{c!r} left out" for c, v in changed.items())
