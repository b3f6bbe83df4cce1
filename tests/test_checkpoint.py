"""core.io.checkpoint: Flax wire format, chunking, atomicity (incl. SIGKILL), corruption, retention, templates."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import NamedTuple

import msgpack
import numpy as np
import pytest
import torch

from purestep.core.io import cache
from purestep.core.io import checkpoint as ckpt
from purestep.core.io import checkpoint_format as fmt
from purestep.core.io.checkpoint import CheckpointError, CheckpointManager
from purestep.core.state import TrainState


class AdamLike(NamedTuple):
    count: torch.Tensor
    mu: dict
    nu: dict


class Empty(NamedTuple):
    pass


def make_state(seed: int = 0) -> TrainState:
    g = torch.Generator().manual_seed(seed)
    wq = torch.randn(2, 8, 4, generator=g)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 3.0])
    params = {
        "embed": torch.randn(5, 3, generator=g),
        "layers": {"attn": {"wq": wq.bfloat16()}, "norm": torch.randn(2, 4, generator=g).half()},
        "f64": torch.randn(3, dtype=torch.float64, generator=g),
        "special": special,
        "mask": torch.tensor([True, False, True]),
        "ints": (torch.tensor([-5, 7], dtype=torch.int8), torch.tensor([200, 3], dtype=torch.uint8),
                 torch.tensor([-30000], dtype=torch.int16), torch.tensor([2**31 - 1], dtype=torch.int32)),
        "empty": torch.zeros(0, 3),
        "t": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
    }
    zeros = {k: torch.zeros_like(v) for k, v in params.items() if k in ("embed", "f64")}
    opt_state = (AdamLike(torch.tensor(3, dtype=torch.int32), zeros, {k: v + 1 for k, v in zeros.items()}), Empty())
    return TrainState(
        step=torch.tensor(7),
        params=params,
        opt_state=opt_state,
        key=torch.tensor(123456789, dtype=torch.int64),
        cursor=torch.tensor(11),
        loss_scale={"scale": torch.tensor(65536.0), "growth_tracker": torch.tensor(0), "note": "fp16",
                    "lr": 0.5, "flag": True, "n": -3, "none": None},
    )


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def assert_same_tree(a, b, path="state"):
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert bitwise_equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{path}.{i}")
    else:
        assert a == b, path


def contiguous(state: TrainState) -> TrainState:
    """What a load gives back: the one non-contiguous leaf comes back contiguous."""
    return state._replace(params={**state.params, "t": state.params["t"].contiguous()})


def flax_ext_hook(code, data):
    """Flax's ext-type-1 rule (flax.serialization._msgpack_ext_unpack), with torch instead of numpy."""
    assert code == 1
    shape, name, buf = msgpack.unpackb(data, raw=True)
    if name == b"bfloat16":
        return torch.frombuffer(bytearray(buf), dtype=torch.int16).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(np.frombuffer(buf, dtype=np.dtype(name.decode())).copy()).reshape(shape)


def plain_decode(path):
    with open(path, "rb") as f:
        return msgpack.unpackb(f.read(), ext_hook=flax_ext_hook, raw=False, strict_map_key=False)


# ----------------------------------------------------------------------------- format

