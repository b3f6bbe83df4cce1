"""Keys changed on resume: applied and said, or refused by name (recipes/train/changes.py)."""
import pytest
import torch

from purestep import optim
from purestep.core.config import ConfigError, to_dict
from purestep.core.state import init_state
from purestep.recipes.standard import Config
from purestep.recipes.train import changes


def test_changed_keys_are_found_and_the_fixed_ones_refused():
    saved = to_dict(Config(steps=40))
    new = Config(steps=60, lr=0.3, out="elsewhere", compile=False)
    diff = changes.changes(saved, new)
    assert diff == {"steps": (40, 60), "lr": (0.001, 0.3)}        # out/compile say where, not what
    changes.check(diff)
    assert changes.describe(diff, 40) == "steps 40 -> 60, lr 0.001 -> 0.3 from step 40"
    with pytest.raises(ConfigError, match=r"tokenizer \(byte -> char\), model.d_model \(128 -> 64\)"):
        changes.check(changes.changes(saved, Config(tokenizer="char", model={"d_model": 64})))


def test_new_hyperparameters_replace_only_what_the_change_touched():
    params = {"w": torch.randn(3, 4, generator=torch.Generator().manual_seed(0))}
    old, new = (optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=lr, b1=0.9, weight_decay=0.1))
                for lr in (1e-3, 0.3))
    state = init_state(params, old)
    grads = {"w": torch.ones(3, 4)}
    for _ in range(3):
        updates, opt_state = old.update(grads, state.opt_state, state.params)
        state = state._replace(opt_state=opt_state, params=optim.apply_updates(state.params, updates))
    scaled = optim.scale_lr(state.opt_state, 0.5)                    # a rollback's lr_factor, kept unless lr changes
    applied = changes.apply_hyperparameters(scaled, old.init(params), new.init(params))
    assert float(optim.base_lr(applied)) == pytest.approx(0.3)
    kept = changes.apply_hyperparameters(scaled, old.init(params), old.init(params))
    assert float(optim.base_lr(kept)) == pytest.approx(0.5e-3)
    for a, b in zip(torch.utils._pytree.tree_leaves(applied), torch.utils._pytree.tree_leaves(scaled)):
        if a.dim() > 0:
            assert torch.equal(a, b)                                 # moments untouched
    with pytest.raises(ConfigError, match="layout"):
        changes.apply_hyperparameters(scaled, old.init(params), optim.sgd(lr=0.1).init(params))


def test_a_resumed_run_takes_the_new_lr_and_says_so(tmp_path, corpus, token_cache, capsys):
    """The issue's case: 40 steps, then the same out= with lr=0.3 and a constant schedule continued at the
    checkpoint's lr 0.001 without a word. Now the new lr is in the state from step 40 and the log says so;
    a changed model is refused by name before anything is written."""
    from purestep.core.io import checkpoint as ckpt
    from purestep.recipes import main
    args = ["recipe=standard", "preset=tiny", "compile=false", "sample_tokens=0", "eval_batches=1", f"data={corpus}",
            "tokenizer=char", "spike.enabled=false", f"out={tmp_path}"]
    assert main([*args, "steps=40"]) == 0
    capsys.readouterr()
    assert main([*args, "steps=60", "lr=0.3", "lr_schedule=constant", "warmup_steps=0"]) == 0
    err = capsys.readouterr().err
    assert "changed keys: steps 40 -> 60, lr 0.001 -> 0.3, warmup_steps 30 -> 0, lr_schedule cosine -> constant " \
           "from step 40" in err, err
    assert ckpt.read_meta(tmp_path / "final.msgpack")["step"] == 60
    assert "| lr 0.3" in err                                         # the progress line's lr, read from the state
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main([*args, "steps=80", "model.d_model=32"]) == 2
    assert "model.d_model (64 -> 32)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
