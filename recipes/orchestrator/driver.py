"""Orchestrated training: speculative branches on the same batches, bandit selection, safety, nowcasting.

The strategy layer any training recipe switches on with ``orchestrator.enabled=true``. It lives beside
``recipes/train/loop.py::Loop`` as one of its hooks (``recipes/train/hooks.py``): ``after_step`` once per
step, ``on_rollback`` from its spike rollback, ``state_dict`` in every checkpoint; the math is beside it
(``strategies.py``, ``bandit.py``, ``nowcast.py``) and in ``optim/`` (SWATS). In a functional design a branch is a copy of the state pytree
(here not even a copy: steps are pure, so every branch starts from the very same state object), which
makes the following exact and cheap:

- Decision (every ``decision_interval`` steps, backing off while the current strategy keeps winning, or
  on ``spike_trigger`` soft spikes or a plateau, at least ``min_gap`` apart): the current strategy and
  ``candidates - 1`` challengers picked by discounted UCB (Garivier & Moulines 2011; Auer et al. 2002)
  each train ``eval_horizon`` steps from the same state on the *same* batches (the data cursor is rewound:
  batch ``c`` is ``batches.get(c)``), each at its own learning rate with the schedule continued from the
  current step (``recipes.orchestrator.strategies.transfer``). Each is scored on a held-out probe (fixed validation
  windows, not training data); rewards normalized to [0, 1] update the bandit; the best probe loss wins,
  but a challenger must beat the current strategy by ``switch_margin`` (relative) to replace it, so probe
  noise does not churn strategies; a branch that hard-spiked or broke the safety rule cannot win. Training continues
  from the winner's branch state: its steps are kept, the cursor is past the horizon. If the current
  strategy wins, the result is bitwise what training on without the orchestrator would have produced.
  A decision is deferred rather than let its horizon jump over an evaluation or checkpoint step.
- Safety (PaLM 540B, OPT-175B practice): a non-finite loss, or one above ``max_loss_increase`` x its EMA,
  raises the step's hard-spike flag, so the loop's own rollback machinery (``spike.*``: an in-memory snapshot
  or the run's checkpoints, ``rollback_back``, ``skip_ahead``, ``max_rollbacks`` per ``window``) restores the
  newest state at least ``rollback_back`` steps before the onset and skips the batches; every rollback, whoever detected the
  spike, then switches the restored state to ``safety_strategy``.
- Nowcasting (Jang et al. 2023; opt-in ``nowcast.*``): every ``stride`` steps a snapshot of the weights;
  at the first log step ``interval`` steps after the last attempt, the least-squares line through the last ``window`` snapshots is extrapolated
  ``horizon`` steps; the jump is kept only if the probe loss improves, else the state is left as it was.
  A jump moves the weights, not time: the step, the schedule and the optimizer moments stay as they are;
  the snapshot window starts afresh after a kept jump, a switch or a rollback (snapshots are not
  checkpointed: after a resume the window refills).

Every decision, rollback and nowcast goes to ``orchestrator.jsonl`` in the run folder and to the run's
Logger (``metrics.jsonl`` events and TensorBoard); the orchestrator's state (current strategy, bandit,
telemetry, counters) is saved with every checkpoint (the loop stores :meth:`state_dict` under
``"orchestrator"``), so a resumed run continues with the same strategy and statistics.
Compiled runs (``compile=true``) compile one step function per strategy the first time it is used.
"""
from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from purestep.core.config import ConfigError
from purestep.core.parallel.distributed import SHARDED
from purestep.core.data.text import eval_batches
from purestep.core.io.cache import open_append
from purestep.core.state import TrainState
from purestep.core.tree import clone
from purestep.recipes.orchestrator.bandit import PHASES, DiscountedUCB, Telemetry, normalized_rewards
from purestep.recipes.orchestrator.nowcast import extrapolate
from purestep.recipes.orchestrator.strategies import NAMES, build, strategy_of, strategy_spec, transfer
from purestep.recipes.train.hooks import Hook, Jump, RunHook, StepContext