def test_round_trip_with_template_is_bitwise_and_restores_structure(tmp_path):
    state = make_state()
    path = tmp_path / "a.msgpack"
    extra = {"config": {"lr": 1e-3, "betas": [0.9, 0.95], "name": "tiny"}, "meta": {"torch": torch.__version__}}
    nbytes = ckpt.save(path, state, step=7, extra=extra)
    assert nbytes == path.stat().st_size

    out = ckpt.load(path, template=make_state(seed=1))
    assert out["format"] == ckpt.FORMAT and out["step"] == 7
    assert out["config"] == extra["config"] and out["meta"] == extra["meta"]
    restored = out["state"]
    assert_same_tree(restored, contiguous(state))
    assert isinstance(restored, TrainState) and isinstance(restored.opt_state, tuple)
    assert isinstance(restored.opt_state[0], AdamLike) and restored.opt_state[1] == Empty()
    assert restored.params["layers"]["attn"]["wq"].dtype == torch.bfloat16
    assert restored.key.shape == () and restored.key.dtype == torch.int64

    # Without a template: Flax's state dict (str-keyed maps), tensors and Python values as stored.
    raw = ckpt.load(path)["state"]
    assert set(raw["opt_state"]) == {"0", "1"} and set(raw["opt_state"]["0"]) == {"count", "mu", "nu"}
    assert raw["opt_state"]["1"] == {} and raw["params"]["ints"]["1"].dtype == torch.uint8
    assert raw["step"].shape == () and raw["loss_scale"]["none"] is None and raw["loss_scale"]["lr"] == 0.5


def test_meta_template_and_device(tmp_path):
    state = make_state()
    ckpt.save(tmp_path / "a.msgpack", state, step=1)
    meta_template = make_state()._replace(params={k: v for k, v in make_state().params.items()})
    meta_template = meta_template._replace(params={k: (v.to("meta") if isinstance(v, torch.Tensor) else v)
                                                   for k, v in meta_template.params.items()})
    restored = ckpt.load(tmp_path / "a.msgpack", template=meta_template)["state"]
    assert restored.params["embed"].device.type == "cpu"
    assert bitwise_equal(restored.params["embed"], state.params["embed"])
    assert ckpt.load(tmp_path / "a.msgpack", device="cpu")["state"]["params"]["f64"].device.type == "cpu"


def test_read_meta_skips_the_state(tmp_path):
    ckpt.save(tmp_path / "a.msgpack", make_state(), step=42, extra={"val_loss": 1.25, "config": {"d": 8}})
    assert ckpt.read_meta(tmp_path / "a.msgpack") == {"format": ckpt.FORMAT, "step": 42, "val_loss": 1.25,
                                                      "config": {"d": 8}}


def test_plain_msgpack_reader_with_flax_ext_rule_sees_the_same_arrays(tmp_path):
    state = make_state()
    ckpt.save(tmp_path / "a.msgpack", state, step=7)
    decoded = plain_decode(tmp_path / "a.msgpack")
    assert decoded["format"] == ckpt.FORMAT and decoded["step"] == 7
    expected = ckpt.to_state_dict(contiguous(state))
    assert_same_tree(decoded["state"], expected)
    assert decoded["state"]["params"]["layers"]["attn"]["wq"].dtype == torch.bfloat16


@pytest.mark.parametrize("chunk", [2**30, 64])
def test_flax_reads_our_file_and_writes_the_same_bytes(tmp_path, monkeypatch, chunk):
    serialization = pytest.importorskip("flax.serialization")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    monkeypatch.setattr(fmt, "MAX_CHUNK_SIZE", chunk)
    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", chunk)
    state = make_state()
    ckpt.save(tmp_path / "a.msgpack", state, step=7, extra={"config": {"lr": 0.1}})
    ours = (tmp_path / "a.msgpack").read_bytes()

    restored = serialization.msgpack_restore(ours)
    wq = restored["state"]["params"]["layers"]["attn"]["wq"]
    assert str(wq.dtype) == "bfloat16" and wq.shape == (2, 8, 4)
    assert bitwise_equal(torch.from_numpy(np.asarray(wq).view(np.int16).copy()),
                         state.params["layers"]["attn"]["wq"].view(torch.int16))
    assert np.array_equal(restored["state"]["params"]["f64"], state.params["f64"].numpy())

    def to_numpy(x):
        if isinstance(x, dict):
            return {k: to_numpy(v) for k, v in x.items()}
        if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16:
            return x.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.contiguous().numpy() if isinstance(x, torch.Tensor) else x

    # in_place=True keeps our key order (the copying path re-sorts dict keys through jax.tree_util).
    tree = {"format": ckpt.FORMAT, "step": 7, "state": to_numpy(ckpt.to_state_dict(state)), "config": {"lr": 0.1},
            "checksums": restored["checksums"]}
    assert set(restored) == set(tree)
    assert serialization.msgpack_serialize(tree, in_place=True) == ours
    # Flax's default path sorts the keys ("config" before "format"); we still read it back.
    (tmp_path / "flax.msgpack").write_bytes(serialization.msgpack_serialize(tree))
    assert_same_tree(ckpt.load(tmp_path / "flax.msgpack", template=state)["state"], contiguous(state))


