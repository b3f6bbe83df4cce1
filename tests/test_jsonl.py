"""JSONL data (core.data.jsonl, core.data.documents, core.data.chat): chat SFT masks, packing, memory, bad input (issue
18)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from purestep.core.data import chat
from purestep.core.data.documents import prepare_data
from purestep.models import llama
from purestep.recipes import main

REPO = Path(__file__).resolve().parent.parent
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "block_size=48", "batch_size=4",
        "compile=false", "sample_tokens=0", "eval_batches=2", "log_every=5", "eval_every=0"]

pytestmark = pytest.mark.usefixtures("token_cache")   # tests/conftest.py


def chats(n: int) -> list:
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": "Answer in one line."}] if i % 2 else []
        turns += [{"role": "user", "content": f"What is {i} plus {i}?"},
                  {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]
        if i % 3 == 0:
            turns += [{"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes."}]
        out.append({"messages": turns})
    return out


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def expected_roles(messages: list) -> np.ndarray:
    """The plain template's assistant bytes found by hand: each answer's content, its newline and the byte
    separator that follows the last message."""
    text = chat.render(chat.PLAIN_TEMPLATE, messages)
    flags, at = np.zeros(len(text.encode()) + 1, np.uint8), 0
    for m in messages:
        head = f"<|{m['role']}|>\n"
        at = text.index(head, at) + len(head)
        body = (m["content"] + "\n").encode()
        start = len(text[:at].encode())
        if m["role"] == "assistant":
            flags[start:start + len(body)] = 1
        at += len(m["content"]) + 1
    flags[-1] = flags[-2]       # the separator takes the last token's flag
    return flags


def test_chat_sft_masks_exactly_the_assistant_tokens(tmp_path):
    """Acceptance 1: a tiny model trains on JSONL chats with loss_on=assistant; the targets kept are exactly the
    assistant tokens of the rendered template, and a target changed at any other position leaves the loss as is."""
    records = chats(24)
    data = write_jsonl(tmp_path / "chats.jsonl", records)
    corpus = prepare_data(str(data), "byte", loss_on="assistant", pack=False)
    shard = corpus.shards[0]
    starts = np.asarray(shard["starts"])
    for i, r in enumerate(records):       # token by token against the rendered template
        rendered = chat.render(chat.PLAIN_TEMPLATE, r["messages"]).encode() + b"\n"
        assert bytes(np.asarray(shard["tokens"][starts[i]:starts[i + 1]]).astype(np.uint8)) == rendered
        assert np.array_equal(np.asarray(shard["roles"][starts[i]:starts[i + 1]]), expected_roles(r["messages"]))

    out = tmp_path / "run"
    assert main(["recipe=standard", f"data={data}", "loss_on=assistant", "pack=false", f"out={out}", "steps=10",
                 "lr=3e-3", "warmup_steps=0", *TINY]) == 0
    from purestep.models.loading import load_model
    trained = load_model(str(out / "final.msgpack"))
    params, cfg = trained.params, trained.config

    batch = corpus.batches(4, 48, seed=0).get(0)
    x, y = batch["x"], batch["y"]
    rows = corpus.rows("train", 48)
    roles = np.zeros(x.shape, bool)       # where the target (the next token) is an assistant token, by hand
    for row in range(x.shape[0]):
        doc, lo = rows.chunks[rows._order(0, 0)[0][row]]
        record = records[int(np.searchsorted(starts, rows.table[doc, 1]))]
        flags = expected_roles(record["messages"])[lo + 1:lo + 1 + x.shape[1]]
        roles[row, :len(flags)] = flags == 1
    assert torch.equal(y >= 0, torch.from_numpy(roles)) and roles.any() and (~roles).any()

    base = llama.loss(params, batch, cfg)
    raw = [rows.row(0, 0, i) for i in range(4)]     # the same rows, before masking
    assert torch.equal(torch.from_numpy(rows.batch(raw)["y"]), y)

    def loss_with(change):    # the loss on the same inputs, targets rebuilt from changed target tokens
        changed = [(np.where(change(r, d), (t + 1) % 256, t), r, d) for t, r, d in raw]
        return llama.loss(params, {"x": x, "y": torch.from_numpy(rows.batch(changed)["y"])}, cfg)

    assert torch.equal(loss_with(lambda r, d: r == 0), base)     # every user, system and padding position
    first = np.flatnonzero(raw[0][1] == 1)[0]
    assert not torch.equal(loss_with(lambda r, d: np.arange(len(r)) == first), base)   # one answer token


def test_packed_documents_do_not_see_each_other(tmp_path):
    """Acceptance 2: with pack=true, changing one document's tokens changes no logit of another document in the
    same window, and a document's logits do not depend on where in the window it sits (positions restart)."""
    docs = [{"text": "alpha beta gamma " * (1 + i % 3)} for i in range(12)]
    corpus = prepare_data(str(write_jsonl(tmp_path / "docs.jsonl", docs)), "byte", pack=True)
    batch = corpus.batches(2, 96, seed=3).get(0)
    x, doc = batch["x"], batch["doc"]
    assert (doc[0] != doc[0, 0]).any(), "the row should hold several documents"
    cfg = llama.LlamaConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
    params = llama.init(cfg, seed=0)
    logits = llama.apply(params, x, cfg, doc=doc)
    for target in torch.unique(doc[0]):
        inside = doc[0] == target
        x2 = x.clone()
        x2[0, inside] = (x2[0, inside] + 7) % 256
        other = llama.apply(params, x2, cfg, doc=doc)
        assert torch.equal(other[0, ~inside], logits[0, ~inside])
        assert not torch.equal(other[0, inside], logits[0, inside])
        alone = llama.apply(params, x[:1, inside], cfg)       # the document on its own, from position 0
        torch.testing.assert_close(logits[0, inside], alone[0], rtol=1e-5, atol=1e-5)
    y = batch["y"]
    crossing = torch.ones_like(y, dtype=torch.bool)
    crossing[:, :-1] = doc[:, 1:] != doc[:, :-1]
    assert crossing[:, :-1].any() and (y[:, :-1][crossing[:, :-1]] < 0).all()   # no target across documents


