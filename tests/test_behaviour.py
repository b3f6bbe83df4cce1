"""Behaviour pinned across refactors: a fixed tiny run must give a bitwise equal state, and its committed
final checkpoint must still resume.

The fixture (``tests/fixtures/behaviour/``) was made before the recipes were reorganized: the command in
``ARGS`` on ``corpus.txt`` (the first 64 KiB of tiny shakespeare), its final checkpoint
``step_000000030.msgpack`` and ``state.sha256``, the hash of that checkpoint's train state
(``state_hash.py``: every leaf's path, dtype, shape and bytes).
"""
import shutil
from pathlib import Path

import pytest
import torch

from core import checkpoint as ckpt
from recipes import main
from tests.fixtures.behaviour.state_hash import state_hash

FIXTURE = Path(__file__).parent / "fixtures" / "behaviour"
ARGS = ["recipe=standard", "preset=tiny", "compile=false", "warmup_steps=5", f"data={FIXTURE / 'corpus.txt'}",
        "tokenizer=char", "sample_tokens=0", "eval_batches=2", "eval_every=0", "save_every=0", "log_every=10"]


@pytest.fixture
def two_threads():
    """The fixture was recorded with 2 intra-op threads; float reductions split across another number of
    threads round differently, so pin it (the result is then the same on any machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_fixed_run_gives_the_pinned_state(tmp_path, token_cache, two_threads):
    assert main([*ARGS, "steps=30", f"out={tmp_path}"]) == 0
    assert state_hash(tmp_path / ckpt.FINAL) == (FIXTURE / "state.sha256").read_text().strip()


def test_pinned_checkpoint_resumes(tmp_path, token_cache, two_threads):
    shutil.copy(FIXTURE / "step_000000030.msgpack", tmp_path / "step_000000030.msgpack")
    assert main([*ARGS, "steps=35", f"out={tmp_path}"]) == 0
    final = ckpt.load(tmp_path / ckpt.FINAL)
    assert final["step"] == 35 and final["loop"]["ticks"] == 35