def test_save_writes_tensor_memory_without_copying_it(tmp_path, monkeypatch):
    big = torch.randn(1000, 100)
    seen = []
    real = fmt._write_bytes

    def spy(f, data):
        seen.append(np.frombuffer(data, dtype=np.uint8).ctypes.data)
        real(f, data)

    monkeypatch.setattr(fmt, "_write_bytes", spy)
    ckpt.save(tmp_path / "a.msgpack", {"big": big, "bf": big.bfloat16()}, step=0)
    assert big.data_ptr() in seen


def test_chunked_arrays_follow_flax_layout(tmp_path, monkeypatch):
    monkeypatch.setattr(fmt, "MAX_CHUNK_SIZE", 64)
    tree = {"big": torch.arange(100, dtype=torch.float32).reshape(10, 10),
            "bf": torch.randn(5, 9).bfloat16(), "small": torch.arange(16, dtype=torch.float32)}
    ckpt.save(tmp_path / "a.msgpack", tree, step=0)

    on_disk = plain_decode(tmp_path / "a.msgpack")["state"]
    big = on_disk["big"]
    assert list(big) == ["__msgpack_chunked_array__", "shape", "chunks"]
    assert big["__msgpack_chunked_array__"] is True and big["shape"] == {"0": 10, "1": 10}
    assert list(big["chunks"]) == [str(i) for i in range(7)]  # 16 float32 per 64-byte chunk
    assert [c.shape for c in big["chunks"].values()] == [(16,)] * 6 + [(4,)]
    assert torch.equal(torch.cat(list(big["chunks"].values())).reshape(10, 10), tree["big"])
    assert [c.shape for c in on_disk["bf"]["chunks"].values()] == [(32,), (13,)]
    assert isinstance(on_disk["small"], torch.Tensor)  # exactly MAX_CHUNK_SIZE bytes: not chunked

    restored = ckpt.load(tmp_path / "a.msgpack", template=tree)["state"]
    assert_same_tree(restored, tree)


def test_key_sorted_chunk_maps_read_back(tmp_path):
    """Flax's default (copying) msgpack_serialize sorts keys: "chunks" before "shape", "10" before "2"."""
    big = torch.arange(100, dtype=torch.float32).reshape(10, 10)
    chunks = {str(i): big.reshape(-1)[4 * i:4 * i + 4] for i in range(25)}
    top = {"format": ckpt.FORMAT, "state": {"big": {"__msgpack_chunked_array__": True,
                                                    "chunks": dict(sorted(chunks.items())),
                                                    "shape": {"0": 10, "1": 10}}}, "step": 3}

    def flax_ext_default(t):
        return msgpack.ExtType(1, msgpack.packb((list(t.shape), "float32", t.numpy().tobytes()), use_bin_type=True))

    (tmp_path / "sorted.msgpack").write_bytes(msgpack.packb(top, default=flax_ext_default, use_bin_type=True))
    assert list(top["state"]["big"]["chunks"])[:3] == ["0", "1", "10"]
    assert torch.equal(ckpt.load(tmp_path / "sorted.msgpack")["state"]["big"], big)


# ----------------------------------------------------------------------------- atomicity

