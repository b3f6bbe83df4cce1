"""Behaviour pinned across refactors: a fixed tiny run must give a bitwise equal state, and its committed
final checkpoint must still resume.

The fixture (``tests/fixtures/behaviour/``) was made before the recipes were reorganized: the command in
``ARGS`` on ``corpus.txt`` (the first 64 KiB of tiny shakespeare), its final checkpoint
``step_000000030.msgpack`` and ``state.sha256``, the hash of the run's final train state
(``state_hash.py``: every leaf's path, dtype, shape and bytes).

A change that moves rounding on purpose re-records ``state.sha256`` (python state_hash.py on the new final
checkpoint) and says so in its commit; the committed checkpoint stays the first recording, and the run
must stay within float rounding of it. Re-recorded twice: AdamW's moments by ``lerp`` and eager steps
through ``torch.autograd`` (issue "the functional step at plain PyTorch's cost"; params moved <= 1.2e-7); Adam's
direction divided by its bias correction last, so the donated step writes it into the gradients without a
fresh temporary (params 1.2e-7 from the first recording).

The bitwise hash holds on one machine only: float kernels round differently by CPU (the recording of 2026-11-26,
torch 2.13.0+cpu on that session's CPU, is reproduced by no torch on the AMD EPYC of 2026-11-27, where torch
2.11.0, 2.13.0 and 2.14.1 all give one other state, ~1e-7 away) and may by torch build. ``state.sha256`` holds
one hash per torch version and CPU (``state_hash.platform_key``), each recorded there. Where none is recorded
the bitwise check skips, saying how to record one, and the run is still held within float rounding of the
committed checkpoint.
"""
import shutil
from pathlib import Path

import pytest
import torch

from purestep.core.io import checkpoint as ckpt
from purestep.core.tree import max_abs_diff
from purestep.recipes import main
from tests.fixtures.behaviour.state_hash import platform_key, state_hash

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


def pinned_hashes() -> dict[str, str]:
    """``state.sha256``: ``platform_key()`` (torch version, CPU) -> the fixed run's state hash there (``#``: a
    comment)."""
    lines = (line.split("#", 1)[0].split() for line in (FIXTURE / "state.sha256").read_text().splitlines())
    return {f"{words[0]} {words[1]}": words[2] for words in lines if words}


@pytest.fixture(scope="module")
def fixed_run(tmp_path_factory):
    """The fixed 30-step run, once for the module (its own token cache, 2 threads)."""
    out = tmp_path_factory.mktemp("fixed_run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PURESTEP_CACHE", str(out / "cache"))
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert main([*ARGS, "steps=30", f"out={out / 'run'}"]) == 0
        finally:
            torch.set_num_threads(before)
    return out / "run" / ckpt.FINAL


def test_fixed_run_stays_within_rounding_of_the_first_recording(fixed_run):
    first = ckpt.load(FIXTURE / "step_000000030.msgpack")["state"]["params"]
    now = ckpt.load(fixed_run)["state"]["params"]
    assert max_abs_diff(first, now) < 1e-6   # re-recordings and torch releases move rounding, not behaviour


def test_fixed_run_gives_the_pinned_state(fixed_run):
    pinned, here = pinned_hashes(), platform_key()
    if here not in pinned:
        pytest.skip(f"no pinned state for {here} (recorded for: {'; '.join(pinned)}); to pin it, add the line "
                    f"`python tests/fixtures/behaviour/state_hash.py FINAL` prints for this run's final checkpoint "
                    f"to tests/fixtures/behaviour/state.sha256")
    assert state_hash(fixed_run) == pinned[here]


def test_pinned_checkpoint_resumes(tmp_path, token_cache, two_threads):
    shutil.copy(FIXTURE / "step_000000030.msgpack", tmp_path / "step_000000030.msgpack")
    assert main([*ARGS, "steps=35", f"out={tmp_path}"]) == 0
    final = ckpt.load(tmp_path / ckpt.FINAL)
    assert final["step"] == 35 and final["loop"]["ticks"] == 35