KEY = "orchestrator"   # its config section, and its state's entry in every checkpoint


class OrchestratorRunHook(RunHook):
    """The orchestrator as the shared trainer sees it before the loop (``recipes.train.hooks.RunHook``): with
    ``orchestrator.enabled`` the run's state is built on the orchestrator's strategy, never donated (branches step
    one state many times), not projected by ``dry_run=true``, and the loop needs the :class:`Orchestrator` hook."""
    fixed_keys = (f"{KEY}.enabled",)

    def __init__(self, cfg):
        self.cfg, self.enabled = cfg, cfg.orchestrator.enabled
        self.loop_key = KEY if self.enabled else None
        self.keeps_states = self.enabled

    def optimizer(self, sharded: bool, resumed: dict):
        """``orchestrator.initial``'s strategy, or, when resuming, the strategy the checkpoint was on (so the
        checkpoint loads into the right template); None when the orchestrator is off. Strategies are not built
        on sharded state (``sharded``: parallel=fsdp is refused with the orchestrator)."""
        if not self.enabled:
            return None
        saved = resumed.get(KEY)
        return build(saved["current"] if saved else self.cfg.orchestrator.initial, strategy_spec(self.cfg))

    def dry_run_refusal(self):
        if not self.enabled:
            return None
        return ("dry_run=true cannot project orchestrator.enabled=true (its branches' cost depends on the bandit's "
                "choices); dry-run without it")

    def check(self) -> None:
        """The run's settings the orchestrator's strategies and safety rollback need."""
        cfg = self.cfg
        if not self.enabled:
            return
        if cfg.parallel in SHARDED:
            raise ConfigError(f"orchestrator.enabled=true with parallel={cfg.parallel}: the orchestrator's strategies "
                              f"are not built on sharded state; use parallel=ddp")
        if cfg.optimizer != "adamw":
            raise ConfigError(f"orchestrator.enabled=true with optimizer={cfg.optimizer}: the orchestrator's "
                              f"strategies are built on AdamW (its adamw strategy is the run's own); use "
                              f"optimizer=adamw")
        if not cfg.spike.enabled:
            raise ConfigError("orchestrator.enabled=true needs spike.enabled=true: its safety rollback is the "
                              "spike machinery's (snapshot ring, rollback_back, max_rollbacks)")