def test_failed_replace_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "a.msgpack"
    ckpt.save(path, {"w": torch.ones(3)}, step=1)
    before = path.read_bytes()

    def boom(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(ckpt.CheckpointSaveError, match="a.msgpack: cannot save the checkpoint: disk on fire"):
        ckpt.save(path, {"w": torch.zeros(3)}, step=2)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["a.msgpack"]


def test_error_while_writing_leaves_no_temp(tmp_path):
    with pytest.raises(TypeError, match=r"state\.bad: cannot checkpoint a value of type object"):
        ckpt.save(tmp_path / "a.msgpack", {"w": torch.ones(2), "bad": object()}, step=1)
    assert list(tmp_path.iterdir()) == []


CHILD = textwrap.dedent("""
    import sys, time, torch
    from purestep.core.io import checkpoint as ckpt
    from purestep.core.io import checkpoint_format as fmt
    folder, marker = sys.argv[1], sys.argv[2]
    manager = ckpt.CheckpointManager(folder, keep_last=1)
    manager.save(1, {"w": torch.full((1000,), 1.0)})
    open(marker, "w").close()
    real = fmt._write_bytes
    def slow(f, data):  # test-only: make the big write take seconds so the kill lands mid-write
        for i in range(0, len(data), 1 << 16):
            real(f, data[i:i + (1 << 16)])
            f.flush()
            time.sleep(0.01)
    fmt._write_bytes = slow
    manager.save(2, {"w": torch.zeros(4 << 20)})
    open(marker + ".finished", "w").close()
""")


def test_sigkill_mid_write_leaves_the_previous_checkpoint(tmp_path):
    folder, marker = tmp_path / "ckpts", tmp_path / "step1.done"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(folder), str(marker)])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert child.poll() is None and time.monotonic() < deadline, "child died before writing step 1"
            time.sleep(0.02)
        while not any(p.stat().st_size > (1 << 18) for p in folder.glob(".tmp-*")):
            assert child.poll() is None and time.monotonic() < deadline, "child finished before the kill"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL and not (tmp_path / "step1.done.finished").exists()
    stale = list(folder.glob(".tmp-*"))
    assert len(stale) == 1
    with pytest.raises(CheckpointError, match="truncated"):
        ckpt.load(stale[0])
    assert ckpt.latest(folder) == folder / "step_000000001.msgpack"
    out = ckpt.load(ckpt.latest(folder))
    assert out["step"] == 1 and torch.equal(out["state"]["w"], torch.full((1000,), 1.0))
    CheckpointManager(folder)  # reopening the folder removes the stale temp file
    assert not list(folder.glob(".tmp-*"))


# ----------------------------------------------------------------------------- corruption and discovery

def test_truncated_or_corrupt_newest_falls_back_to_previous(tmp_path, capsys):
    manager = CheckpointManager(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        manager.save(step, {"w": torch.full((256,), float(step))})
    newest = tmp_path / "step_000000003.msgpack"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])

    assert manager.latest() == tmp_path / "step_000000002.msgpack"
    assert capsys.readouterr().err == (f"skipping checkpoint {newest}: truncated: the file ends at byte "
                                       f"{len(data) // 2}, inside the checkpoint (an interrupted write or copy?); "
                                       f"using {tmp_path / 'step_000000002.msgpack'}\n")
    with pytest.raises(CheckpointError, match=r"step_000000003\.msgpack: truncated") as err:
        ckpt.load(newest)
    assert "\n" not in str(err.value)

    for bad, reason in ((b"", "empty file"), (b"\x00 garbage", "not a purestep checkpoint"),
                        (data + b"\x00", "corrupt"), (torch_bytes(tmp_path), "not a purestep checkpoint"),
                        (b"\x81\xa1a" + b"\x91" * 100_000, "corrupt .*nested too deeply")):
        newest.write_bytes(bad)
        with pytest.raises(CheckpointError, match=reason):
            ckpt.load(newest)
    # A damaged tag inside the state: the ext header of the array under key "w" becomes the reserved 0xc1.
    at = data.index(b"\xa1w") + 2
    newest.write_bytes(data[:at] + b"\xc1" + data[at + 1:])
    with pytest.raises(CheckpointError, match="corrupt .*0xc1"):
        ckpt.load(newest)


