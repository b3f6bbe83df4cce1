"""core.io.checkpoint hardening: per-tensor CRC-32s, resume over damaged files, Flax's other leaf types, disk full."""
from __future__ import annotations

import errno
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from purestep.core.io import checkpoint as ckpt
from purestep.core.io import checkpoint_format as fmt
from purestep.core.io.checkpoint import CheckpointError, CheckpointManager
from purestep.core.config import UserError
from purestep.recipes import main

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "block_size=32", "batch_size=4",
        "compile=false", "sample_tokens=0", "eval_every=0", "log_every=2"]
pytestmark = pytest.mark.usefixtures("token_cache")   # tests/conftest.py: the training runs' token cache


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """About 60 KB of real text: a few of this Python's own standard-library modules."""
    import json
    import textwrap
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("".join(Path(m.__file__).read_text() for m in (json, textwrap)))
    return path


def train(corpus, out, *extra) -> int:
    return main(["recipe=standard", f"data={corpus}", f"out={out}", *TINY, *extra])


def tensor_offset(path: Path, tensor: torch.Tensor) -> int:
    """Where ``tensor``'s bytes start in the file at ``path``."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    at = path.read_bytes().find(raw)
    assert at > 0 and len(raw) >= 64
    return at


def damage(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:  # in place: a hard link to the same file sees it too
        f.seek(at)
        f.write(data)


def snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# ----------------------------------------------------------------------------- checksums

@pytest.mark.parametrize("garbage", [bytes(range(16)), b"\xff" * 4000], ids=["16 bytes", "4000 bytes of 0xff"])
def test_damaged_tensor_bytes_are_corrupt_and_discovery_falls_back(tmp_path, capsys, garbage):
    manager = CheckpointManager(tmp_path, keep_last=0)
    for step in (1, 2):
        manager.save(step, {"w": torch.full((4096,), float(step)), "b": torch.ones(3)}, val_loss=1.0 / step,
                     final=step == 2)
    newest = tmp_path / "step_000000002.msgpack"
    damage(newest, tensor_offset(newest, torch.full((4096,), 2.0)) + 100, garbage)
    with pytest.raises(CheckpointError, match=r"step_000000002\.msgpack: corrupt \(checksum mismatch in tensor "
                                              r"state\.w: its bytes changed after the save\)"):
        ckpt.load(newest)
    assert ckpt.read_meta(newest)["step"] == 2  # the framing is intact: only the CRC tells
    capsys.readouterr()
    # best and final are hard links to step 2: all three are skipped, said in one line
    assert ckpt.resolve_resume("auto", tmp_path) == tmp_path / "step_000000001.msgpack"
    assert capsys.readouterr().err == (
        f"skipping checkpoint {newest}: corrupt (checksum mismatch in tensor state.w: its bytes changed after "
        f"the save) (also best.msgpack, final.msgpack: the same file); using {tmp_path / 'step_000000001.msgpack'}\n")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        ckpt.resolve_resume(str(tmp_path / "best.msgpack"), tmp_path)


def test_checksums_are_a_reserved_key_flax_reads_past(tmp_path):
    serialization = pytest.importorskip("flax.serialization")
    tree = {"a": {"b": torch.arange(10.0)}, "empty": torch.zeros(0)}
    ckpt.save(tmp_path / "a.msgpack", tree, step=3, extra={"meta": {"t": torch.ones(2)}})
    restored = serialization.msgpack_restore((tmp_path / "a.msgpack").read_bytes())
    assert list(restored) == ["format", "step", "state", "meta", "checksums"]
    assert set(restored["state"]) == {"a", "empty"} and np.array_equal(restored["state"]["a"]["b"], np.arange(10.0))
    assert restored["checksums"]["state"]["empty"] == 0 and set(restored["checksums"]) == {"state", "meta"}
    top = ckpt.load(tmp_path / "a.msgpack")
    assert "checksums" not in top and "checksums" not in ckpt.read_meta(tmp_path / "a.msgpack")
    with pytest.raises(ValueError, match="reserved"):
        ckpt.save(tmp_path / "b.msgpack", tree, step=1, extra={"checksums": {}})


def test_chunked_arrays_are_checked_as_one_tensor_even_key_sorted(tmp_path, monkeypatch):
    serialization = pytest.importorskip("flax.serialization")
    monkeypatch.setattr(fmt, "MAX_CHUNK_SIZE", 64)
    big = torch.arange(100, dtype=torch.float32).reshape(10, 10)
    ckpt.save(tmp_path / "a.msgpack", {"big": big}, step=1)
    restored = serialization.msgpack_restore((tmp_path / "a.msgpack").read_bytes())
    assert list(restored["checksums"]["state"]) == ["big"]  # one CRC for the 7 chunks
    # Flax's default serializer sorts keys: "checksums" first, "chunks" before "shape", "10" before "2"
    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 64)
    (tmp_path / "sorted.msgpack").write_bytes(serialization.msgpack_serialize(restored))
    for name in ("a.msgpack", "sorted.msgpack"):
        assert torch.equal(ckpt.load(tmp_path / name)["state"]["big"], big)
        assert fmt.read(tmp_path / name, state="check")["state"]["big"] is None
        damage(tmp_path / name, tensor_offset(tmp_path / name, big.reshape(-1)[80:96]) + 5, b"\x7f")
        for state in ("load", "check"):
            with pytest.raises(CheckpointError, match="checksum mismatch in tensor state.big"):
                fmt.read(tmp_path / name, state=state)


# ----------------------------------------------------------------------------- resume


def test_resume_auto_refuses_a_folder_of_only_bad_checkpoints(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(corpus, out, "steps=2", "save_every=1") == 0
    for p in out.glob("step_*.msgpack"):
        with open(p, "r+b") as f:
            f.truncate(1000)
    before = snapshot(out)
    capsys.readouterr()
    assert train(corpus, out, "steps=4", "save_every=1") == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(out) in errors[0], errors
    assert all(word in errors[0] for word in ("resume=PATH", "resume=never", "out=", "delete")), errors[0]
    assert snapshot(out) == before


def test_resume_falls_back_past_a_flipped_byte_in_the_newest(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(corpus, out, "steps=4", "save_every=2") == 0
    newest, previous = out / "step_000000004.msgpack", out / "step_000000002.msgpack"
    embed = ckpt.load(newest)["state"]["params"]["embed"]
    at = tensor_offset(newest, embed) + embed.numel() * embed.element_size() // 2
    damage(newest, at, bytes([newest.read_bytes()[at] ^ 0x01]))
    capsys.readouterr()
    assert train(corpus, out, "steps=6", "save_every=2") == 0
    err = capsys.readouterr().err
    assert f"skipping checkpoint {newest}: corrupt (checksum mismatch in tensor state.params.embed" in err
    assert f"using {previous}" in err
    assert ckpt.load(out / ckpt.FINAL)["step"] == 6


# ----------------------------------------------------------------------------- Flax's other leaf types

def test_flax_numpy_scalars_uint32_and_complex_leaves_read(tmp_path):
    serialization = pytest.importorskip("flax.serialization")
    key = np.array([0, 42], dtype=np.uint32)  # what jax.random.PRNGKey(42) holds
    state = {"key": key, "c": np.array([1 + 2j, -0.5j], dtype=np.complex64), "c128": np.array([3j]),
             "f": np.float32(1.5), "i": np.int32(-3), "z": 1 + 2j}
    path = tmp_path / "flax.msgpack"
    path.write_bytes(serialization.msgpack_serialize({"format": ckpt.FORMAT, "step": 1, "state": state}))
    loaded = ckpt.load(path)["state"]
    assert loaded["key"].dtype == torch.uint32 and loaded["key"].tolist() == [0, 42]
    assert loaded["c"].dtype == torch.complex64 and loaded["c"].tolist() == [1 + 2j, -0.5j]
    assert loaded["c128"].dtype == torch.complex128
    assert loaded["f"].shape == () and loaded["f"].dtype == torch.float32 and loaded["f"].item() == 1.5
    assert loaded["i"].dtype == torch.int32 and loaded["i"].item() == -3
    assert loaded["z"] == 1 + 2j and isinstance(loaded["z"], complex)

    # and we write what Flax writes for them (tensors as arrays, a Python complex as ext type 2)
    ours = {"key": torch.tensor([0, 42], dtype=torch.uint32), "c": torch.tensor([1 + 2j], dtype=torch.complex64),
            "z": 1 + 2j}
    ckpt.save(tmp_path / "ours.msgpack", ours, step=1)
    data = (tmp_path / "ours.msgpack").read_bytes()
    restored = serialization.msgpack_restore(data)
    flax_tree = {"format": ckpt.FORMAT, "step": 1, "state": {"key": key, "c": np.array([1 + 2j], dtype=np.complex64),
                                                              "z": 1 + 2j}, "checksums": restored["checksums"]}
    assert serialization.msgpack_serialize(flax_tree, in_place=True) == data
    back = ckpt.load(tmp_path / "ours.msgpack", template=ours)["state"]
    assert torch.equal(back["key"], ours["key"]) and torch.equal(back["c"], ours["c"]) and back["z"] == 1 + 2j


def test_bad_complex_payload_is_corrupt(tmp_path):
    bad = msgpack.packb({"format": ckpt.FORMAT, "step": 1, "state": {"z": msgpack.ExtType(2, b"\x92\xa1a\x01")}})
    (tmp_path / "a.msgpack").write_bytes(bad)
    with pytest.raises(CheckpointError, match="complex number at offset .* is not"):
        ckpt.load(tmp_path / "a.msgpack")


# ----------------------------------------------------------------------------- disk full

def no_space(f, data):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep_last=1)
    first = manager.save(1, {"w": torch.ones(100_000)})
    before = snapshot(tmp_path)
    monkeypatch.setattr(fmt, "_write_bytes", no_space)
    with pytest.raises(ckpt.CheckpointSaveError) as err:
        manager.save(2, {"w": torch.zeros(100_000)})
    assert isinstance(err.value, UserError) and err.value.__cause__ is None and err.value.__suppress_context__
    assert str(err.value).startswith(f"{tmp_path / 'step_000000002.msgpack'}: cannot save the checkpoint: "
                                     f"No space left on device (errno ENOSPC)")
    assert snapshot(tmp_path) == before and ckpt.latest(tmp_path) == first


def test_disk_full_during_training_is_one_error_line(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fmt, "_write_bytes", no_space)
    assert train(corpus, tmp_path / "run", "steps=2") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0] and str(tmp_path / "run") in errors[0]
    assert not list((tmp_path / "run").glob(".tmp-*"))
