"""The shared trainer (``recipes/train/``) knows layers such as the orchestrator only through the generic run-hook
protocol (``recipes.train.hooks.RunHook``): it imports nothing of ``recipes/orchestrator/`` and never names it,
the orchestrator's checks keep their messages, and a run hook's optimizer is the one a run is built, resumed
and changed with."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, replace

import pytest
import torch

from purestep.core.io import checkpoint as ckpt
from purestep.core.config import ConfigError, UserError, to_dict
from purestep.models import llama
from purestep.optim.base import find_state
from purestep.optim.common import LearningRateState
from purestep.recipes.orchestrator.config import OrchestratorConfig
from purestep.recipes.orchestrator.strategies import strategy_of
from purestep.recipes.standard import Config
from purestep.recipes.train import plan, setup
from purestep.recipes.train.config import TrainConfig
from purestep.recipes.train.hooks import RunHook
from purestep.recipes.train.loop import Loop, Steps
from purestep.recipes.train.optimizer import OptimizerSpec, make_optimizer
from tests.test_layout import REPO, import_graph

CPU = torch.device("cpu")
TINY = llama.LlamaConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2)


def test_the_trainer_imports_and_names_nothing_of_the_orchestrator():
    graph = import_graph()
    reached, todo = set(), [m for m in graph if m == "purestep.recipes.train" or m.startswith("recipes.train.")]
    while todo:                                   # everything recipes/train imports, directly or through others
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph[module]
    assert sorted(m for m in reached if m.startswith("purestep.recipes.orchestrator")) == []
    named = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "recipes" / "train").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search("orchestrat", line, re.I)]
    assert named == []                            # not in code, strings, comments or docstrings either


@pytest.mark.parametrize("keys, message", [
    ({"parallel": "fsdp"}, "orchestrator.enabled=true with parallel=fsdp: the orchestrator's strategies are not "
                           "built on sharded state; use parallel=ddp"),
    ({"spike": dataclasses.replace(Config().spike, enabled=False)},
     "orchestrator.enabled=true needs spike.enabled=true: its safety rollback is the spike machinery's (snapshot "
     "ring, rollback_back, max_rollbacks)"),
])
def test_the_orchestrators_checks_keep_their_messages(keys, message):
    with pytest.raises(ConfigError) as e:
        Config(orchestrator=OrchestratorConfig(enabled=True), **keys)
    assert str(e.value) == message
    with pytest.raises(UserError, match=re.escape("dry_run=true cannot project orchestrator.enabled=true (its "
                                                  "branches' cost depends on the bandit's choices)")):
        plan.probe_config(Config(orchestrator=OrchestratorConfig(enabled=True)))


class Layer(RunHook):
    """A made-up layer: it supplies the optimizer, keeps states, refuses dry runs and needs its loop hook."""
    fixed_keys = ("beta1",)
    loop_key = "layer"
    keeps_states = True

    def __init__(self):
        self.supplied = make_optimizer(OptimizerSpec(lr=0.5))

    def optimizer(self, sharded, resumed):
        return self.supplied

    def dry_run_refusal(self):
        return "the layer cannot be projected"


@dataclass
class Layered(TrainConfig):
    def run_hooks(self) -> tuple:
        return (Layer(),)


def test_the_trainer_asks_a_run_hook_and_never_ignores_it(tmp_path):
    cfg = Layered(compile=False, out=str(tmp_path))
    run = setup.start(cfg, None, llama.init(TINY, seed=0), device=CPU)
    assert float(find_state(run.state.opt_state, LearningRateState).lr) == 0.5   # the hook's optimizer, not lr=1e-3
    with pytest.raises(UserError, match="the layer cannot be projected"):
        plan.probe_config(cfg)
    steps = Steps(train=None, eval=None, health=None, batches=None)
    with pytest.raises(UserError, match="'layer' hook"):
        Loop(cfg, run.state, steps, logger=None)
    manager = ckpt.CheckpointManager(tmp_path, keep_last=1, save_every=0)
    manager.save(1, run.state, extra={"train": to_dict(cfg)})
    with pytest.raises(ConfigError, match="beta1"):                             # the hook's fixed key
        setup.start(replace(cfg, beta1=0.5), tmp_path, llama.init(TINY, seed=0), device=CPU)


def test_an_orchestrated_run_resumes_on_its_strategy_with_changed_hyperparameters(tmp_path):
    """The checkpoint's strategy (lion) is the template a resume loads into, and a changed ``lr`` reaches its
    state: the checkpoint's config builds the same strategy to compare with."""
    cfg = Config(compile=False, out=str(tmp_path), lr=1e-3, orchestrator=OrchestratorConfig(enabled=True,
                                                                                          initial="lion"))
    first = setup.start(cfg, tmp_path, llama.init(TINY, seed=0), device=CPU)
    assert strategy_of(first.state.opt_state) == "lion" and first.resumed == {}
    saved = {"current": "lion", "counters": {"decisions": 3}}
    ckpt.CheckpointManager(tmp_path, keep_last=1, save_every=0).save(
        2, first.state, extra={"train": to_dict(cfg), "orchestrator": saved})
    again = setup.start(replace(cfg, lr=2e-3), tmp_path, llama.init(TINY, seed=1), device=CPU)
    assert again.resume is not None and again.resumed["orchestrator"] == saved
    assert strategy_of(again.state.opt_state) == "lion" and "lr 0.001 -> 0.002" in again.changed
    assert float(find_state(again.state.opt_state, LearningRateState).lr) == pytest.approx(2e-3 * 0.1)
    assert torch.equal(again.state.params["embed"], first.state.params["embed"])  # the checkpoint's, not seed 1's
