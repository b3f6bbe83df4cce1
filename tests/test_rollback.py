"""The rollback ring bounded by memory (``spike.snapshots``) and its fallback to the run's checkpoints on disk:
the default ring holds one copy of the state, a rollback past its reach restores the newest checkpoint at
least ``rollback_back`` steps before the onset (PaLM's restart from a checkpoint before the spike), and the
checkpoint manager's pruning keeps that checkpoint or the log says the rollback fell back."""
import json

import pytest
import torch

from purestep import optim
from purestep.core.io import checkpoint as ckpt
from purestep.core.io.logging import Logger
from purestep.core.compile import compile_count
from purestep.core.spike import SpikeConfig, clear
from purestep.core.state import init_state
from purestep.core.tree import clone, max_abs_diff, tree_map
from purestep.models import llama
from purestep.recipes import main
from purestep.recipes.train import rollback
from purestep.recipes.train.hooks import Jump, Run, StepContext
from purestep.recipes.train.loop import LoopState


CFG = llama.LlamaConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2)


def state_at(base, step: int):
    """``base`` moved to ``step``: its step and cursor, and weights that say which step they are."""
    return base._replace(step=torch.tensor(step), cursor=torch.tensor(step),
                         params=tree_map(lambda t: t + step, base.params))


def hook_and_context(tmp_path, spike: SpikeConfig, manager=None):
    base = init_state(llama.init(CFG, seed=0), optim.adamw(lr=1e-3), spike=True)
    ctx = StepContext(base, 0, 0, run=Run(loop=LoopState()))
    hook = rollback.Rollback(spike, Logger(tmp_path / "log", tensorboard=False), ctx, manager)
    ctx.run.hooks = [hook]
    return base, ctx, hook


def advance(ctx, hook, base, to: int, *, log_every: int = 5, manager=None, save_every: int = 0) -> None:
    """Steps up to ``to`` without a spike: the hook sees each log step, the manager saves every ``save_every``."""
    for step in range(ctx.step + 1, to + 1):
        ctx.state, ctx.step, ctx.cursor = state_at(base, step), step, step
        ctx.window.values = {"spike": 0.0} if step % log_every == 0 else None
        assert hook.after_step(ctx) is None
        if manager is not None and save_every and step % save_every == 0:
            manager.save(step, ctx.state)


def spike_at(ctx, hook, step: int, onset: int):
    """A hard spike with ``onset`` detected at log step ``step``: the hook's answer."""
    monitor = {**ctx.state.monitor, "hard": torch.tensor(1), "onset": torch.tensor(onset)}
    ctx.state = ctx.state._replace(step=torch.tensor(step), monitor=monitor)
    ctx.step, ctx.cursor, ctx.window.values = step, step, {"spike": 1.0}
    return hook.after_step(ctx)


def test_the_default_ring_holds_at_most_one_state_copy(tmp_path, monkeypatch):
    """With the defaults the ring never holds more than one copy, not even while it copies (the old one is
    freed first), and renews it every 2 * rollback_back steps at a settled log step."""
    spike = SpikeConfig()
    assert spike.snapshots == 1 and rollback.ring_gap(spike) == 2 * spike.rollback_back
    held_while_copying, taken = [], []

    def counting_copy(state):
        held_while_copying.append(len(hook.ring.snaps))
        taken.append(int(state.step))
        return real_copy(state)
    base, ctx, hook = hook_and_context(tmp_path, spike)
    assert hook.ring.steps() == [0]                         # the session's starting state
    real_copy = rollback.state_copy
    monkeypatch.setattr(rollback, "state_copy", counting_copy)
    most = 0
    for end in range(10, 1001, 10):
        advance(ctx, hook, base, end, log_every=10)
        most = max(most, len(hook.ring.snaps))
    assert most == 1 and max(held_while_copying) == 0
    assert taken == list(range(200, 1001, 200))