def torch_bytes(tmp_path) -> bytes:
    torch.save({"w": torch.ones(2)}, tmp_path / "x.pt")
    return (tmp_path / "x.pt").read_bytes()


def test_latest_uses_the_step_stored_in_the_file(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=0)
    manager.save(5, {"w": torch.ones(1)})
    manager.save(10, {"w": torch.ones(1)}, final=True)
    (tmp_path / "step_000000010.msgpack").unlink()
    os.utime(tmp_path / "step_000000005.msgpack")  # newer mtime must not matter
    assert manager.latest() == tmp_path / "final.msgpack"
    assert ckpt.latest(tmp_path / "missing") is None


def test_resolve_resume(tmp_path):
    assert ckpt.resolve_resume("auto", tmp_path) is None
    assert ckpt.resolve_resume("never", tmp_path) is None
    manager = CheckpointManager(tmp_path)
    path = manager.save(3, {"w": torch.ones(1)})
    assert ckpt.resolve_resume("auto", tmp_path) == path
    assert ckpt.resolve_resume("never", tmp_path) is None
    assert ckpt.resolve_resume(str(path), tmp_path / "elsewhere") == path
    assert ckpt.resolve_resume(str(tmp_path), None) == path
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        ckpt.resolve_resume(str(tmp_path / "nope.msgpack"), tmp_path)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(CheckpointError, match="truncated"):
        ckpt.resolve_resume(str(path), tmp_path)


# ----------------------------------------------------------------------------- retention

def test_retention_keep_last_best_and_final(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2, save_every=10)
    assert [s for s in range(0, 41) if manager.should_save(s)] == [10, 20, 30, 40]
    for step, loss in ((10, 3.0), (20, 1.0), (30, 2.0), (40, float("nan"))):
        manager.save(step, {"w": torch.full((4,), float(step))}, val_loss=loss)
    manager.save(50, {"w": torch.full((4,), 50.0)}, val_loss=4.0, final=True)

    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["best.msgpack", "final.msgpack", "step_000000040.msgpack", "step_000000050.msgpack"]
    best = ckpt.load(manager.best())
    assert best["step"] == 20 and best["val_loss"] == 1.0 and torch.equal(best["state"]["w"], torch.full((4,), 20.0))
    assert ckpt.load(tmp_path / "final.msgpack")["step"] == 50
    assert manager.latest() == tmp_path / "step_000000050.msgpack"

    reopened = CheckpointManager(tmp_path, keep_last=2)  # the best survives a restart
    assert reopened.best_loss == 1.0
    reopened.save(60, {"w": torch.ones(4)}, val_loss=1.5)
    assert ckpt.read_meta(reopened.best())["step"] == 20
    reopened.save(70, {"w": torch.ones(4)}, val_loss=0.5)
    assert ckpt.read_meta(reopened.best())["step"] == 70
    assert ckpt.read_meta(tmp_path / "final.msgpack")["step"] == 50


def test_publish_without_hard_links_writes_a_fsynced_copy(tmp_path, monkeypatch):
    def no_link(src, dst):
        raise OSError("links not supported")
    synced = []
    real_fsync_path = cache.fsync_path
    monkeypatch.setattr(cache.os, "link", no_link)
    monkeypatch.setattr(cache, "fsync_path", lambda p: (synced.append(os.fspath(p)), real_fsync_path(p)))
    manager = CheckpointManager(tmp_path, keep_last=0)
    src = manager.save(5, {"w": torch.arange(3.0)}, final=True)
    final = tmp_path / ckpt.FINAL
    assert final.read_bytes() == src.read_bytes() and not os.path.samefile(final, src)
    assert [p for p in synced if os.path.basename(p).startswith(".tmp-") and p.endswith(ckpt.FINAL)]
    assert synced[-1] == os.fspath(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.FINAL, src.name]


