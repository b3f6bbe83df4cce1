"""The ``orchestrator.*`` keys (``recipes/orchestrator/driver.py`` says what they do). A training config opts in by
declaring the section (:func:`orchestrator_option`: standard, distill, upcycle's global phase); the shared trainer
(``recipes/train/``) never names it: it sees the layer through ``TrainConfig.run_hooks``, which asks each section
for its :meth:`OrchestratorConfig.run_hook`.
"""
from __future__ import annotations

from dataclasses import dataclass

from purestep.core.config import ConfigError, option
from purestep.recipes.orchestrator.driver import OrchestratorRunHook
from purestep.recipes.orchestrator.strategies import NAMES
from purestep.optim.swats import SCOPES


@dataclass
class NowcastConfig:
    enabled: bool = option(False, "periodically jump the weights along their fitted trajectory (kept only "
                                  "if the held-out probe loss improves)")
    interval: int = option(100, "steps between nowcast attempts", min=1)
    window: int = option(5, "snapshots in the least-squares line of every weight", min=2)
    stride: int = option(10, "steps between two snapshots", min=1)
    horizon: int = option(20, "steps ahead to extrapolate", min=1)


@dataclass
class OrchestratorConfig:
    enabled: bool = option(False, "choose the training strategy on the fly: branch, compare on a held-out "
                                  "probe, keep the winner (needs spike.enabled for its safety rollback)")
    initial: str = option("adamw", "strategy to start with (adamw: the run's own optimizer)", choices=NAMES)
    portfolio: str = option(",".join(NAMES), "comma-separated strategies the bandit chooses from")
    safety_strategy: str = option("conservative_adamw", "strategy after a rollback", choices=NAMES)
    decision_interval: int = option(500, "steps between periodic decisions (doubled, up to max_backoff x, "
                                         "each time the current strategy wins)", min=1)
    max_backoff: int = option(8, "cap of the decision interval's doubling, as a multiple of decision_interval", min=1)
    min_gap: int = option(50, "fewest steps between two decisions (spike and plateau triggers)", min=0)
    eval_horizon: int = option(25, "steps each candidate trains in a decision (the winner's are kept)", min=1)
    candidates: int = option(2, "strategies compared per decision, the current one included", min=1)
    switch_margin: float = option(0.01, "a challenger replaces the current strategy only if its probe loss is "
                                         "lower by this fraction", min=0, below=1)
    probe_batches: int = option(4, "held-out validation batches that score the candidates", min=1)
    max_loss_increase: float = option(1.5, "safety: a loss above this x its EMA (or non-finite) rolls back", above=1)
    spike_z: float = option(3.0, "a step is a soft spike when the step's loss or grad-norm z-score exceeds this",
                            above=0)
    spike_trigger: int = option(3, "soft spikes within window that make the phase unstable and call a decision", min=1)
    window: int = option(100, "steps of loss history for the slope, the plateau test and the spike count", min=1)
    plateau_tol: float = option(0.002, "plateau: the fitted loss decrease over window is below this fraction", min=0)
    ucb_gamma: float = option(0.9, "discount of the bandit statistics per decision (Garivier & Moulines)",
                              above=0, max=1)
    ucb_xi: float = option(0.6, "exploration constant xi of discounted UCB", min=0)
    swats_eps: float = option(1e-5, "SWATS switches when abs(Lambda - gamma) is below this (paper: 1e-9, which rarely fires)",
                              min=0)
    swats_scope: str = option("global", "SWATS switches the model at once or each tensor on its own",
                              choices=SCOPES)
    nowcast: NowcastConfig = option(NowcastConfig, "weight nowcasting (Jang et al. 2023)")

    def __post_init__(self):
        names = self.arms
        bad = [n for n in names if n not in NAMES]
        if bad or not names:
            raise ConfigError(f"orchestrator.portfolio={self.portfolio!r}: unknown strategies {bad}; "
                              f"choose from {', '.join(NAMES)}")
        for key in ("initial", "safety_strategy"):
            if getattr(self, key) not in names:
                raise ConfigError(f"orchestrator.{key}={getattr(self, key)} is not in orchestrator.portfolio")
        if not 1 <= self.candidates <= len(names):
            raise ConfigError(f"orchestrator.candidates={self.candidates} must be in 1..{len(names)} "
                              f"(the portfolio's size)")
        for key in ("decision_interval", "eval_horizon", "probe_batches", "window", "max_backoff"):
            if getattr(self, key) < 1:
                raise ConfigError(f"orchestrator.{key}={getattr(self, key)} must be >= 1")
        if not 0 < self.ucb_gamma <= 1:
            raise ConfigError(f"orchestrator.ucb_gamma={self.ucb_gamma} must be in (0, 1]")
        n = self.nowcast
        if n.enabled and (n.window < 2 or n.stride < 1 or n.interval < 1 or n.horizon < 1):
            raise ConfigError("orchestrator.nowcast needs window >= 2 and stride, interval, horizon >= 1")

    @property
    def arms(self) -> tuple:
        return tuple(n.strip() for n in self.portfolio.split(",") if n.strip())

    def run_hook(self, cfg) -> OrchestratorRunHook:
        """What this section adds to a run of ``cfg``, the config that declares it (``TrainConfig.run_hooks``)."""
        return OrchestratorRunHook(cfg)


def orchestrator_option():
    """The ``orchestrator`` section a training config declares to opt into the orchestrator (standard, distill,
    upcycle's global phase): ``orchestrator: OrchestratorConfig = orchestrator_option()``."""
    return option(OrchestratorConfig, "strategy orchestration: speculative branches, bandit selection, safety "
                  "rollback, nowcasting")
