"""Data: sources, the token cache, splits, the seekable batch iterator, validation batches, errors."""
import os

import numpy as np
import pytest
import torch

import purestep.core.data.text as data
from purestep.core.data.text import Batches, DataError, eval_batches, find_source, prepare, split_files
from purestep.core.data.tokenizers import ByteTokenizer


def _corpus_folder(tmp_path, n=20):
    root = tmp_path / "corpus"
    for i in range(n):
        d = root / f"part{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"doc{i}.txt").write_text(f"document {i}: " + "lorem ipsum " * (i + 1))
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.txt").write_text("cached\n")
    (root / ".hidden.txt").write_text("hidden\n")
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    (root / "empty.txt").write_text("")
    return root


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PURESTEP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokens"


def test_single_file_last_10_percent_is_validation(tmp_path, cache):
    f = tmp_path / "input.txt"
    text = "".join(chr(ord("a") + i % 26) for i in range(1234))
    f.write_text(text)
    c = prepare(str(f), "byte")
    assert c.path.startswith(str(cache)) and sorted(os.listdir(c.path)) == ["meta.json", "train.bin", "val.bin"]
    assert len(c.train) == int(1234 * 0.9) == 1110 and len(c.val) == 124
    assert c.train.dtype == np.uint16 and c.meta["dtype"] == "uint16"
    assert bytes(np.concatenate([c.train, c.val]).astype(np.uint8)) == text.encode()
    assert c.meta["train_tokens"] == 1110 and c.meta["vocab_size"] == 256 and c.meta["source"] == str(f)
    assert c.tokenizer == ByteTokenizer()


def test_char_corpus_vocab_over_whole_file(tmp_path, cache):
    f = tmp_path / "input.txt"
    f.write_text("ab" * 100 + "xyz")  # "xyz" only in the validation tail: still in the vocabulary
    c = prepare(str(f), "char")
    assert c.tokenizer.chars == "abxyz" and c.meta["tokenizer"] == {"type": "char", "chars": "abxyz"}
    assert c.tokenizer.decode(c.val) == ("ab" * 100 + "xyz")[int(203 * 0.9):]


def test_folder_text_files_and_split_by_file(tmp_path, cache):
    root = _corpus_folder(tmp_path)
    src = find_source(str(root))
    assert [os.path.basename(p) for p in src.files] == sorted(
        [f"doc{i}.txt" for i in range(20)], key=lambda n: (int(n[3:-4]) % 3, n))
    train_files, val_files = split_files(src)
    assert 1 <= len(val_files) <= 6 and len(train_files) + len(val_files) == 20
    assert split_files(find_source(str(root))) == (train_files, val_files)  # deterministic

    c = prepare(str(root), "byte")
    joined = {s: b"".join(open(p, "rb").read() + b"\n" for p in fs)  # "\n" separates documents
              for s, fs in (("train", train_files), ("val", val_files))}
    assert bytes(c.train.astype(np.uint8)) == joined["train"]
    assert bytes(c.val.astype(np.uint8)) == joined["val"]
    assert c.meta["files"] == 20 and c.meta["val_files"] == len(val_files) and c.meta["separator"] == [10]


def test_two_files_get_one_each_and_one_file_splits_by_position(tmp_path, cache):
    root = tmp_path / "two"
    root.mkdir()
    (root / "a.txt").write_text("a" * 50)
    (root / "b.txt").write_text("b" * 70)
    train, val = split_files(find_source(str(root)))
    assert len(train) == 1 and len(val) == 1
    c = prepare(str(root), "byte")
    assert {len(c.train), len(c.val)} == {51, 71}
    (root / "b.txt").unlink()
    assert find_source(str(root)).by_position
    c = prepare(str(root), "byte")
    assert (len(c.train), len(c.val)) == (45, 5)


def test_glob(tmp_path, cache):
    root = tmp_path / "docs"
    (root / "a" / "b").mkdir(parents=True)
    (root / "x.rst.txt").write_text("top\n")
    (root / "a" / "b" / "y.rst.txt").write_text("deep\n")
    (root / "a" / "z.md").write_text("not matched\n")
    src = find_source(str(root / "**" / "*.rst.txt"))
    assert sorted(os.path.relpath(p, root) for p in src.files) == ["a/b/y.rst.txt", "x.rst.txt"]
    assert src.root == str(root) and src.description.startswith("glob ")
    c = prepare(str(root / "**" / "*.rst.txt"), "char")
    assert sorted([c.tokenizer.decode(c.train), c.tokenizer.decode(c.val)]) == ["deep\n\n", "top\n\n"]


