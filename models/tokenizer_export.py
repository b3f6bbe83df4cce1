"""Tokenizers in the forms an exported model carries: a Hugging Face ``tokenizer.json`` and a GGUF vocabulary.

One home for both exports (``models.hf`` writes ``tokenizer.json``, ``models.gguf_export`` the
``tokenizer.ggml.*`` metadata):

- :func:`as_bpe` turns any of our tokenizers into a ``BPETokenizer`` (a Hugging Face ``tokenizers`` JSON)
  with the SAME ids. A BPE passes through. ``ByteTokenizer`` (id = UTF-8 byte) becomes a byte-level BPE
  whose vocabulary is GPT-2's 256 ``bytes_to_unicode`` characters, id = byte value, and no merges: every byte
  is its own token whatever the pre-tokenizer splits, so GPT-2's ByteLevel pre-tokenizer (its regex) and
  decoder give exactly ByteTokenizer's ids and text. ``CharTokenizer`` becomes a BPE over its characters with
  no merges, no pre-tokenizer and the ``Fuse`` decoder (tokens concatenated): each character is its own
  token. (A character outside the vocabulary, which CharTokenizer refuses, is dropped by ``tokenizers``.)
- :func:`gguf_vocab` lists ``tokenizer.ggml.tokens`` / ``token_type`` / ``merges`` the way llama.cpp's
  ``convert_hf_to_gguf.py`` does (``TextModel.get_vocab_base``: tokens by id, holes filled with
  ``[PAD{id}]`` of type UNUSED, special added tokens CONTROL, other added tokens USER_DEFINED, the rest
  NORMAL; merges as ``"a b"`` strings, ``gguf.SpecialVocab``). Only a byte-level BPE split by GPT-2's regex
  (``tokenizer.ggml.model`` "gpt2") has a GGUF form llama.cpp tokenizes the same way; anything else is refused
  with the reason (export format=hf keeps it as ``tokenizer.json``). A vocabulary without merges (the byte
  tokenizer's) gets one merge that never applies (:func:`inert_merge`): llama.cpp's gpt2 tokenizer requires
  ``tokenizer.ggml.merges``, and gguf-py refuses an empty array.
- :func:`llama_cpp_pre` names the pre-tokenizer for ``tokenizer.ggml.pre`` as llama.cpp knows it
  (``llama_vocab::impl::load`` in its ``src/llama-vocab.cpp``, which refuses any other name): the source
  GGUF's own name when the tokenizer came from one (``BPETokenizer.gguf_pre``, SmolLM2's ``smollm``), else
  ``gpt-2``, llama.cpp's name for GPT-2's regex.
"""
from __future__ import annotations

import json

from purestep.core.config import UserError
from purestep.core.data.tokenizers import BPETokenizer, ByteTokenizer, CharTokenizer

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5      # llama.cpp token types (gguf.TokenType)
# llama.cpp's names (src/llama-vocab.cpp) for the splits a byte-level BPE read by models.gguf reproduces:
# "gpt-2" is GPT-2's regex; "smollm" splits digits one by one first, which gives the same ids as GPT-2's regex
# on a vocabulary where no merge involves a digit (SmolLM2's), the only one a GGUF says "smollm" for.
LLAMA_CPP_PRE = ("gpt-2", "smollm")
# the byte tokenizer's one merge (inert_merge): bytes 0xF8 and 0xFF never occur in UTF-8 text
NEVER_IN_UTF8, RESPELLED = 0xF8, 0xFF


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (``encoder.py``), the alphabet of byte-level BPE.
    (Here rather than in ``models.gguf``, which imports it, so ``models.hf`` can use this module without a cycle.)"""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise UserError("exporting a tokenizer needs the optional 'tokenizers' package: "
                        "pip install purestep[hf]") from None
    return tokenizers


def as_bpe(tokenizer) -> BPETokenizer:
    """``tokenizer`` as a Hugging Face ``tokenizers`` JSON with the same ids, BOS/EOS and chat template."""
    if isinstance(tokenizer, BPETokenizer):
        return tokenizer
    tk = _tokenizers()
    from tokenizers import decoders, models, pre_tokenizers
    if isinstance(tokenizer, ByteTokenizer):
        vocab = {ch: b for b, ch in bytes_to_unicode().items()}
        tok = tk.Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        source = "byte tokenizer as byte-level BPE"
    elif isinstance(tokenizer, CharTokenizer):
        vocab = {ch: i for i, ch in enumerate(tokenizer.chars)}
        tok = tk.Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
        tok.decoder = decoders.Fuse()
        source = "char tokenizer as BPE"
    else:
        raise UserError(f"cannot export a {type(tokenizer).__name__} as a tokenizer.json "
                        f"(known: byte, char, bpe tokenizers)")
    return BPETokenizer(tok.to_str(), source=source, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)


def _byte_level_refusal(spec: dict) -> str | None:
    """Why this tokenizer.json has no llama.cpp "gpt2" form, or None when it has one."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"its model is {model.get('type')!r}, not a byte-level BPE"
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel":
        return (f"its pre-tokenizer is {pre.get('type')!r}, not GPT-2's ByteLevel, so it is not a byte-level BPE "
                f"llama.cpp's 'gpt2' tokenizer would split the same way")
    if not pre.get("use_regex", True):
        return "its ByteLevel pre-tokenizer does not split with GPT-2's regex (use_regex=false)"
    if spec.get("normalizer"):
        return f"it has a {spec['normalizer'].get('type')!r} normalizer, which llama.cpp's 'gpt2' tokenizer lacks"
    if model.get("byte_fallback") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "its BPE uses byte fallback or subword prefixes/suffixes, which a byte-level BPE does not"
    return None


