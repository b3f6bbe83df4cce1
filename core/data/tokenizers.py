"""Tokenizers: text <-> token ids, each one serializable into a checkpoint.

Three tokenizers share one small protocol: ``name``, ``vocab_size``, ``eos_id``/``bos_id`` (None where
there is none), ``encode(text) -> list[int]`` (no special tokens), ``encode_special(text)`` (with the ones the
tokenizer adds itself, as ``transformers``' ``encode`` does: lm-evaluation-harness's inputs), ``encode_bytes(data, source=...) -> np.ndarray``,
``decode(ids) -> str`` (shared: FIM sentinel ids appended past the vocabulary by ``core.data.fim`` render
as ``SENTINELS`` for every tokenizer) and ``to_dict()`` (str/int only, JSON- and msgpack-safe) with
``tokenizer_from_dict(d)`` rebuilding the same tokenizer, so a checkpoint carries its own tokenizer.

- ``ByteTokenizer`` (the default): ids are the UTF-8 bytes, vocab 256; any bytes are valid input.
- ``CharTokenizer``: the sorted set of characters of a text, as in nanoGPT's
  ``data/shakespeare_char/prepare.py`` (tiny shakespeare gives vocab 65).
- ``BPETokenizer``: a Hugging Face ``tokenizer.json`` run by the optional ``tokenizers`` library
  (``Tokenizer.from_str``; ``pip install purestep[hf]``). ``to_dict`` keeps the whole JSON string.

``make_tokenizer(spec, text)`` picks one from a config string: ``byte``, ``char`` or a path.
``DataError`` lives here (the lowest data layer) and is re-exported by ``core.data.text``: ``str(exc)`` is a
one-line, self-contained message naming the offending path or character, printed as is by the CLI.
"""
from __future__ import annotations

import os

import numpy as np

from purestep.core.config import UserError


class DataError(UserError, ValueError):
    """Input data or a tokenizer file that cannot be used; the message names the path."""


def decode_utf8(data: bytes, source: str) -> str:
    """``data`` decoded as strict UTF-8, or a DataError naming ``source`` and the first bad byte offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{source}: not valid UTF-8 at byte offset {e.start} (byte 0x{data[e.start]:02x}); "
            f"this tokenizer needs UTF-8 text, use tokenizer=byte for arbitrary bytes") from None


SENTINELS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")  # FIM sentinel names (core.data.fim)


class _Tokenizer:
    """Shared decode: subclasses give ``_decode_run`` (a run of in-vocabulary ids -> text)."""

    name: str
    vocab_size: int
    eos_id: int | None = None
    bos_id: int | None = None

    def _decode_run(self, ids: list[int]) -> str:
        raise NotImplementedError

    def encode_special(self, text: str) -> list[int]:
        """``encode`` plus the special tokens the tokenizer itself adds around a text (what ``transformers``'
        ``tokenizer.encode(text)`` gives): none here; a ``tokenizer.json``'s post-processor's in ``BPETokenizer``."""
        return self.encode(text)

    def decode(self, ids) -> str:
        """Decode runs of in-vocabulary ids with ``_decode_run``; the three ids just past the vocabulary
        are the FIM sentinels ``core.data.fim`` appends to a vocabulary without its own and render by name
        (``SENTINELS``); anything else renders as U+FFFD."""
        parts, run = [], []
        for i in (int(i) for i in ids):
            if i < self.vocab_size:
                run.append(i)
                continue
            if run:
                parts.append(self._decode_run(run))
                run = []
            k = i - self.vocab_size
            parts.append(SENTINELS[k] if k < len(SENTINELS) else "\ufffd")
        if run:
            parts.append(self._decode_run(run))
        return "".join(parts)

    def __eq__(self, other):
        return isinstance(other, _Tokenizer) and self.to_dict() == other.to_dict()

    def __repr__(self):
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


class ByteTokenizer(_Tokenizer):
    """UTF-8 bytes as ids (vocab 256). Decoding replaces invalid sequences with U+FFFD."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes, source: str = "input") -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def _decode_run(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        return {"type": "byte"}


