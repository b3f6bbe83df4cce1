"""Keys changed on resume: applied and said, or refused by name (recipes/train/changes.py)."""
import pytest
import torch

import optim
from core.config import ConfigError, to_dict
from core.state import init_state
from recipes.standard import Config
from recipes.train import changes


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