def llama_cpp_pre(bpe: BPETokenizer) -> str:
    """``tokenizer.ggml.pre`` for ``bpe``: the source GGUF's own name when llama.cpp knows it, else ``gpt-2``
    (also for ``gpt2``, the name purestep's exports wrote before, which llama.cpp refuses)."""
    return bpe.gguf_pre if bpe.gguf_pre in LLAMA_CPP_PRE else "gpt-2"


def inert_merge(tokens: list[str]) -> str:
    """One merge for a byte-level vocabulary that has none, which no UTF-8 text ever reaches: the bytes 0xF8
    0xF8 merge into the token of byte 0xFF, respelled as their concatenation. Neither byte occurs in UTF-8 text
    (RFC 3629, section 3), so every text tokenizes exactly as before, in llama.cpp and in any reader that
    checks a merge's parts and result are tokens (Hugging Face ``tokenizers``, transformers' GGUF loader)."""
    spelling = bytes_to_unicode()
    part, respelled = spelling[NEVER_IN_UTF8], spelling[RESPELLED]
    if part not in tokens or respelled not in tokens or part * 2 in tokens:
        raise UserError("the tokenizer has no merges and is not a byte vocabulary: it has no GGUF form "
                        "(llama.cpp needs merges). Export with format=hf (tokenizer.json) instead")
    tokens[tokens.index(respelled)] = part * 2
    return f"{part} {part}"


def gguf_vocab(bpe: BPETokenizer) -> tuple[list[str], list[int], list[str]]:
    """``(tokens, token_types, merges)`` for ``tokenizer.ggml.*`` from a byte-level BPE, tokens by id (with
    :func:`inert_merge` when it has no merges)."""
    spec = json.loads(bpe.json)
    why = _byte_level_refusal(spec)
    if why:
        raise UserError(f"the tokenizer has no GGUF form: {why}. Export with format=hf (tokenizer.json) instead")
    model = spec["model"]
    by_id: dict[int, tuple[str, int]] = {int(i): (t, NORMAL) for t, i in model["vocab"].items()}
    for added in spec.get("added_tokens") or []:
        by_id[int(added["id"])] = (added["content"], CONTROL if added.get("special") else USER_DEFINED)
    n = max(by_id) + 1 if by_id else 0
    tokens = [by_id.get(i, (f"[PAD{i}]", UNUSED)) for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    names = [t for t, _ in tokens]
    if not merges:
        merges = [inert_merge(names)]
    return names, [ty for _, ty in tokens], merges


def adds_bos_eos(bpe: BPETokenizer) -> tuple[bool, bool]:
    """Whether the JSON's post-processor puts a special token before / after a single sequence (a
    ``TemplateProcessing`` as transformers and ``models.gguf`` build it); purestep's own ``encode`` never does."""
    post = json.loads(bpe.json).get("post_processor") or {}
    single = post.get("single") if post.get("type") == "TemplateProcessing" else None
    if not single:
        return False, False
    kinds = ["Sequence" in piece for piece in single]
    if True not in kinds:
        return False, False
    first = kinds.index(True)
    return first > 0, len(kinds) - 1 - kinds[::-1].index(True) < len(kinds) - 1
