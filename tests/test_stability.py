"""The stability toolkit end to end: spike rollback, NaN skipping, remat, mixed precision, loss scaling."""
import json
import math
from pathlib import Path

import pytest
import torch

from purestep import optim
from purestep.core.io import checkpoint as ckpt
from purestep.recipes import main
from purestep.core.loss_scale import init_loss_scale, update_loss_scale
from purestep.core.state import init_state
from purestep.core.step import Gradients, make_train_step
from purestep.core.tree import max_abs_diff
from purestep.models import llama


pytestmark = pytest.mark.usefixtures("token_cache")   # corpus and token_cache: tests/conftest.py


RUN = ["recipe=standard", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "block_size=32",
       "batch_size=8", "compile=false", "sample_tokens=0", "eval_batches=8", "log_every=5", "lr=1e-2",
       "spike.warmup=20", "spike.ema=0.95", "spike.snapshot_every=10", "spike.rollback_back=10",
       "spike.skip_ahead=20"]
BAD = ["fault.inject_spike_at=150", "fault.spike_length=20"]   # 20 batches of random tokens near the end


def events(folder: Path) -> list[dict]:
    return [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "event" in r]


@pytest.fixture(scope="module")
def clean_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "run"
    assert main([*RUN, f"data={corpus}", f"out={out}", "steps=200", "eval_every=200"]) == 0
    return out


def val_loss(folder: Path) -> float:
    return ckpt.load(folder / "final.msgpack")["val_loss"]


def test_injected_bad_batches_roll_back_and_match_a_clean_run(corpus, clean_run, tmp_path):
    faulty = tmp_path / "faulty"
    assert main([*RUN, f"data={corpus}", f"out={faulty}", "steps=200", "eval_every=200", *BAD]) == 0
    rollbacks = [e for e in events(faulty) if e["event"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["onset"] == 150 and rollbacks[0]["to_step"] <= 140
    assert rollbacks[0]["skipped_batches"] >= 30           # back to <= 140, and 20 past the spike
    assert not events(clean_run)
    clean, got = val_loss(clean_run), val_loss(faulty)
    assert abs(got - clean) <= 0.02 * clean, (got, clean)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(faulty), size_guidance={"tensors": 0})
    acc.Reload()
    assert any("rollback" in tag for tag in acc.Tags()["tensors"])


def test_without_rollback_the_bad_batches_hurt(corpus, clean_run, tmp_path):
    """The comparison above can fail: the same faults with the detector off leave a clearly worse model."""
    out = tmp_path / "off"
    assert main([*RUN, f"data={corpus}", f"out={out}", "steps=200", "eval_every=200", "spike.enabled=false",
                 *BAD]) == 0
    assert val_loss(out) > 1.05 * val_loss(clean_run)


def test_nan_batch_is_skipped_and_reported(corpus, tmp_path, capsys):
    out = tmp_path / "nan"
    assert main([*RUN, f"data={corpus}", f"out={out}", "steps=12", "eval_every=0", "fault.inject_nan_at=7",
                 "spike.enabled=false"]) == 0
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    skipped = {r["step"]: r["skipped"] for r in rows if "skipped" in r}
    assert skipped[10] == pytest.approx(0.2) and skipped[5] == 0.0   # 1 of the 5 steps in (5, 10]
    assert "non-finite step(s) up to step 10 were skipped" in capsys.readouterr().err


CFG = llama.LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)


def batch(b=4, t=16, seed=0):
    tok = torch.randint(0, 64, (b, t + 1), generator=torch.Generator().manual_seed(seed))
    return {"x": tok[:, :-1], "y": tok[:, 1:]}


def test_remat_gives_the_same_gradients():
    opt = optim.sgd(lr=0.5)
    params = llama.init(CFG, seed=1)
    plain = make_train_step(lambda p, b: llama.loss(p, b, CFG), opt)
    remat = make_train_step(lambda p, b: llama.loss(p, b, CFG, remat=True), opt, gradients=Gradients(remat=True))
    a, ma = plain(init_state(params, opt), batch())
    b, mb = remat(init_state(params, opt), batch())
    assert max_abs_diff(a.params, b.params) < 1e-6
    assert abs(ma["grad_norm"].item() - mb["grad_norm"].item()) < 1e-6