def probe_batches(val_tokens, cfg, device=None):
    """``orchestrator.probe_batches`` fixed validation batches placed halfway between the evaluation
    windows, so the probe that picks strategies is not the validation set that reports them."""
    n_eval = max(cfg.eval_batches, 1) * cfg.batch_size
    shift = max((len(val_tokens) - cfg.block_size - 1) // (2 * n_eval), 0)
    tokens = val_tokens[shift:] if len(val_tokens) - shift > cfg.block_size else val_tokens
    return eval_batches(np.asarray(tokens), cfg.batch_size, cfg.block_size, cfg.orchestrator.probe_batches,
                        device=device)


class Orchestrator(Hook):
    """The training loop's orchestration hook: decisions, safety and nowcasting (module docstring)."""
    key = KEY   # its state in every checkpoint

    def __init__(self, cfg, *, make_step: Callable, batches, probe, eval_step: Callable, logger, folder,
                 saved: Optional[dict] = None, main_process: bool = True):
        o = cfg.orchestrator
        self.cfg, self.o, self.spec = cfg, o, strategy_spec(cfg)   # strategies are relative to the run's optimizer
        self.make_step, self.batches, self.eval_step, self.logger = make_step, batches, eval_step, logger
        self.probe = list(probe)                        # held-out batches, already on the run's device
        self.arms = o.arms
        self.current = o.initial
        self.bandit = DiscountedUCB(self.arms, gamma=o.ucb_gamma, xi=o.ucb_xi)
        self.telemetry = Telemetry(window=o.window, spike_z=o.spike_z, spike_trigger=o.spike_trigger,
                                   plateau_tol=o.plateau_tol)
        self.last_decision, self.interval, self.last_nowcast = 0, o.decision_interval, 0
        self.counters = {"decisions": 0, "switches": 0, "rollbacks": 0, "nowcasts": 0, "nowcasts_accepted": 0}
        self.buffer: list = []
        self.snapshots: deque = deque(maxlen=o.nowcast.window)
        self.records: list = []                         # every decision record of this session (tests read it)
        self._steps: dict = {}
        self.path = Path(folder) / "orchestrator.jsonl" if main_process else None   # rank 0 alone writes
        if saved:
            self.load_state_dict(saved)

    # ------------------------------------------------------------------ wiring
    def step_fn(self, name: str) -> Callable:
        """One train step per strategy, built (and compiled, if the run compiles) once."""
        if name not in self._steps:
            self._steps[name] = self.make_step(build(name, self.spec))
        return self._steps[name]

    def train_step(self, state, batch, frozen=None):
        """The loop's train step: the current strategy's."""
        fn = self.step_fn(self.current)
        return fn(state, batch, frozen)

    def attach(self, steps):
        """``steps`` (``recipes.train.loop.Steps``) whose train step dispatches to the current strategy."""
        return replace(steps, train=self.train_step)

    # ------------------------------------------------------------------ the loop's hooks
    def after_step(self, ctx: StepContext) -> Optional[Jump]:
        """The loop's hook after every step (``recipes.train.hooks``)."""
        return self.observe(ctx.state, ctx.metrics, step=ctx.step, cursor=ctx.cursor, frozen=ctx.run.frozen)

    def observe(self, state: TrainState, metrics: dict, *, step: int, cursor: int, frozen=None) -> Optional[Jump]:
        """Buffers the step's metrics; at the loop's log steps it reads
        them (one host transfer), checks safety, and may nowcast or run a decision. Returns a :class:`Jump`
        when the main state changed. On a safety trigger it sets this step's ``metrics["spike"]`` (and the
        state's detector flag and onset), so the loop's rollback runs at this same log step."""
        self.buffer.append((step, metrics))
        if self.o.nowcast.enabled and step % self.o.nowcast.stride == 0:
            self.snapshots.append((step, clone(state.params)))
        if step % self.cfg.log_every != 0 and step != self.cfg.steps:
            return None
        onset = self._sync()
        if onset is not None:
            return self._flag_safety(state, metrics, step, cursor, onset)
        if self.o.nowcast.enabled and step - self.last_nowcast >= self.o.nowcast.interval \
                and len(self.snapshots) == self.o.nowcast.window:
            jump = self._nowcast(state, step, cursor, frozen)
            if jump is not None:
                return jump
        self.log_telemetry(step)
        trigger = self._trigger(step)
        if trigger is None:
            return None
        return self._decide(state, metrics, step, cursor, trigger, frozen)

    def on_rollback(self, step: int, to_step: int, restored: TrainState) -> TrainState:
        """Called by the loop's rollback with the restored snapshot: continue it with the safety strategy."""
        was = strategy_of(restored.opt_state)
        target = self.o.safety_strategy
        if was != target:
            restored = restored._replace(opt_state=transfer(restored.opt_state, target, self.spec, restored.params))
        self.current = target
        self.counters["rollbacks"] += 1
        self.last_decision, self.interval = to_step, self.o.decision_interval
        self.last_nowcast = min(self.last_nowcast, to_step)
        self.telemetry.losses = deque(x for x in self.telemetry.losses if x[0] <= to_step)
        self.telemetry.spikes = deque(s for s in self.telemetry.spikes if s <= to_step)
        self.snapshots.clear()
        self.buffer.clear()
        self._record(step, "rollback", {"to_step": to_step, "from_strategy": was, "strategy": target})
        return restored

    # ------------------------------------------------------------------ telemetry and safety
    def _rows(self) -> list:
        """The buffered steps as host rows ``[step, loss, grad_norm, z_loss, z_grad]`` (one transfer)."""
        keys = ("loss", "grad_norm", "z_loss", "z_grad")
        live = [m for _, m in self.buffer if isinstance(m, dict)]
        values = iter(torch.stack([torch.stack([m[k].float() for k in keys])
                                   for m in live]).cpu().tolist() if live else [])
        return [[s, *(next(values) if isinstance(m, dict) else m)] for s, m in self.buffer]

    def _sync(self) -> Optional[int]:
        """Feed the buffered steps to the telemetry; the first step that breaks the safety rule, if any."""
        if not self.buffer:
            return None
        rows = self._rows()
        self.buffer.clear()
        steps, rows = [r[0] for r in rows], [r[1:] for r in rows]
        onset = None
        for s, (loss, gn, zl, zg) in zip(steps, rows):
            if onset is None and s > self.cfg.spike.warmup and self.telemetry.exploding(loss, self.o.max_loss_increase):
                onset = s
            self.telemetry.observe(s, loss, gn, zl, zg, detector_warm=s > self.cfg.spike.warmup)
        return onset

    def _flag_safety(self, state, metrics, step, cursor, onset) -> Jump:
        self._record(step, "safety", {"onset": onset, "loss_ema": self.telemetry.loss_ema,
                                       "max_loss_increase": self.o.max_loss_increase, "strategy": self.current})
        one = torch.ones_like(state.monitor["hard"])
        monitor = {**state.monitor, "hard": one, "onset": torch.full_like(state.monitor["onset"], onset)}
        metrics["spike"] = torch.ones_like(metrics["loss"]).float()
        return Jump(state._replace(monitor=monitor), step, cursor, [], 0)

    def _trigger(self, step: int) -> Optional[str]:
        since = step - self.last_decision
        phase = self.telemetry.phase(step, self.cfg.steps, self.cfg.warmup_steps)
        if since >= self.interval:
            return "periodic"
        if since >= self.o.min_gap and phase == "unstable":
            return "spikes"
        if since >= max(self.o.min_gap, self.interval // 2) and phase == "plateau":
            return "plateau"
        return None

    def _clear(self, step: int, horizon: int) -> bool:
        """No evaluation or checkpoint step in [step, step + horizon): the loop handles those before a jump
        could skip them (landing on one is fine: the loop handles it right after the jump)."""
        for every in (self.cfg.eval_every, self.cfg.save_every):
            if every and (step % every == 0 or step // every != (step + horizon - 1) // every):
                return False
        return True

    def probe_loss(self, params, frozen=None) -> float:
        return torch.stack([self.eval_step(params, b, frozen)["loss"].float() for b in self.probe]).mean().item()

    # ------------------------------------------------------------------ decisions
    def _decide(self, state, step_metrics, step, cursor, trigger, frozen) -> Optional[Jump]:
        horizon = min(self.o.eval_horizon, self.cfg.steps - step)
        if horizon < max(1, self.o.eval_horizon // 2) or not self._clear(step, horizon):
            return None                                    # deferred: too close to the end, or to an eval/save
        if "spike" in step_metrics and bool(step_metrics["spike"] > 0):
            return None                                    # a hard spike is pending: the loop rolls back first
        phase = self.telemetry.phase(step, self.cfg.steps, self.cfg.warmup_steps)
        candidates = self.bandit.select(self.o.candidates, self.current)
        before = self.probe_loss(state.params, frozen)
        scores, branch_loss, cursors = {}, {}, {}
        best, incumbent = None, None                       # (probe, name, state, metrics)
        for name in candidates:
            branch = state if name == self.current else \
                state._replace(opt_state=transfer(state.opt_state, name, self.spec, state.params))
            fn, metrics, used = self.step_fn(name), [], []
            for c in range(cursor, cursor + horizon):
                batch = self.batches.get(c)
                branch, m = fn(branch, batch, frozen)
                metrics.append(m)
                used.append(c)
            losses = torch.stack([m["loss"].float() for m in metrics]).cpu()
            hard = bool(metrics[-1]["spike"] > 0) if "spike" in metrics[-1] else False
            exploded = any(self.telemetry.exploding(x, self.o.max_loss_increase) for x in losses.tolist())
            probe = self.probe_loss(branch.params, frozen)
            ok = math.isfinite(probe) and not exploded and not hard
            scores[name] = probe if ok else math.inf
            branch_loss[name] = float(losses.mean())
            cursors[name] = used
            if ok and name == self.current:
                incumbent = (probe, name, branch, metrics)
            elif ok and (best is None or probe < best[0]):
                best = (probe, name, branch, metrics)
            del branch
        rewards = normalized_rewards(scores)
        self.bandit.update(rewards)
        self.counters["decisions"] += 1
        if incumbent is not None and (best is None or best[0] >= incumbent[0] * (1 - self.o.switch_margin)):
            best = incumbent                               # a challenger must win by switch_margin
        if best is None:                                   # every branch diverged: roll back instead
            self.last_decision = step
            record = self._decision_record(step, trigger, phase, candidates, horizon, before, scores, rewards,
                                           branch_loss, cursors, None)
            self._record(step, "decision", record)
            return self._flag_safety(state, step_metrics, step, cursor, step)
        _, winner, new_state, metrics = best
        switched = winner != self.current
        self.counters["switches"] += int(switched)
        self.interval = self.o.decision_interval if switched else \
            min(self.interval * 2, self.o.decision_interval * self.o.max_backoff)
        if switched:
            self.snapshots.clear()
        self.current = winner
        self.last_decision = step + horizon
        record = self._decision_record(step, trigger, phase, candidates, horizon, before, scores, rewards,
                                       branch_loss, cursors, winner)
        self._record(step, "decision", record)
        self.buffer.extend(zip(range(step + 1, step + horizon + 1), metrics))
        self._sync()                                       # the kept steps join the telemetry
        return Jump(new_state, step + horizon, cursor + horizon, metrics, horizon)

    def _decision_record(self, step, trigger, phase, candidates, horizon, before, scores, rewards, branch_loss,
                         cursors, winner) -> dict:
        firsts = {n: (c[0], c[-1]) for n, c in cursors.items()}
        return {"trigger": trigger, "phase": phase, "strategy": candidates[0], "candidates": candidates,
                "horizon": horizon, "cursors": list(next(iter(firsts.values()))), "probe_before": before,
                "scores": scores, "rewards": rewards, "branch_train_loss": branch_loss, "winner": winner,
                "switched": winner is not None and winner != candidates[0],
                "bandit": {a: [self.bandit.counts[a], self.bandit.mean(a)] for a in self.arms},
                "same_batches": all(c == cursors[candidates[0]] for c in cursors.values()),
                "_cursors": cursors}

    # ------------------------------------------------------------------ nowcasting
    def _nowcast(self, state, step, cursor, frozen) -> Optional[Jump]:
        n = self.o.nowcast
        self.last_nowcast = step
        steps = [s for s, _ in self.snapshots]
        predicted = extrapolate(steps, [p for _, p in self.snapshots], n.horizon)
        before = self.probe_loss(state.params, frozen)
        after = self.probe_loss(predicted, frozen)
        accepted = math.isfinite(after) and after < before
        self.counters["nowcasts"] += 1
        self.counters["nowcasts_accepted"] += int(accepted)
        rate = self.counters["nowcasts_accepted"] / self.counters["nowcasts"]
        self._record(step, "nowcast", {"accepted": accepted, "probe_before": before, "probe_after": after,
                                        "horizon": n.horizon, "snapshot_steps": steps, "acceptance_rate": rate})
        self.logger.scalars(step, {"orchestrator/nowcast_acceptance": rate,
                                   "orchestrator/nowcast_gain": before - after if accepted else 0.0})
        if not accepted:
            return None                                    # the state is untouched: nothing to restore
        self.snapshots.clear()                             # the trajectory jumped: start a new line
        return Jump(state._replace(params=predicted), step, cursor, [], 0)

    # ------------------------------------------------------------------ logging and checkpoints
    def _record(self, step: int, kind: str, fields: dict) -> None:
        row = _clean({"step": int(step), "kind": kind, **fields})
        cursors = row.pop("_cursors", None)
        if kind == "decision":
            self.records.append({**row, "cursors_by_candidate": cursors})
        if self.path is not None:
            with open_append(self.path) as f:
                f.write(json.dumps(row) + "\n")
        self.logger.event(step, f"orchestrator_{kind}", **{k: v for k, v in row.items() if k not in ("step", "kind")})
        scalars = {"orchestrator/strategy": NAMES.index(self.current), **{f"orchestrator/{k}": v for k, v in
                   self.counters.items()}}
        if kind == "decision":
            phase = row["phase"]
            scalars.update({"orchestrator/phase": PHASES.index(phase), "orchestrator/probe_before": row["probe_before"]})
            scalars.update({f"orchestrator/score/{a}": s for a, s in row["scores"].items() if s is not None})
        self.logger.scalars(step, scalars)
        if kind in ("decision", "rollback") and (kind == "rollback" or row["switched"]):
            self.logger.print(f"orchestrator: step {step}: {kind} -> {self.current}"
                              + (f" (probe losses {', '.join(f'{a} {s:.4f}' if s is not None else f'{a} diverged' for a, s in row['scores'].items())})"
                                 if kind == "decision" else ""))

    def log_telemetry(self, step: int) -> None:
        """Telemetry scalars (slope, soft spikes, phase, strategy) at a log step. SWATS's switch step and
        estimated SGD lr come with the step's own metrics (``optim.swats``)."""
        self.logger.scalars(step, {
            "orchestrator/loss_slope": self.telemetry.slope(), "orchestrator/soft_spikes": len(self.telemetry.spikes),
            "orchestrator/phase": PHASES.index(self.telemetry.phase(step, self.cfg.steps, self.cfg.warmup_steps)),
            "orchestrator/strategy": NAMES.index(self.current)})

    def state_dict(self) -> dict:
        return {"current": self.current, "bandit": self.bandit.state_dict(), "telemetry": self.telemetry.state_dict(),
                "last_decision": self.last_decision, "interval": self.interval, "last_nowcast": self.last_nowcast,
                "counters": dict(self.counters),
                "unread": self._rows() if self.buffer else []}   # steps since the last log step (exact resume)

    def load_state_dict(self, d: dict) -> None:
        if d["current"] not in self.arms:
            raise ValueError(f"the checkpoint's strategy {d['current']!r} is not in orchestrator.portfolio")
        self.current = d["current"]
        self.bandit.load_state_dict(d["bandit"])
        self.telemetry.load_state_dict(d["telemetry"])
        self.last_decision, self.interval = int(d["last_decision"]), int(d["interval"])
        self.last_nowcast = int(d.get("last_nowcast", 0))
        self.counters.update({k: int(v) for k, v in d["counters"].items()})
        self.buffer = [(int(r[0]), [float(x) for x in r[1:]]) for r in d.get("unread", [])]


def orchestrate(cfg, steps, *, make_step: Callable, val_tokens, device, logger, folder,
                resumed: Optional[dict] = None, eval_step: Optional[Callable] = None, main_process: bool = True):
    """``(orchestrator, steps)`` for ``recipes.train.loop.Loop``: ``(None, steps)`` unless ``cfg.orchestrator.enabled``,
    else an :class:`Orchestrator` (resuming its entry in ``resumed``, the top level of the checkpoint the run
    resumes: ``recipes.train.setup.RunSetup.resumed``) and ``steps`` whose train step is the current
    strategy's. ``make_step(optimizer)`` builds the recipe's train step for a strategy; the probe is
    ``orchestrator.probe_batches`` windows of ``val_tokens`` on ``device``, scored by ``eval_step`` (default
    ``steps.eval``)."""
    if not cfg.orchestrator.enabled:
        return None, steps
    orchestrator = Orchestrator(cfg, make_step=make_step, batches=steps.batches,
                                probe=probe_batches(val_tokens, cfg, device),
                                eval_step=eval_step or steps.eval, logger=logger, folder=folder,
                                saved=(resumed or {}).get(KEY),
                                main_process=main_process)
    return orchestrator, orchestrator.attach(steps)


def _clean(v):
    """JSON-ready: nested containers kept, non-finite floats -> None (strict JSON, like the Logger)."""
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