def test_stdlib_source_is_found():
    src = find_source("stdlib")
    names = {os.path.relpath(p, src.root) for p in src.files}
    assert len(src.files) > 200 and "os.py" in names and "json/decoder.py" in names
    assert all(p.endswith(".py") and os.path.getsize(p) > 0 for p in src.files)
    parts = {part for n in names for part in n.split(os.sep)[:-1]}
    assert not parts & {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
    assert sum(os.path.getsize(p) for p in src.files) > 2_000_000
    train, val = split_files(src)
    assert 0.05 < len(val) / len(src.files) < 0.15


def test_cache_hit_does_not_retokenize_and_changes_invalidate(tmp_path, cache, monkeypatch):
    root = _corpus_folder(tmp_path, n=4)
    calls = []
    real = ByteTokenizer.encode_bytes
    monkeypatch.setattr(ByteTokenizer, "encode_bytes", lambda self, d, source="": calls.append(source) or real(self, d))
    first = prepare(str(root), "byte")
    assert len(calls) == 4
    again = prepare(str(root), "byte")
    assert len(calls) == 4 and again.path == first.path  # cache hit
    assert np.array_equal(again.train, first.train)

    doc = root / "part0" / "doc0.txt"
    st = doc.stat()
    os.utime(doc, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same size, new mtime
    touched = prepare(str(root), "byte")
    assert len(calls) == 8 and touched.path != first.path
    doc.write_text(doc.read_text() + "more")
    grown = prepare(str(root), "byte")
    assert len(calls) == 12 and grown.path not in (first.path, touched.path)
    assert prepare(str(root), "char").path != grown.path  # the tokenizer is part of the key


def test_interrupted_or_broken_cache_is_never_trusted(tmp_path, cache, monkeypatch):
    f = tmp_path / "input.txt"
    f.write_text("hello world " * 50)
    real_build = data._build

    def crash(source, tok, folder):
        real_build(source, tok, folder)
        raise KeyboardInterrupt  # everything written except the rename into place

    monkeypatch.setattr(data, "_build", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(f), "byte")
    assert not cache.exists() or os.listdir(cache) == []
    monkeypatch.setattr(data, "_build", real_build)
    c = prepare(str(f), "byte")
    assert len(c.train) == 540

    with open(os.path.join(c.path, "train.bin"), "r+b") as fh:  # damage the cache: it is rebuilt
        fh.truncate(100)
    again = prepare(str(f), "byte")
    assert again.path == c.path and len(again.train) == 540


def test_bpe_corpus_separates_documents_with_eos(tmp_path, cache):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["lorem ipsum document " * 50], trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    root = _corpus_folder(tmp_path, n=6)
    c = prepare(str(root), str(tmp_path / "tokenizer.json"))
    assert c.meta["separator"] == [0] and c.tokenizer.eos_id == 0
    assert int((np.asarray(c.train) == 0).sum()) + int((np.asarray(c.val) == 0).sum()) == 6
    assert c.tokenizer.decode(c.val).endswith("<|endoftext|>")


# ----------------------------------------------------------------------------------------------- batches

TOKENS = np.arange(5000, dtype=np.uint16)  # token value == position: a window names its own offset


def test_batches_pure_function_of_seed_and_cursor():
    b = Batches(TOKENS, batch_size=4, block_size=16, seed=3)
    one, again = b.get(7), Batches(TOKENS, 4, 16, seed=3).get(7)
    assert one["x"].shape == one["y"].shape == (4, 16) and one["x"].dtype == torch.int64
    assert torch.equal(one["x"], again["x"]) and torch.equal(one["y"], again["y"])
    assert not torch.equal(b.get(8)["x"], one["x"])
    assert not torch.equal(Batches(TOKENS, 4, 16, seed=4).get(7)["x"], one["x"])
    assert torch.equal(b.get(torch.tensor(7))["x"], one["x"])  # the state's 0-d cursor works too


def test_windows_in_range_and_y_is_x_shifted():
    b = Batches(TOKENS, batch_size=8, block_size=32, seed=0)
    for cursor in range(50):
        x, y = b.get(cursor)["x"], b.get(cursor)["y"]
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert torch.equal(x, x[:, :1] + torch.arange(32))  # contiguous windows of the token stream
        assert torch.equal(y, x + 1)
        assert int(x.min()) >= 0 and int(y.max()) <= len(TOKENS) - 1
    short = Batches(TOKENS[:33], batch_size=4, block_size=32, seed=0).get(0)  # exactly one window
    assert torch.equal(short["y"][0], torch.arange(1, 33))


def test_grad_accum_and_ranks_slice_the_global_batch():
    single = Batches(TOKENS, batch_size=8, block_size=16, seed=1).get(5)["x"]
    ranks = [Batches(TOKENS, batch_size=4, block_size=16, seed=1, rank=r, world_size=2).get(5)["x"] for r in range(2)]
    assert ranks[0].shape == (4, 16) and torch.equal(torch.cat(ranks), single)
    assert not torch.equal(ranks[0], ranks[1])

    acc = Batches(TOKENS, batch_size=8, block_size=16, seed=1, grad_accum=3).get(5)
    assert acc["x"].shape == acc["y"].shape == (3, 8, 16)
    parts = [Batches(TOKENS, 2, 16, seed=1, grad_accum=3, rank=r, world_size=4).get(5)["x"] for r in range(4)]
    assert parts[0].shape == (3, 2, 16) and torch.equal(torch.cat(parts, dim=1), acc["x"])
    with pytest.raises(ValueError, match="rank"):
        Batches(TOKENS, 2, 16, seed=1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="pin_memory"):
        Batches(TOKENS, 2, 16, seed=1, pin_memory=True)


def test_eval_batches_fixed_and_cover_the_split():
    val = np.arange(1000, dtype=np.uint16)
    ev = eval_batches(val, batch_size=4, block_size=10, n=5)
    batches = list(ev)
    assert len(ev) == 5 and all(b["x"].shape == (4, 10) for b in batches)
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(batches, ev))  # re-iterable, same tokens
    starts = torch.cat([b["x"][:, 0] for b in batches])
    assert int(starts[0]) == 0 and int(batches[-1]["y"][-1, -1]) == 999  # first and last token covered
    assert torch.all(starts[1:] > starts[:-1])  # evenly spaced, no repeats
    assert torch.equal(batches[2]["y"], batches[2]["x"] + 1)


def test_corpus_batches_come_from_train_eval_from_val(tmp_path, cache):
    f = tmp_path / "input.txt"
    f.write_bytes(bytes(i % 200 + 32 for i in range(3000)).replace(b"\x7f", b"~"))
    c = prepare(str(f), "byte")
    train_b = c.batches(batch_size=4, block_size=8, seed=0).get(0)
    val_b = next(iter(c.eval_batches(batch_size=4, block_size=8, n=2)))
    assert torch.equal(val_b["x"][0], torch.from_numpy(c.val[:8].astype(np.int64)))
    assert torch.equal(train_b["x"], Batches(c.train, 4, 8, seed=0).get(0)["x"])


# ----------------------------------------------------------------------------------------------- errors

def test_errors_name_the_path(tmp_path, cache):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=f"data not found: {missing}"):
        prepare(str(missing), "byte")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match=f"data file is empty: {empty}"):
        prepare(str(empty), "byte")
    one = tmp_path / "one.txt"
    one.write_text("x")
    with pytest.raises(DataError, match=f"{one}: 1 tokens, too few"):
        prepare(str(one), "byte")

    small = tmp_path / "small.txt"
    small.write_text("0123456789" * 10)
    c = prepare(str(small), "byte")
    with pytest.raises(DataError, match=f"{small} \\(train split\\): 90 tokens, fewer than block_size \\+ 1 = 129"):
        c.batches(batch_size=2, block_size=128, seed=0)
    with pytest.raises(DataError, match=f"{small} \\(validation split\\): 10 tokens, fewer than .* = 17"):
        c.eval_batches(batch_size=2, block_size=16, n=1)

    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café au lait\n".encode("latin-1"))
    with pytest.raises(DataError, match=f"{latin1}: not valid UTF-8 at byte offset 3 .*tokenizer=byte"):
        prepare(str(latin1), "char")
    assert len(prepare(str(latin1), "byte").train) == 11  # bytes are always fine

    with pytest.raises(DataError, match=str(tmp_path / "tok" / "tokenizer.json")):
        prepare(str(small), str(tmp_path / "tok" / "tokenizer.json"))
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "a.dat").write_bytes(b"\0\1\2")
    with pytest.raises(DataError, match=f"no text files found .*{binary}"):
        prepare(str(binary), "byte")
    with pytest.raises(DataError, match=f"no text files found .*{tmp_path}/\\*\\*/\\*\\.rst"):
        prepare(str(tmp_path / "**" / "*.rst"), "byte")
    assert not cache.exists() or not any(n.startswith(".") for n in os.listdir(cache))  # no tmp left over