def test_the_ring_does_not_copy_a_state_inside_a_suspect_streak(tmp_path):
    """The one copy would be lost to a state after the onset: a due copy waits for a settled detector."""
    base, ctx, hook = hook_and_context(tmp_path, SpikeConfig(snapshot_every=10, rollback_back=10))
    advance(ctx, hook, base, 15)
    streak = {**base.monitor, "streak": torch.tensor(1)}
    ctx.state, ctx.step, ctx.window.values = state_at(base, 20)._replace(monitor=streak), 20, {"spike": 0.0}
    hook.after_step(ctx)
    assert hook.ring.steps() == [0]
    advance(ctx, hook, base, 25)
    assert hook.ring.steps() == [25]


def test_a_rollback_past_the_rings_reach_restores_the_checkpoint(tmp_path, capsys):
    """One copy (step 140) is too recent for an onset at 145 with rollback_back=10: the newest checkpoint at or
    before step 135 (120) is restored, exactly, and the log line and event name it."""
    spike = SpikeConfig(snapshot_every=10, rollback_back=10, skip_ahead=20)
    manager = ckpt.CheckpointManager(tmp_path / "run", keep_last=3)
    base, ctx, hook = hook_and_context(tmp_path, spike, manager)
    advance(ctx, hook, base, 149, manager=manager, save_every=30)
    assert hook.ring.steps() == [140]
    jump = spike_at(ctx, hook, 150, onset=145)
    assert isinstance(jump, Jump) and jump.step == 120 and jump.cursor == 150 + 20
    path = tmp_path / "run" / "step_000000120.msgpack"
    saved = ckpt.load(path, template=base)["state"]
    assert max_abs_diff(jump.state.params, saved.params) == 0
    assert max_abs_diff(jump.state.opt_state, saved.opt_state) == 0
    assert f"rolled back to step 120 from checkpoint {path}" in capsys.readouterr().err
    event = json.loads((tmp_path / "log" / "metrics.jsonl").read_text().splitlines()[-1])
    assert event["event"] == "rollback" and event["source"] == "checkpoint" and event["checkpoint"] == str(path)
    assert hook.ring.steps() == []   # the copy at 140 is in the history the run left


def test_within_reach_the_ring_is_used_and_checkpoints_of_the_left_history_never_are(tmp_path, capsys):
    spike = SpikeConfig(snapshot_every=10, rollback_back=10)
    manager = ckpt.CheckpointManager(tmp_path / "run", keep_last=0)
    base, ctx, hook = hook_and_context(tmp_path, spike, manager)
    advance(ctx, hook, base, 154, manager=manager, save_every=30)
    jump = spike_at(ctx, hook, 155, onset=150)             # the copy at 140 is 10 steps before the onset
    assert jump.step == 140 and "rolled back to step 140 from the in-memory snapshot" in capsys.readouterr().err
    # step_000000150 was written in the history the run left: a later rollback must not restore it
    ctx.apply(jump)
    advance(ctx, hook, base, 164)                           # no saves; the ring renews its copy at 160
    assert hook.ring.steps() == [160]
    jump = spike_at(ctx, hook, 165, onset=161)
    assert jump.step == 120 and "from checkpoint" in capsys.readouterr().err
    manager.save(150, state_at(base, 150))                  # rewritten on this history: usable again
    assert (150, manager.folder / "step_000000150.msgpack") in hook.candidates(161)