MP_CFG = llama.LlamaConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4)


def train_losses(precision: str) -> list[float]:
    data = [batch(16, 32, seed=i % 4) for i in range(60)]
    opt = optim.adamw(lr=3e-3)
    step = make_train_step(lambda params, b: llama.loss(params, b, MP_CFG), opt, precision=precision)
    state = init_state(llama.init(MP_CFG, seed=0), opt, precision=precision)
    losses = []
    for b in data:
        state, m = step(state, b)
        losses.append(m["loss"].item())
    assert state.params["embed"].dtype == torch.float32          # master weights stay fp32
    return losses


@pytest.fixture(scope="module")
def fp32_losses():
    return train_losses("fp32")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_like_fp32(precision, fp32_losses):
    ref = sum(fp32_losses[-10:]) / 10
    got = sum(train_losses(precision)[-10:]) / 10
    assert ref < 0.8 * fp32_losses[0]                               # it really trained
    assert abs(got - ref) <= 0.05 * ref, (got, ref)
    print(f"{precision}: final loss {got:.4f} vs fp32 {ref:.4f} ({100 * (got / ref - 1):+.2f}%)")


def test_fp16_loss_scale_backs_off_on_overflow_and_grows_when_stable():
    opt = optim.adamw(lr=1e-3)
    step = make_train_step(lambda p, b: llama.loss(p, b, CFG), opt, precision="fp16")
    state = init_state(llama.init(CFG), opt, precision="fp16")
    state = state._replace(loss_scale={**state.loss_scale, "scale": torch.tensor(2.0 ** 80)})  # forced overflow
    before = state.params
    state, m = step(state, batch())
    assert m["skipped"].item() == 1.0 and m["loss_scale"].item() == 2.0 ** 79
    assert max_abs_diff(state.params, before) == 0.0
    while m["skipped"].item():
        state, m = step(state, batch())
    assert m["loss_scale"].item() < 2.0 ** 79 and max_abs_diff(state.params, before) > 0
    # growth: `interval` finite steps in a row double the scale, then the tracker restarts
    ls = init_loss_scale()
    for _ in range(3):
        ls = update_loss_scale(ls, torch.tensor(True), interval=3)
    assert ls["scale"].item() == 2.0 ** 17 and ls["growth_tracker"].item() == 0
    ls = update_loss_scale(ls, torch.tensor(False), interval=3)
    assert ls["scale"].item() == 2.0 ** 16


def test_stability_keys_reach_the_step_and_the_checkpoint(corpus, tmp_path):
    out = tmp_path / "keys"
    assert main([*RUN, f"data={corpus}", f"out={out}", "steps=6", "eval_every=0", "clipping=adagc",
                 "adagc.warmup=2", "grad_accum=2", "remat=true", "dtype=bf16"]) == 0
    top = ckpt.load(out / "final.msgpack")
    opt_state = top["state"]["opt_state"]
    adagc_state = opt_state["0"]
    assert int(adagc_state["count"]) == 6 and "gamma" in adagc_state
    assert top["config"]["clipping"] == "adagc" and top["config"]["grad_accum"] == 2
    assert set(top["state"]["monitor"]) >= {"loss_mean", "hard", "onset"}
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(k.startswith("health/") for r in rows for k in r)


def test_faults_wrap_every_loss_signature_the_step_takes():
    from purestep.recipes.train.faults import with_faults
    params, frozen = torch.ones(2), torch.tensor(2.0)
    losses = [lambda p, b: p.sum(), lambda p, b, key: p.sum(), lambda p, b, frozen=None: p.sum() + frozen,
              lambda p, b, key, frozen: (p.sum() + frozen, {"aux": frozen})]
    for scale, expected in ((1.0, [2.0, 2.0, 4.0, 4.0]), (float("nan"), [math.nan] * 4)):
        batch = {"x": torch.zeros(1), "loss_multiplier": torch.tensor(scale)}
        got = [with_faults(fn)(params, batch, None, frozen)[0].item() for fn in losses]
        assert got == pytest.approx(expected, nan_ok=True)
