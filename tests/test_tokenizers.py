"""Tokenizers: round trips, serialization, char vocabulary, BPE through a tiny trained tokenizer.json."""
import json

import numpy as np
import pytest

from purestep.core.data.fim import fim_ids
from purestep.core.data.tokenizers import (SENTINELS, BPETokenizer, ByteTokenizer, CharTokenizer, DataError, make_tokenizer,
                             tokenizer_from_dict)

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
UNICODE = "héllo wörld — 🎉 ñ\n\n  tabs\tand  spaces  \n"


def test_byte_round_trip_and_any_bytes():
    tok = ByteTokenizer()
    ids = tok.encode(UNICODE)
    assert ids == list(UNICODE.encode("utf-8")) and max(ids) < tok.vocab_size == 256
    assert tok.decode(ids) == UNICODE
    raw = bytes(range(256))
    arr = tok.encode_bytes(raw)
    assert arr.tolist() == list(range(256))
    assert tok.decode(b"ab\xffc") == "ab\ufffdc"  # invalid UTF-8 decodes with replacement
    assert tok.eos_id is None and tok.bos_id is None


def test_char_vocab_of_known_text_and_round_trip():
    small = CharTokenizer.from_text("hello world\n")  # nanoGPT: chars = sorted(list(set(data)))
    assert small.chars == "\n dehlorw" and small.vocab_size == 9
    assert small.encode("hello\n") == [4, 3, 5, 5, 6, 0]
    tok = CharTokenizer.from_text(TEXT)
    assert tok.vocab_size == 30
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert tok.encode_bytes(TEXT.encode()).tolist() == ids
    assert CharTokenizer.from_text(UNICODE).decode(CharTokenizer.from_text(UNICODE).encode(UNICODE)) == UNICODE


def test_char_unknown_character_is_named():
    tok = CharTokenizer.from_text(TEXT)
    with pytest.raises(DataError, match=r"'Z' \(U\+005A"):
        tok.encode("Speak Z")


def test_char_non_utf8_names_source_and_offset():
    with pytest.raises(DataError, match=r"some/file\.txt: not valid UTF-8 at byte offset 3 .*tokenizer=byte"):
        CharTokenizer.from_text("abc").encode_bytes(b"abc\xff", source="some/file.txt")


def _tiny_bpe(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT * 20], trainer)
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return path


def test_bpe_round_trip_and_special_tokens(tmp_path):
    path = _tiny_bpe(tmp_path)
    tok = make_tokenizer(str(path))
    assert isinstance(tok, BPETokenizer) and tok.name == "bpe"
    assert tok.eos_id == 0 and tok.bos_id == 0  # <|endoftext|> is the only special token
    assert tok.vocab_size == 300
    ids = tok.encode(TEXT)
    assert 0 not in ids and len(ids) < len(TEXT) / 2  # no special tokens added; merges compress
    for text in (TEXT, UNICODE):  # byte-level: exact round trip, even for characters never trained on
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_bytes(UNICODE.encode()).tolist() == tok.encode(UNICODE)
    assert make_tokenizer(str(path.parent)) == tok  # a folder holding tokenizer.json


def test_to_dict_from_dict_is_exact_and_json_safe(tmp_path):
    bpe = make_tokenizer(str(_tiny_bpe(tmp_path)))
    from_gguf = BPETokenizer(bpe.json, gguf_pre="smollm")   # a GGUF's pre-tokenizer name goes into checkpoints
    toks = [ByteTokenizer(), CharTokenizer.from_text(UNICODE), bpe, from_gguf]
    for tok in toks:
        d = tok.to_dict()
        assert json.loads(json.dumps(d)) == d
        back = tokenizer_from_dict(d)
        assert type(back) is type(tok) and back.to_dict() == d and back == tok
        assert back.vocab_size == tok.vocab_size and back.eos_id == tok.eos_id
        assert back.encode(UNICODE) == tok.encode(UNICODE)
    assert toks[0] != toks[1]
    assert tokenizer_from_dict(from_gguf.to_dict()).gguf_pre == "smollm" and "gguf_pre" not in bpe.to_dict()


def test_make_tokenizer_specs_and_errors(tmp_path):
    assert isinstance(make_tokenizer("byte"), ByteTokenizer)
    assert make_tokenizer("char", "hello world\n").chars == "\n dehlorw"
    with pytest.raises(ValueError, match="text"):
        make_tokenizer("char")
    with pytest.raises(ValueError, match="byte, char, or a path"):
        make_tokenizer("sentencepiece")
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(DataError, match=str(missing)):
        make_tokenizer(str(missing))
    with pytest.raises(DataError, match=f"{tmp_path}.*has no tokenizer.json"):
        make_tokenizer(str(tmp_path))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match=str(bad)):
        make_tokenizer(str(bad))
    with pytest.raises(ValueError, match="byte, char, bpe"):
        tokenizer_from_dict({"type": "wordpiece"})


def test_bpe_without_library_says_how_to_install(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "tokenizers":
            raise ImportError("no tokenizers")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(DataError, match=r"pip install purestep\[hf\]"):
        BPETokenizer("{}", source="x/tokenizer.json")


def test_char_encode_is_numpy_fast_path_equivalent():
    tok = CharTokenizer.from_text(UNICODE)
    expected = [tok.chars.index(c) for c in UNICODE]
    assert tok.encode(UNICODE) == expected
    assert np.array_equal(tok.encode_bytes(UNICODE.encode()), expected)


def test_fim_sentinels_appended_past_the_vocab_decode_the_same_for_every_tokenizer(tmp_path):
    """core.data.fim appends three ids past a vocabulary without FIM tokens (BPE included); every tokenizer's
    decode renders them as the sentinel names, between normally decoded runs; further ids are U+FFFD."""
    bpe = make_tokenizer(str(_tiny_bpe(tmp_path)))
    for tok in (ByteTokenizer(), CharTokenizer.from_text(TEXT), bpe):
        (pre, suf, mid), extra = fim_ids(tok)
        assert extra == 3 and (pre, suf, mid) == (tok.vocab_size, tok.vocab_size + 1, tok.vocab_size + 2)
        a, b = tok.encode("Speak, "), tok.encode("speak.")
        assert tok.decode([pre, *a, suf, *b, mid]) == "<fim_prefix>Speak, <fim_suffix>speak.<fim_middle>"
        assert tok.decode(np.array([*b, mid, pre, *a])) == "speak.<fim_middle><fim_prefix>Speak, "
        assert tok.decode([mid + 1, *a]) == "\ufffdSpeak, "
    assert SENTINELS == ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