def test_a_one_snapshot_run_rolls_back_to_its_checkpoint_end_to_end(corpus, token_cache, tmp_path, monkeypatch,
                                                                    capsys):
    """bin/run with one snapshot: garbage batches from step 145, the copy (step 140) is too recent for
    rollback_back=10, so the run restores step_000000120.msgpack: the state it continues from is that file's."""
    restored = []
    real = rollback.Rollback.restore

    def recording(self, onset, template, device):
        found = real(self, onset, template, device)
        if found is not None and found[2] is not None:
            # a copy: the run's donating train step goes on to write into the restored state
            restored.append((found[0], clone(found[1]), ckpt.load(found[2], template=template)["state"], found[2]))
        return found
    monkeypatch.setattr(rollback.Rollback, "restore", recording)
    out = tmp_path / "run"
    assert main(["recipe=standard", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "block_size=32",
                 "batch_size=8", "compile=false", "sample_tokens=0", "eval_batches=2", "log_every=5", "lr=1e-2",
                 "spike.warmup=20", "spike.ema=0.95", "spike.snapshots=1", "spike.snapshot_every=10",
                 "spike.rollback_back=10", "spike.skip_ahead=20", "save_every=30", "steps=170", "eval_every=0",
                 "fault.inject_spike_at=145", "fault.spike_length=20", f"data={corpus}", f"out={out}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rollbacks = [r for r in rows if r.get("event") == "rollback"]
    path = out / "step_000000120.msgpack"
    assert 135 < rollbacks[0]["onset"] <= 145 and rollbacks[0]["to_step"] == 120   # the copy at 140 is too recent
    assert rollbacks[0]["source"] == "checkpoint" and rollbacks[0]["checkpoint"] == str(path)
    assert f"rolled back to step 120 from checkpoint {path}" in capsys.readouterr().err
    step, state, saved, used = restored[0]
    assert step == 120 and used == path
    assert max_abs_diff(state.params, saved.params) == 0 and int(state.cursor) == int(saved.cursor)


def test_pruning_keeps_the_checkpoint_a_rollback_may_need(tmp_path):
    manager = ckpt.CheckpointManager(tmp_path, keep_last=2, keep_back=100)
    state = {"w": torch.zeros(2)}
    for step in range(50, 301, 50):
        manager.save(step, state)
    assert [s for s, _ in manager.step_files()] == [200, 250, 300]   # 200: the newest at or before 300 - 100
    assert manager.pruned == [50, 100, 150]


def test_the_log_says_when_the_checkpoint_to_use_was_pruned(tmp_path, capsys):
    """keep_last=1 with saves every 20: at step 140 the manager spares 120 (the newest at or before 130) and
    drops 100, the one an onset at 125 needed; the rollback uses the oldest state left and says why."""
    spike = SpikeConfig(snapshot_every=10, rollback_back=10)
    manager = ckpt.CheckpointManager(tmp_path / "run", keep_last=1)
    base, ctx, hook = hook_and_context(tmp_path, spike, manager)
    advance(ctx, hook, base, 144, manager=manager, save_every=20)
    assert 100 in manager.pruned
    jump = spike_at(ctx, hook, 145, onset=125)
    err = capsys.readouterr().err
    assert jump.step == 120 and "checkpoint step 100" in err and "keep_last=1" in err, err


@pytest.mark.parametrize("snapshots", [2, 3])
def test_two_or_more_copies_always_reach_rollback_back(tmp_path, snapshots):
    spike = SpikeConfig(snapshot_every=10, rollback_back=30, snapshots=snapshots)
    base, ctx, hook = hook_and_context(tmp_path, spike)
    for end in range(5, 400, 5):
        advance(ctx, hook, base, end)
        assert len(hook.ring.snaps) <= snapshots
        if end >= spike.rollback_back:
            assert min(hook.ring.steps()) <= end + 1 - spike.rollback_back   # an onset at the next step


def test_a_cleared_detector_compiles_no_new_step():
    """A rollback clears the detector's flags (``core.spike.clear``) into tensors of their own: one zero shared by
    three leaves is an input dynamo's guards see as duplicated, so the compiled step compiled a second graph after
    every run's first rollback (the default path's diverging run)."""
    monitor = init_state(llama.init(CFG, seed=0), optim.adamw(lr=1e-3), spike=True).monitor
    step = torch.compile(lambda m: {k: v + 1 for k, v in m.items()}, fullgraph=True, backend="eager")
    step(monitor)
    before = compile_count()
    step(clear(step(monitor)))
    assert compile_count() == before
