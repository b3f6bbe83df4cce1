"""Seeded fuzzing of the untrusted inputs (issue 49, acceptance 2): 200 mutations (truncation, bit flips, size-field
inflation, nesting) of a valid checkpoint, a GGUF file, a JSONL chat file and a chat template. Each must read
cleanly or fail as a user error (``core.config.UserError``: one ``error:`` line, exit 2) within 10 s, and the whole
loop may not grow the process's peak RSS by 1 GB: a claimed size is checked before it is allocated. Anything else
(a traceback type, a hang, an allocation) fails the test with the seed and the mutation that caused it."""
import random
import resource
import time
from pathlib import Path

import pytest
import torch

from purestep.core.config import UserError

pytest.importorskip("gguf", reason="needs the 'hf' extra: pip install purestep[hf]")

PER_KIND = 50
SECONDS = 10.0
TEMPLATE = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nbe brief"
            "<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def mutate(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One of the four mutations of ``data``, and its name."""
    kind = rng.choice(["truncate", "flip", "inflate", "nest"])
    if kind == "truncate":
        return kind, data[:rng.randrange(len(data))]
    if kind == "flip":
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
        return kind, bytes(out)
    if kind == "inflate":                          # a length or count field set to a huge value
        i = rng.randrange(max(1, len(data) - 8))
        return kind, data[:i] + rng.choice([b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff\xff\xff\xff\xff"]) + data[i + 8:]
    depth = rng.choice([1000, 100_000])
    opener, closer = rng.choice([(b"\x91", b""), (b"[", b"]"), (b"{% if 1 %}", b"{% endif %}"), (b"{{ (", b") }}")])
    return kind, opener * depth + data + closer * depth


def fuzz(name: str, data: bytes, check, seed: int) -> None:
    """``check(mutated bytes)`` for PER_KIND seeded mutations: it returns, or raises a UserError, in time."""
    rng = random.Random(seed)
    for case in range(PER_KIND):
        kind, mutated = mutate(data, rng)
        start = time.monotonic()
        try:
            check(mutated)
        except UserError:
            pass
        except Exception as e:     # noqa: BLE001 (the point: any other exception is a finding)
            pytest.fail(f"{name}, seed {seed}, case {case} ({kind}): {type(e).__name__}: {e}")
        took = time.monotonic() - start
        assert took < SECONDS, f"{name}, seed {seed}, case {case} ({kind}): {took:.1f} s"


@pytest.fixture
def peak_rss():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss    # KiB on Linux
    yield
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grew < 2**20, f"the peak RSS grew by {grew / 2**20:.2f} GiB"


def test_fuzzed_checkpoints(tmp_path, peak_rss):
    from purestep.core.io import checkpoint as ckpt
    from purestep.core.io.checkpoint_format import read
    tree = {"params": {"w": torch.randn(8, 4), "b": torch.zeros(3, dtype=torch.bfloat16)}, "step": torch.tensor(3)}
    ckpt.save(tmp_path / "c.msgpack", tree, step=3, extra={"note": "x" * 40})
    path = tmp_path / "m.msgpack"

    def check(data: bytes):
        path.write_bytes(data)
        read(path)
    fuzz("checkpoint", (tmp_path / "c.msgpack").read_bytes(), check, seed=0)


def test_fuzzed_gguf_files(tmp_path, peak_rss):
    from purestep.core.data.tokenizers import ByteTokenizer
    from purestep.models import llama
    from purestep.models.gguf_export import export_gguf
    from purestep.models.loading import load_model
    cfg = llama.LlamaConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                            max_context=64)
    source = export_gguf(llama.init(cfg, seed=0), cfg, tmp_path / "src.gguf", tokenizer=ByteTokenizer())
    path = tmp_path / "m.gguf"

    def check(data: bytes):
        path.write_bytes(data)
        load_model(str(path))
    fuzz("gguf", source.read_bytes(), check, seed=1)


def test_fuzzed_jsonl_chats(tmp_path, peak_rss):
    from purestep.core.data.chat import ChatTemplate, segments
    from purestep.core.data.jsonl import encode_record, lines, parse
    from purestep.core.data.tokenizers import ByteTokenizer
    chats = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "yes"}]}
             for i in range(5)]
    import json
    data = "".join(json.dumps(c) + "\n" for c in chats).encode()
    tok, template, path = ByteTokenizer(), ChatTemplate(TEMPLATE), tmp_path / "m.jsonl"

    def check(raw: bytes):
        path.write_bytes(raw)
        for n, line in lines(str(path)):
            encode_record(parse(line, f"{path}:{n}"), f"{path}:{n}", tok, template)
    segments(template, chats[0]["messages"], tok)          # the clean input works
    fuzz("jsonl", data, check, seed=2)


def test_fuzzed_chat_templates(peak_rss, monkeypatch):
    import purestep.core.data.sandbox
    from purestep import core
    from purestep.core.data.chat import render
    monkeypatch.setattr(core.data.sandbox, "RENDER_SECONDS", 1.0)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert render(TEMPLATE, messages).startswith("<|im_start|>system\nbe brief")

    def check(data: bytes):
        render(data.decode("utf-8", errors="replace"), messages, add_generation_prompt=True)
    fuzz("template", TEMPLATE.encode(), check, seed=3)