class CharTokenizer(_Tokenizer):
    """One id per character of a fixed vocabulary, ids in sorted character order (nanoGPT's ``stoi``)."""

    name = "char"

    def __init__(self, chars: str):
        chars = "".join(sorted(set(chars)))
        if not chars:
            raise DataError("char tokenizer: the training text is empty, so there is no vocabulary")
        self.chars = chars
        self.vocab_size = len(chars)
        self._codes = np.array([ord(c) for c in chars], dtype=np.uint32)  # sorted: ids by searchsorted

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(text)

    def encode(self, text: str) -> list[int]:
        return self._encode(text).tolist()

    def encode_bytes(self, data: bytes, source: str = "input") -> np.ndarray:
        return self._encode(decode_utf8(data, source), source)

    def _encode(self, text: str, source: str | None = None) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = np.searchsorted(self._codes, codes)
        bad = (ids >= self.vocab_size) | (self._codes[np.minimum(ids, self.vocab_size - 1)] != codes)
        if bad.any():
            i = int(np.argmax(bad))
            ch = chr(int(codes[i]))
            where = f"{source}: " if source else ""
            raise DataError(
                f"{where}character {ch!r} (U+{ord(ch):04X}, at character {i}) is not in the char "
                f"tokenizer's vocabulary of {self.vocab_size} characters")
        return ids.astype(np.int64)

    def _decode_run(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def to_dict(self) -> dict:
        return {"type": "char", "chars": self.chars}


EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>")


class BPETokenizer(_Tokenizer):
    """A Hugging Face ``tokenizer.json`` (any model the ``tokenizers`` library runs; usually byte-level BPE).

    ``encode`` adds no special tokens. ``eos_id``/``bos_id`` are given by the model's own metadata (GGUF
    ids, ``tokenizer_config.json``) when known, else the first of the conventional special tokens
    (``EOS_TOKENS``/``BOS_TOKENS``) present in the vocabulary, else None; ``to_dict`` keeps them.
    ``gguf_pre`` is the pre-tokenizer name of the GGUF file it came from (``tokenizer.ggml.pre``, e.g.
    SmolLM2's ``smollm``), kept (``to_dict`` too) so that a GGUF export writes the source's own name back.
    """

    name = "bpe"

    def __init__(self, json_str: str, source: str = "tokenizer.json", bos_id: int | None = None,
                 eos_id: int | None = None, chat_template: str | None = None, gguf_pre: str | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(f"{source}: loading a tokenizer.json needs the optional 'tokenizers' library: "
                            f"pip install purestep[hf]") from None
        try:
            self._tok = Tokenizer.from_str(json_str)
        except Exception as e:  # the library raises a bare Exception on malformed JSON
            raise DataError(f"{source}: not a valid Hugging Face tokenizer.json ({e})") from None
        self.json = json_str
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = eos_id if eos_id is not None else self._first_id(EOS_TOKENS)
        self.bos_id = bos_id if bos_id is not None else self._first_id(BOS_TOKENS)
        self.chat_template = chat_template
        self.gguf_pre = gguf_pre

    @classmethod
    def from_file(cls, path: str) -> BPETokenizer:
        with open(path, encoding="utf-8") as f:
            return cls(f.read(), source=path)

    def token_id(self, name: str) -> int | None:
        """The id of a token given by name (special tokens included), or None."""
        return self._tok.token_to_id(name)

    def _first_id(self, names) -> int | None:
        for n in names:
            i = self._tok.token_to_id(n)
            if i is not None:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_special(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_bytes(self, data: bytes, source: str = "input") -> np.ndarray:
        return np.array(self.encode(decode_utf8(data, source)), dtype=np.int64)

    def _decode_run(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def to_dict(self) -> dict:
        out = {"type": "bpe", "json": self.json, "bos_id": self.bos_id, "eos_id": self.eos_id}
        optional = {"chat_template": self.chat_template, "gguf_pre": self.gguf_pre}
        return {**out, **{k: v for k, v in optional.items() if v is not None}}


def tokenizer_from_dict(d: dict) -> _Tokenizer:
    """Rebuild a tokenizer from its ``to_dict()``."""
    kind = d.get("type")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        return CharTokenizer(d["chars"])
    if kind == "bpe":
        return BPETokenizer(d["json"], source="saved tokenizer", bos_id=d.get("bos_id"), eos_id=d.get("eos_id"),
                            chat_template=d.get("chat_template"), gguf_pre=d.get("gguf_pre"))
    raise ValueError(f"unknown tokenizer type {kind!r}; expected one of byte, char, bpe")


def make_tokenizer(spec: str, text: str | None = None) -> _Tokenizer:
    """``byte``, ``char`` (vocab from ``text``), or a path to a ``tokenizer.json`` or a folder holding one."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "char":
        if text is None:
            raise ValueError("tokenizer=char builds its vocabulary from the training text; pass text=")
        return CharTokenizer.from_text(text)
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise DataError(f"tokenizer folder {spec} has no tokenizer.json")
        return BPETokenizer.from_file(path)
    if os.path.isfile(path):
        return BPETokenizer.from_file(path)
    if path.endswith(".json") or os.sep in path:
        raise DataError(f"tokenizer file not found: {spec}")
    raise ValueError(f"unknown tokenizer {spec!r}; choose byte, char, or a path to a tokenizer.json "
                     f"(or a folder containing one)")