MEASURE = """
import json, os, resource, sys
sys.path.insert(0, {repo!r})
from purestep.core.data.documents import prepare_data
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
corpus = prepare_data({path!r}, "byte")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"base_kb": base, "peak_kb": peak, "tokens": corpus.meta["train_tokens"] + corpus.meta["val_tokens"]}}))
"""


def test_tokenizing_streams_with_bounded_memory(tmp_path):
    """Acceptance 4 (small): tokenizing a ~30 MB JSONL corpus raises the process's peak RSS by well under the
    corpus's size (a streaming build holds one chunk of tokens, not the corpus)."""
    path = tmp_path / "big.jsonl"
    line = json.dumps({"text": "the quick brown fox jumps over the lazy dog. " * 22}) + "\n"
    with open(path, "w") as f:
        for _ in range(30_000_000 // len(line)):
            f.write(line)
    size = path.stat().st_size
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", MEASURE.format(repo=str(REPO), path=str(path))], env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    grown = (got["peak_kb"] - got["base_kb"]) * 1024
    assert got["tokens"] > 0.95 * size
    assert grown < size / 3, f"peak RSS grew by {grown / 2**20:.1f} MB for a {size / 2**20:.1f} MB corpus"


def run_error(capsys, *args) -> str:
    assert main(["recipe=standard", *TINY, "steps=2", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_bad_input_names_the_line_and_chats_without_answers_are_counted(tmp_path, capsys):
    """Acceptance 6: a line that is not JSON names file:line (exit 2); under loss_on=assistant a chat without an
    assistant turn is skipped and counted in the log, and data with none at all is refused (exit 2)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(chats(1)[0]) + "\n\n" + '{"messages": [oops\n')
    assert f"{bad}:3" in run_error(capsys, f"data={bad}", f"out={tmp_path / 'r1'}")
    assert not (tmp_path / "r1").exists()

    no_text = write_jsonl(tmp_path / "no_field.jsonl", [{"body": "x"}])
    assert f"{no_text}:1" in run_error(capsys, f"data={no_text}", f"out={tmp_path / 'r2'}")

    mixed = write_jsonl(tmp_path / "mixed.jsonl", chats(30) + [{"messages": [{"role": "user", "content": "hi"}]}] * 3)
    assert main(["recipe=standard", *TINY, "steps=2", f"data={mixed}", "loss_on=assistant",
                 f"out={tmp_path / 'r3'}"]) == 0
    assert "3 without an assistant turn skipped" in capsys.readouterr().err

    questions = write_jsonl(tmp_path / "questions.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 20)
    assert "no train document has an assistant turn" in run_error(capsys, f"data={questions}", "loss_on=assistant",
                                                                    f"out={tmp_path / 'r4'}")
    text = tmp_path / "plain.txt"
    text.write_text("hello world\n" * 200)
    assert "loss_on=assistant applies to JSONL" in run_error(capsys, f"data={text}", "loss_on=assistant",
                                                               f"out={tmp_path / 'r5'}")


def test_ranks_epochs_and_val_data(tmp_path):
    """Each data-parallel rank builds its own rows of the one-rank global batch; an epoch of pack=false rows
    holds every chunk once; epochs= sets the steps; val_data= replaces the hash split."""
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": "word " * (3 + i % 17)} for i in range(40)])
    held = write_jsonl(tmp_path / "held.jsonl", [{"text": "held out " * 5}] * 3)
    for pack in (True, False):
        corpus = prepare_data(str(data), "byte", pack=pack, val_data=str(held))
        assert corpus.meta["train_documents"] == 40 and corpus.meta["val_documents"] == 3
        one = corpus.batches(4, 16, seed=5, grad_accum=2).get(7)
        ranks = [corpus.batches(2, 16, seed=5, grad_accum=2, rank=r, world_size=2).get(7) for r in (0, 1)]
        for key in one:
            assert torch.equal(torch.cat([ranks[0][key], ranks[1][key]], dim=1), one[key])
    rows = corpus.rows("train", 16)                   # the last corpus: pack=false
    assert sorted(rows._order(3, 5)[0].tolist()) == list(range(rows.n))
    assert corpus.batches(4, 16, seed=5).steps_for(2.0) == -(-2 * rows.n // 4)
    out = tmp_path / "run"
    assert main(["recipe=standard", f"data={data}", f"val_data={held}", "epochs=2", f"out={out}", *TINY,
                 "block_size=16"]) == 0
    from purestep.core.io import checkpoint as ckpt
    packed = prepare_data(str(data), "byte", val_data=str(held)).rows("train", 16).n
    assert ckpt.read_meta(out / "final.msgpack")["step"] == -(-2 * packed // 4)


def test_distill_trains_on_packed_chats(tmp_path, capsys):
    """distill takes JSONL chats with loss_on=assistant and packing (student and teacher see batch["doc"])."""
    data = write_jsonl(tmp_path / "chats.jsonl", chats(24))
    teacher = tmp_path / "teacher"
    assert main(["recipe=standard", f"data={data}", f"out={teacher}", "steps=2", *TINY]) == 0
    out = tmp_path / "student"
    assert main(["recipe=distill", f"teacher={teacher}", f"data={data}", "loss_on=assistant", f"out={out}",
                 "steps=3", *TINY]) == 0
    assert "loss_on=assistant" in capsys.readouterr().err and (out / "final.msgpack").exists()


def test_val_fraction_on_raw_text(tmp_path):
    """val_fraction= moves the split of raw text too; the default keeps the cache key (and tokens) of before."""
    from purestep.core.data import text as text_data
    text = tmp_path / "plain.txt"
    text.write_text("0123456789" * 100)
    default, quarter = prepare_data(str(text), "byte"), prepare_data(str(text), "byte", val_fraction=0.25)
    assert (len(default.train), len(default.val)) == (900, 100) and (len(quarter.train), len(quarter.val)) == (750, 250)
    assert default.path == text_data.prepare(str(text), "byte").path != quarter.path
    source = text_data.find_source(str(text))
    assert default.path.endswith(text_data._cache_key(source, {"type": "byte"}))


def test_split_streams_read_what_they_cover(tmp_path):
    """DocCorpus.train/val read as one token sequence: slices equal the concatenated documents in file order."""
    records = [{"text": f"doc {i} " * (1 + i % 5)} for i in range(30)]
    corpus = prepare_data(str(write_jsonl(tmp_path / "d.jsonl", records)), "byte", val_fraction=0.3)
    whole = np.asarray(corpus.train)
    assert len(whole) == len(corpus.train) == corpus.meta["train_tokens"]
    for lo, hi in ((0, 5), (3, 40), (17, 17), (len(whole) - 9, len(whole) + 5)):
        assert np.array_equal(corpus.train[lo:hi], whole[lo:hi])
    assert np.array_equal(corpus.val[[0, 2, 1]], np.asarray(corpus.val)[[0, 2, 1]])
    val_text = "".join(chr(int(t)) for t in np.asarray(corpus.val))
    assert val_text.count("\n") == corpus.meta["val_documents"]
