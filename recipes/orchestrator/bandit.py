"""The orchestrator's math: training telemetry, phase classification, and a discounted-UCB bandit.

Everything here is small host-side arithmetic on numbers the loop already pulls from the step's metrics
(the loss, the gradient norm, and the z-scores of the step's own EMA spike detector, ``core.spike``);
the branching driver that uses it is ``recipes/orchestrator/driver.py``.

- Telemetry: soft spikes are steps whose loss or gradient-norm z-score (from the step's detector, i.e.
  pre-update EMA statistics) exceeds ``spike_z``; the loss slope is the least-squares
  slope over the last ``window`` losses; a host EMA of the loss is the baseline for the safety check
  ``loss > max_loss_increase * EMA`` (not updated by flagged steps, so a spike does not raise its own bar).
- Phase, checked in order: ``unstable`` (``spike_trigger`` soft spikes in the window), ``warmup`` (inside the
  run's LR warm-up), ``plateau`` (the fitted loss decrease over the window is below ``plateau_tol`` of the
  mean loss: scale-free, unlike an absolute slope threshold), else
  ``early``/``mid``/``late`` by progress (< 10%, > 70%).
- Bandit: discounted UCB (Garivier & Moulines 2011, "On Upper-Confidence Bound Policies for Switching
  Bandit Problems"), the non-stationary form of UCB1 (Auer, Cesa-Bianchi & Fischer 2002): per arm a
  discounted pull count ``N_i`` and reward sum ``S_i``; index ``S_i / N_i + 2B sqrt(xi ln(n) / N_i)``
  with ``n = sum N_i``, ``B = 1`` (rewards are normalized to [0, 1]), never-pulled arms first. One decision
  is one round: all arms are discounted by ``gamma`` once, then every evaluated arm adds its reward.
- Rewards: a decision's candidates are scored by held-out probe loss; ``normalized_rewards`` maps them
  to [0, 1] by min-max within the decision (best 1, worst 0; diverged candidates 0), so rewards have no
  unit and the exploration bonus has a meaning.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

PHASES = ("warmup", "early", "mid", "late", "plateau", "unstable")


@dataclass
class Telemetry:
    window: int = 50
    spike_z: float = 3.0
    spike_trigger: int = 3
    plateau_tol: float = 0.01
    ema: float = 0.98
    losses: deque = field(default_factory=deque)      # (step, loss) of the last `window` finite steps
    spikes: deque = field(default_factory=deque)      # steps of soft spikes within the window
    loss_ema: float = math.nan
    nonfinite: int = 0

    def observe(self, step: int, loss: float, grad_norm: float, z_loss: float, z_grad: float,
                detector_warm: bool) -> None:
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        spike = not finite or (detector_warm and (z_loss > self.spike_z or z_grad > self.spike_z))
        if not finite:
            self.nonfinite += 1
        if spike:
            self.spikes.append(step)
        else:
            self.loss_ema = loss if math.isnan(self.loss_ema) else self.ema * self.loss_ema + (1 - self.ema) * loss
        if finite:
            self.losses.append((step, loss))
        while self.losses and self.losses[0][0] <= step - self.window:
            self.losses.popleft()
        while self.spikes and self.spikes[0] <= step - self.window:
            self.spikes.popleft()

    def exploding(self, loss: float, max_loss_increase: float) -> bool:
        """Safety: a non-finite loss, or one above ``max_loss_increase`` x the EMA."""
        if not math.isfinite(loss):
            return True
        return math.isfinite(self.loss_ema) and loss > max_loss_increase * self.loss_ema

    def slope(self) -> float:
        """Least-squares slope of loss against step over the window (0 with fewer than 5 points)."""
        if len(self.losses) < 5:
            return 0.0
        n = len(self.losses)
        ts = [s for s, _ in self.losses]
        ys = [y for _, y in self.losses]
        tm, ym = sum(ts) / n, sum(ys) / n
        var = sum((t - tm) ** 2 for t in ts)
        return sum((t - tm) * (y - ym) for t, y in zip(ts, ys)) / var if var > 0 else 0.0

    def relative_decrease(self) -> float:
        """The fitted loss decrease over one window, as a fraction of the mean loss."""
        if len(self.losses) < 5:
            return math.inf
        mean = sum(y for _, y in self.losses) / len(self.losses)
        return -self.slope() * self.window / max(abs(mean), 1e-12)

    def phase(self, step: int, total: int, warmup: int) -> str:
        if len(self.spikes) >= self.spike_trigger:
            return "unstable"
        if step <= warmup:
            return "warmup"
        progress = step / max(total, 1)
        if len(self.losses) >= self.window // 2 and progress >= 0.1 and self.relative_decrease() < self.plateau_tol:
            return "plateau"
        return "early" if progress < 0.1 else "late" if progress > 0.7 else "mid"

    def state_dict(self) -> dict:
        return {"losses": [list(x) for x in self.losses], "spikes": list(self.spikes),
                "loss_ema": None if math.isnan(self.loss_ema) else self.loss_ema, "nonfinite": self.nonfinite}

    def load_state_dict(self, d: dict) -> None:
        self.losses = deque((int(s), float(y)) for s, y in d["losses"])
        self.spikes = deque(int(s) for s in d["spikes"])
        self.loss_ema = math.nan if d["loss_ema"] is None else float(d["loss_ema"])
        self.nonfinite = int(d["nonfinite"])


@dataclass
class DiscountedUCB:
    arms: tuple
    gamma: float = 0.9
    xi: float = 0.6
    counts: dict = field(default_factory=dict)    # arm -> discounted pulls N_i
    sums: dict = field(default_factory=dict)      # arm -> discounted reward sum S_i

    def __post_init__(self):
        for a in self.arms:
            self.counts.setdefault(a, 0.0)
            self.sums.setdefault(a, 0.0)

    def mean(self, arm) -> float:
        return self.sums[arm] / self.counts[arm] if self.counts[arm] > 0 else math.nan

    def index(self, arm) -> float:
        if self.counts[arm] <= 0:
            return math.inf
        n = sum(self.counts.values())
        return self.mean(arm) + 2.0 * math.sqrt(self.xi * math.log(max(n, 1.0)) / self.counts[arm])

    def select(self, k: int, include) -> list:
        """``include`` plus the ``k - 1`` other arms with the highest index (ties: portfolio order)."""
        others = sorted((a for a in self.arms if a != include), key=lambda a: -self.index(a))
        return [include] + others[:max(k - 1, 0)]

    def update(self, rewards: dict) -> None:
        for a in self.arms:
            self.counts[a] *= self.gamma
            self.sums[a] *= self.gamma
        for a, r in rewards.items():
            self.counts[a] += 1.0
            self.sums[a] += float(r)

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts), "sums": dict(self.sums)}

    def load_state_dict(self, d: dict) -> None:
        self.counts.update({a: float(v) for a, v in d["counts"].items() if a in self.counts})
        self.sums.update({a: float(v) for a, v in d["sums"].items() if a in self.sums})


def normalized_rewards(scores: dict) -> dict:
    """Probe losses -> rewards in [0, 1]: min-max within the decision (lowest loss 1); non-finite -> 0;
    all equal -> 0.5 each."""
    finite = {a: s for a, s in scores.items() if math.isfinite(s)}
    out = {a: 0.0 for a in scores}
    if not finite:
        return out
    lo, hi = min(finite.values()), max(finite.values())
    for a, s in finite.items():
        out[a] = 0.5 if hi - lo <= 1e-12 * max(abs(hi), 1.0) else (hi - s) / (hi - lo)
    return out