def test_checkpoint_error_is_a_user_error():
    from purestep.core.config import UserError
    assert issubclass(CheckpointError, UserError)


def test_resuming_from_an_older_step_keeps_the_new_file(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=1)
    manager.save(20, {"w": torch.ones(1)})
    path = manager.save(10, {"w": torch.ones(1)})
    assert path.exists()


# ----------------------------------------------------------------------------- template mismatches

@pytest.mark.parametrize("edit, message", [
    (lambda s: s.params["layers"]["attn"].update(wq=torch.zeros(2, 16, 4, dtype=torch.bfloat16)),
     r"state\.params\.layers\.attn\.wq: shape \(2, 8, 4\) in file, \(2, 16, 4\) expected"),
    (lambda s: s.params.update(f64=torch.zeros(3, dtype=torch.float32)),
     r"state\.params\.f64: dtype float64 in file, float32 expected"),
    (lambda s: s.params.update(extra=torch.zeros(1)), r"state\.params: keys missing from file \['extra'\]"),
    (lambda s: s.params.pop("mask"), r"state\.params: unexpected keys in file \['mask'\]"),
    (lambda s: s.params.update(embed={"w": torch.zeros(5, 3)}), r"state\.params\.embed: a float32 tensor"),
    (lambda s: s.loss_scale.update(lr=1), r"state\.loss_scale\.lr: a float in file, int expected"),
    (lambda s: s.opt_state[0].mu.update(embed=torch.zeros(5, 4)), r"state\.opt_state\.0\.mu\.embed: shape"),
])
def test_template_mismatch_names_the_path(tmp_path, edit, message):
    path = tmp_path / "a.msgpack"
    ckpt.save(path, make_state(), step=1)
    template = make_state()
    edit(template)
    with pytest.raises(CheckpointError, match=message) as err:
        ckpt.load(path, template=template)
    assert str(err.value).startswith(str(path))


def test_sharded_checkpoints_keep_their_pieces_while_a_checkpoint_names_them(tmp_path):
    """``core.io.checkpoint_shards``: a pruned step's pieces are deleted with it, a best checkpoint's stay while the
    link does, and pieces no index names (a save killed before rank 0's index) are removed when a manager opens the
    folder; a load joins the pieces into the whole leaf."""
    from purestep.core.io.checkpoint_shards import BOXES, MARKER, SHARDS, shard_name

    def save_pieces(step: int) -> list:
        names = [shard_name(step, i, 2) for i in range(2)]
        for i, name in enumerate(names):
            box = {"state.w": {"whole": [2, 3], "offset": [i, 0], "length": [1, 3]}}
            ckpt.save(tmp_path / name, {"state.w": torch.full((1, 3), 10.0 * step + i)}, step=step,
                      extra={BOXES: box})
        return names

    manager = ckpt.CheckpointManager(tmp_path, keep_last=1)
    for step, val_loss in ((1, 1.0), (2, 0.5), (3, 2.0)):
        manager.save(step, {"w": MARKER, "step": torch.tensor(step)}, extra={SHARDS: save_pieces(step)},
                     val_loss=val_loss)
    pieces = sorted(p.name for p in tmp_path.glob("*.shard-*"))
    assert pieces == sorted([*(shard_name(2, i, 2) for i in range(2)), *(shard_name(3, i, 2) for i in range(2))])
    best = ckpt.load(tmp_path / ckpt.BEST)["state"]
    assert torch.equal(best["w"], torch.tensor([[20.0] * 3, [21.0] * 3])) and int(best["step"]) == 2
    save_pieces(4)                                   # killed before its index
    ckpt.CheckpointManager(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.glob("*.shard-*")) == pieces
