"""The upcycle recipe's blockwise phase: every student block trained to reproduce its teacher block, all at once.

Block-wise distillation: LoLCATs' attention transfer (Zhang et al., ICLR 2025) and
MOHAWK's hidden-state alignment (Bick et al. 2024), on MHA2MLA-style partial-RoPE students (Ji et al. 2025). The
math (teacher block I/O, student blocks, per-block losses) is ``models/blockwise.py``; this file is the phase:

- **One step trains every block.** The per-block losses are independent (teacher-forced inputs, or the student's
  own stream detached), so one backward of their sum gives each block its own gradient.
- **Per-block convergence** on a smoothed criterion, never a single noisy batch: each block keeps
  a bias-corrected EMA of its training loss; it stops when the EMA reaches ``convergence_target`` or has not
  improved by ``min_delta`` (relative) for ``patience`` steps, judged only after the EMA has seen about its window
  (1 / (1 - ema) steps). A stopped block is frozen for good: AdamW would still move a parameter whose gradient is
  zero (its moments decay but stay non-zero), so the update **and** the optimizer's moments are masked per layer
  slice with ``torch.where``; no host branch, no per-parameter ``.item()``. The phase ends when every block has
  stopped or at ``blockwise.steps``.
- **Teacher I/O** is recomputed per batch under ``no_grad``, or cached once on disk by data cursor
  (``cache_teacher=true``): ``recipes/upcycle/teacher_io.py``.
- **The shared state and step pieces**: the state is ``core.state.TrainState`` (``params`` the full student, so
  ``models.loading`` reads a checkpoint as a model; ``opt_state`` of the trainable part; the convergence state
  as ``monitor["blocks"]``; the fp16 loss scale under ``dtype=fp16``), and the update is
  ``core.update.apply_gradients`` with the fp16 loss scale (``core.update.scale_loss``/``unscale``), the
  non-finite skip and gradient health; the step is donated (``core.donate.donate``) and compiled from outside,
  as every recipe's step.
- The steps run through the shared training loop (``recipes.train.loop.Loop``): the per-block log and the end of
  the phase are its hook :class:`BlockConvergence`; checkpoints (``blockwise/step_*.msgpack``, ``final.msgpack``)
  are the loop's, written by the manager every run gets (``recipes.train.setup.checkpoint_manager``); a killed
  run continues from the newest one (:func:`restore`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from purestep.core import state as core_state
from purestep.core.compile import cpp_wrapper, maybe_compile
from purestep.core.donate import donate as core_donate, owned as core_owned
from purestep.core.io import checkpoint as ckpt
from purestep.core.io.logging import Logger
from purestep.core.parallel.distributed import Dist
from purestep.core.spike import SpikeConfig
from purestep.core.gradients import autocast, averaged_over_ranks
from purestep.core.state import TrainState
from purestep.core.step import Parallel
from purestep.core.tree import tree_map
from purestep.core.update import Monitors, apply_gradients, if_finite, scale_loss
from purestep.models import blockwise
from purestep.optim.common import current_lr
from purestep.optim.health import computed
from purestep.recipes.train.config import TrainConfig
from purestep.recipes.train.hooks import Hook, StepContext, Stop
from purestep.recipes.train.loop import Loop, LoopState, Steps
from purestep.recipes.train.metrics import skipped_run, too_many_skipped, write_health
from purestep.recipes.train.optimizer import OptimizerSpec
from purestep.recipes.train.setup import checkpoint_manager
from purestep.recipes.upcycle.teacher_io import TeacherSource


# ----------------------------------------------------------------------------------------------------------
# what trains

def split(params: dict, train: str) -> tuple[dict, dict]:
    """(trainable, rest): ``attn`` = the new attention weights, ``block`` = every stacked layer tensor."""
    layers = dict(params["layers"])
    if train == "attn":
        trainable = {"layers": {"attn": layers.pop("attn")}}
    else:
        trainable = {"layers": layers}
        layers = {}
    rest = {k: v for k, v in params.items() if k != "layers"}
    rest["layers"] = layers
    return trainable, rest


def merge(trainable: dict, rest: dict) -> dict:
    return {**rest, "layers": {**rest["layers"], **trainable["layers"]}}


def in_order(tree, like):
    """``tree`` (nested dicts) with ``like``'s key order: :func:`merge` puts the layers last and the trainable part
    after the rest, and a compiled step pairs leaves in dict order (``core.tree.leaves_of``)."""
    if not isinstance(like, dict):
        return tree
    return {k: in_order(tree[k], like[k]) for k in like}


def optimizer_spec(lr: float, warmup: int, steps: int) -> OptimizerSpec:
    """AdamW without weight decay (the student starts at the teacher's solution; LoLCATs uses wd 0), cosine to
    lr / 10 (``recipes.train.optimizer.make_optimizer`` builds it)."""
    return OptimizerSpec(lr=lr, min_lr=lr / 10, lr_schedule="cosine", warmup_steps=warmup,
                         decay_steps=max(steps, warmup + 1))


# ----------------------------------------------------------------------------------------------------------
# per-block convergence (pure functions of [L] tensors)

def init_convergence(n_layers: int, device=None) -> dict:
    zeros = torch.zeros(n_layers, device=device)
    return {"raw": zeros.clone(), "ema": zeros.clone(), "best": torch.full((n_layers,), math.inf, device=device),
            "since": zeros.clone(), "count": zeros.clone(),
            "active": torch.ones(n_layers, dtype=torch.bool, device=device)}


def update_convergence(conv: dict, losses: torch.Tensor, *, decay: float, target: float, patience: int,
                       min_delta: float) -> dict:
    """Fold this step's per-block losses [L] into the EMAs; blocks that meet a criterion become inactive."""
    active = conv["active"]
    on = active.float()
    count = conv["count"] + on
    raw = torch.where(active, decay * conv["raw"] + (1 - decay) * losses.float(), conv["raw"])
    ema = torch.where(count > 0, raw / (1 - decay ** count).clamp_min(1e-12), conv["ema"])
    improved = active & (ema < conv["best"] * (1 - min_delta))
    best = torch.where(improved, ema, conv["best"])
    since = torch.where(improved, torch.zeros_like(count), conv["since"] + on)
    warm = count >= math.ceil(1 / (1 - decay))
    stop = torch.zeros_like(active)
    if target > 0:
        stop = stop | (ema <= target)
    if patience > 0:
        stop = stop | (since >= patience)
    return {"raw": raw, "ema": ema, "best": best, "since": since, "count": count,
            "active": active & ~(warm & stop)}


def _layer_mask(active: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return active.view(-1, *([1] * (like.dim() - 1)))


def masked(active: torch.Tensor, new, old, n_layers: int):
    """``new`` where the layer is active, ``old`` where it is not, for every leaf with the layer axis; other
    leaves (step counters, hyperparameters) take ``new``."""
    def pick(n, o):
        if isinstance(n, torch.Tensor) and n.dim() >= 1 and n.shape[0] == n_layers:
            return torch.where(_layer_mask(active, n), n, o)
        return n
    return tree_map(pick, new, old)


# ----------------------------------------------------------------------------------------------------------
# the state and the step

@dataclass(frozen=True)
class Blocks:
    """What the blockwise step trains and when a block stops (``Blocks.of``: the phase's ``blockwise.*`` keys).
    ``loss`` (``models.blockwise.LOSSES``) between the student's and the teacher's ``match`` outputs
    (``models.blockwise.TARGETS``), block inputs by ``mode`` (``models.blockwise.MODES``), ``train`` the new
    attention (``attn``) or whole blocks (``block``); a block stops on a bias-corrected loss EMA of decay ``ema``
    that reaches ``target`` (0: off) or has not improved by ``min_delta`` (relative) for ``patience`` steps (0: off)."""
    loss: str
    mode: str
    match: str
    train: str
    ema: float
    target: float
    patience: int
    min_delta: float

    @classmethod
    def of(cls, bw) -> "Blocks":
        """The keys of ``recipes.upcycle.config.BlockwiseConfig`` ``bw``."""
        return cls(bw.loss, bw.mode, bw.match, bw.train, bw.ema, bw.convergence_target, bw.patience, bw.min_delta)

    def converge(self, conv: dict, losses: torch.Tensor) -> dict:
        return update_convergence(conv, losses, decay=self.ema, target=self.target, patience=self.patience,
                                  min_delta=self.min_delta)


def init_state(params: dict, optimizer, train: str, n_layers: int, seed: int = 0,
               precision: str = "fp32") -> TrainState:
    """The phase's ``core.state.TrainState``: ``params`` the full student (so ``models.loading`` reads a checkpoint
    as a model), the optimizer state of its ``train`` part, the fp16 loss scale under ``precision="fp16"``
    (``core.state.init_state`` makes both) and the per-block convergence state as ``monitor["blocks"]``."""
    state = core_state.init_state(split(params, train)[0], optimizer, seed, precision)
    return TrainState(state.step, params, state.opt_state, state.key, state.cursor, state.loss_scale,
                      {"blocks": init_convergence(n_layers, state.step.device)})


def convergence(state: TrainState) -> dict:
    """The per-block convergence state ([L] tensors, :func:`init_convergence`) that ``state`` carries."""
    return state.monitor["blocks"]


def owned(state: TrainState, train: str, teacher=None) -> TrainState:
    """``state`` safe to donate (``core.donate.owned``): a trained leaf or moment that shares storage with another,
    with the student's frozen part or with ``teacher`` is cloned (the same objects when nothing is shared)."""
    trainable, rest = split(state.params, train)
    mine = core_owned(state._replace(params=trainable), frozen=(teacher, rest))
    return mine._replace(params=in_order(merge(mine.params, rest), state.params))


def make_step(scfg, optimizer, blocks: Blocks, *, precision: str = "fp32", compile: bool = False,
              donate: bool = False, health: Optional[Callable] = None, parallel: Parallel = Parallel()):
    """``step(state, batch) -> (state, metrics)`` over the phase's ``core.state.TrainState`` (:func:`init_state`);
    ``batch`` = {"x": tokens, "inputs", "targets": [L, B, T, d]} (what the targets are: ``blocks.match``). Built
    from the shared pieces, as ``core.step.make_train_step`` builds the standard step, where the state lives (its
    ``step`` tensor's device type, on first use):

    - the gradients of the summed per-block losses by ``torch.func.grad``; under ``precision="fp16"`` the loss is
      multiplied by the state's dynamic loss scale (``core.update.scale_loss``) and the gradients divided by it;
    - the update is ``core.update.apply_gradients``: the fp16 unscale and the scale's growth or back-off, a step
      whose loss or gradient norm is not finite leaves the student, the optimizer state and the convergence state
      as they were (``metrics["skipped"]``), and ``health`` (``optim.health.GradientHealth`` of the trainable part)
      adds gradient health statistics on its due steps. Stopped blocks are then masked back, update and moments;
    - ``parallel`` (``core.step.Parallel``): each rank of a run under torchrun trains on its rows of the batch; with
      ``shard`` (``core.parallel.shard``, parallel=fsdp) the state's student and optimizer state are this rank's
      shards, gathered for the step and the gradients reduce-scattered; with ``reduce``
      (``core.parallel.distributed.Dist.all_reduce_mean``, parallel=ddp) the gradients are averaged. Either way the
      per-block losses are averaged over ranks, so every rank takes the same convergence decisions;
    - ``donate`` (``core.donate.donate``, applied from outside the step, before ``compile``): the new student and
      optimizer state are written into the buffers of the state it is given, which the caller gives up (the same
      numbers; :func:`owned` makes a state safe to donate). ``compile``: one graph (``core.compile``)."""
    built = {}   # device type -> the step built for it

    def step(state: TrainState, batch: dict):
        kind = state.step.device.type
        if kind not in built:
            pure = _step(scfg, optimizer, blocks, precision, kind, health, parallel)
            collectives = parallel.shard is not None or parallel.reduce is not None
            built[kind] = maybe_compile(core_donate(pure) if donate else pure, compile,
                                        cpp=cpp_wrapper(kind, collectives), device_type=kind)
        return built[kind](state, batch)

    return step


def _step(scfg, optimizer, blocks: Blocks, precision: str, device_type: str,
          health: Optional[Callable], parallel: Parallel) -> Callable:
    """:func:`make_step`'s pure step on ``device_type``."""
    L, train, shard = scfg.n_layers, blocks.train, parallel.shard

    def objective(trainable, rest, batch, loss_scale):
        params = merge(trainable, rest)
        with autocast(precision, device_type):
            if blocks.mode == "teacher_forced":
                inputs = batch["inputs"]
                outputs = blockwise.student_outputs(params, scfg, inputs, blocks.match)
            else:
                inputs, outputs = blockwise.student_stream(params, scfg, batch["x"], blocks.match)
        per = blockwise.block_losses(inputs, outputs, batch["inputs"], batch["targets"], blocks.loss, blocks.match)
        per = per.to(torch.promote_types(per.dtype, torch.float32))
        return scale_loss(per.sum(), loss_scale), per.detach()

    grad_fn = torch.func.grad(objective, has_aux=True)
    monitors = Monitors(extra_metrics=health)

    def gradients(params, batch, loss_scale):
        grads, per = grad_fn(*split(params, train), batch, loss_scale)
        return grads, per, {}
    if shard is not None:     # gathered whole, the trainable part's gradients reduce-scattered (fsdp)
        gradients = shard.around(gradients, specs=split(shard.params, train)[0])
    else:                     # averaged across ranks (ddp)
        gradients = averaged_over_ranks(gradients, parallel.reduce)

    def update(state: TrainState, grads, loss, aux, due=None):
        return apply_gradients(state, grads, optimizer, loss=loss, aux=aux, monitors=monitors, due=due)
    if shard is not None:     # the optimizer and health see the trainable shards as DTensors
        update = shard.on_dtensors(update, device_type, params=split(shard.params, train)[0])

    def step(state: TrainState, batch: dict):
        grads, per, _ = gradients(state.params, batch, state.loss_scale)
        trainable, rest = split(state.params, train)
        conv = convergence(state)
        ours = TrainState(state.step, trainable, state.opt_state, state.key, state.cursor, state.loss_scale,
                          state.monitor)
        new, metrics = update(ours, grads, per.sum(), None)
        active = conv["active"]
        params = masked(active, new.params, trainable, L)
        opt_state = masked(active, new.opt_state, state.opt_state, L)
        conv = if_finite(metrics["skipped"] == 0, blocks.converge(conv, per), conv)
        metrics.update({"loss": (per * active).sum() / active.sum().clamp_min(1), "block_loss": per,
                        "ema": conv["ema"], "active": conv["active"].float(), "lr": current_lr(opt_state).float()})
        # the input's key order: a compiled donated step pairs its input's leaves with its output's by it
        return TrainState(new.step, in_order(merge(params, rest), state.params), opt_state, new.key, new.cursor,
                          new.loss_scale, {**state.monitor, "blocks": conv}), metrics

    return step


# ----------------------------------------------------------------------------------------------------------
# the phase: the shared training loop with the per-block convergence hook

def loop_config(bw) -> TrainConfig:
    """The shared loop's settings for the blockwise phase: ``bw.steps``, a log every ``bw.log_every`` steps, no
    validation and no spike rollback (the per-block convergence decides when the phase ends)."""
    return TrainConfig(steps=bw.steps, log_every=bw.log_every, eval_every=0, patience=0, health=False,
                       spike=SpikeConfig(enabled=False), save_every=bw.save_every, keep_last=bw.keep_last)


def run(bw, state: TrainState, step_fn, source: TeacherSource, folder: Path, extra, logger: Logger,
        resume_folder: Optional[Path] = None, dist: Dist = Dist(), layout=None, health=None):
    """Train through the shared loop (``recipes.train.loop.Loop``) until every block has stopped or ``bw.steps``,
    checkpointing in ``folder`` (rank 0 writes; under ``layout`` every rank gathers); returns (state, stop reason
    or "")."""
    cfg = loop_config(bw)
    steps = Steps(train=None, eval=None, health=None, batches=source, layout=layout)
    with Loop(cfg, state, steps, logger, checkpoint_manager(cfg, folder, dist),
              counters=resumed_loop(folder, int(state.step)), extra=extra, resume_folder=resume_folder, dist=dist,
              log=BlockConvergence(state, bw.steps, bw.log_every, logger, health, cfg.max_skipped_steps)) as loop:
        for batch in loop:
            loop.stepped(*step_fn(loop.state, batch))
    result = loop.result
    return result.state, f"blockwise: {result.stop_reason}" if result.stop_reason else ""


def restore(path: Path, template: TrainState, fresh: TrainState, device=None, layout=None) -> TrainState:
    """The state of the phase's checkpoint ``path``, in ``template``'s structure (``core.io.checkpoint.load``);
    with ``layout`` (fsdp; ``template`` full, on meta) this rank's shards, read as such
    (``core.parallel.shard.Layout.load``). A checkpoint written before the phase's state was
    ``core.state.TrainState`` (fields step, params, opt_state, cursor, conv) is read too: its ``conv`` becomes
    ``monitor["blocks"]``, the RNG key and loss scale are ``fresh``'s (it trained in fp32 or bf16, which keep no
    loss scale)."""
    top = ckpt.load(path, device=device, boxes=layout.boxes(template) if layout else None)
    saved = top["state"]
    if isinstance(saved, dict) and set(saved) == {"step", "params", "opt_state", "cursor", "conv"}:
        saved = {"step": saved["step"], "params": saved["params"], "opt_state": saved["opt_state"],
                 "key": fresh.key, "cursor": saved["cursor"], "loss_scale": ckpt.to_state_dict(fresh.loss_scale),
                 "monitor": {"blocks": saved["conv"]}}
    try:
        if layout is None:
            return ckpt.from_state_dict(template, saved, device=device)
        return layout.placed(ckpt.from_state_dict(layout.boxed(template), saved, device=device))
    except ckpt.CheckpointError as e:
        raise ckpt.CheckpointError(f"{path}: not a blockwise checkpoint of this run: {e}") from None


def resumed_loop(folder: Path, step: int) -> Optional[LoopState]:
    """The loop counters (wall time, ticks) of ``folder``'s newest checkpoint when the phase resumes from it."""
    path = ckpt.latest(folder) if step > 0 else None
    meta = ckpt.read_meta(path) if path is not None else {}
    return LoopState.from_dict(meta.get("loop")) if meta.get("step") == step else None


class BlockConvergence(Hook):
    """The blockwise phase's log: every ``log_every`` steps the loss, lr and each block's loss and EMA (one host
    transfer), a ``block_stopped`` event for every block that froze since the last log, and the end of the phase
    (a final checkpoint) once every block has stopped or at the step cap; the standard log's divergence check too
    (``recipes.train.metrics``: ``max_skipped_steps`` steps in a row skipped as non-finite stop it unfinished)."""

    def __init__(self, state: TrainState, total: int, log_every: int, logger: Logger, health=None,
                 max_skipped: int = 0):
        self.total, self.log_every, self.logger, self.health = total, log_every, logger, health
        self.active = convergence(state)["active"].cpu()
        self.t_log, self.steps_at_log = time.perf_counter(), int(state.step)
        self.max_skipped, self.skipped_run = max_skipped, 0

    def after_step(self, ctx: StepContext) -> Optional[Stop]:
        if ctx.step % self.log_every == 0 or ctx.last:
            self.log(ctx)
            reason = too_many_skipped(self.skipped_run, self.max_skipped, ctx.step)
            if reason is not None:
                self.logger.print(f"blockwise: {reason}: stopping (lower blockwise.lr, or inspect the data)")
                return Stop(reason, unfinished=True)
        if ctx.last or not bool(self.active.any()):
            step, why = ctx.step, "every block stopped" if not bool(self.active.any()) else "step cap"
            return Stop(final=True, announce=lambda path: self.logger.print(
                f"blockwise: done at step {step} ({why}); {path}"))
        return None

    def log(self, ctx: StepContext) -> None:
        logger, step = self.logger, ctx.step
        values = _pull(ctx.window.pending)
        packed = next((m["health"] for m in reversed(ctx.window.pending) if "health" in m and computed(m["health"])),
                      None)
        if self.health is not None and packed is not None:
            write_health(logger, self.health, step, packed.cpu())
        skips = torch.stack([m["skipped"] for m in ctx.window.pending]).tolist()
        self.skipped_run, skipped = skipped_run(skips, self.skipped_run), sum(skips)
        if skipped:
            logger.print(f"blockwise: {skipped:.0f} non-finite step(s) skipped since the last log (student untouched)")
        ctx.window.pending.clear()
        ctx.window.values = values
        now_active = torch.tensor(values["active"]) > 0.5
        rate = (step - self.steps_at_log) / max(time.perf_counter() - self.t_log, 1e-9)
        self.t_log, self.steps_at_log = time.perf_counter(), step
        logger.scalars(step, {"train/loss": values["loss"], "lr": values["lr"],
                              "active_blocks": float(now_active.sum()), "steps_per_sec": rate,
                              **{f"block/{i:02d}/loss": v for i, v in enumerate(values["block_loss"])},
                              **{f"block/{i:02d}/ema": v for i, v in enumerate(values["ema"])}})
        for i in (self.active & ~now_active).nonzero().flatten().tolist():
            ema = values["ema"][i]
            logger.event(step, "block_stopped", block=i, ema=ema)
            logger.print(f"blockwise: block {i} stopped at step {step} (loss EMA {ema:.4g})")
        self.active = now_active
        logger.progress(step, self.total, loss=values["loss"],
                        extra={"blocks": float(self.active.sum()), "lr": values["lr"]})


def _pull(pending: list[dict]) -> dict:
    """Interval means of the loss and per-block losses, the last EMA/active/lr: one host transfer."""
    loss = torch.stack([m["loss"] for m in pending]).mean()
    block = torch.stack([m["block_loss"] for m in pending]).mean(0)
    last = pending[-1]
    packed = torch.cat([loss.view(1), block, last["ema"], last["active"], last["lr"].view(1)]).double().cpu()
    L = block.numel()
    values = packed.tolist()
    return {"loss": values[0], "block_loss": values[1:1 + L], "ema": values[1 + L:1 + 2 * L],
            "active": values[1 + 2 * L:1 + 3 * L], "lr": values[-1]}

