"""The run wiring every training recipe shares, written once: where the run lives, what it resumes, the
optimizer and train state it starts from, and the checkpoint manager and logger it writes with.

``recipes/standard.py``, ``recipes/distill/recipe.py`` and ``recipes/upcycle/phases.py`` (its global phase)
call :func:`start` once their inputs are checked; :func:`start` reads, and writes nothing, so a run that
fails later on bad input leaves no trace. :meth:`RunSetup.writing` claims the folder (an OS lock, see
``core.cli.runs.claim``) and opens the checkpoint manager and logger: the first writes into the run folder.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Optional

import torch

from purestep.core.io import checkpoint as ckpt
from purestep.core.cli import runs
from purestep.core.config import ConfigError, UserError, apply_overrides
from purestep.core.parallel.distributed import Dist
from purestep.core.io.logging import Logger
from purestep.core.parallel.shard import Layout, LayoutError
from purestep.core.state import TrainState, init_state
from purestep.core.tree import cast
from purestep.optim.health import stacked_predicate
from purestep.optim.base import GradientTransformation
from purestep.recipes.train import backend, changes
from purestep.recipes.train.config import TrainConfig
from purestep.recipes.train.loop import LoopState
from purestep.recipes.train.optimizer import make_optimizer, optimizer_spec


def run_folder(cfg, recipe: str) -> Path:
    """``out``, or ``runs/<recipe>-<name>``, or ``runs/<recipe>-<timestamp>``."""
    return runs.run_folder(cfg.out, cfg.name, recipe)


def resolve_run_folder(cfg: TrainConfig, folder: Path) -> Optional[Path]:
    """The checkpoint to resume from (``cfg.resume``), refusing to start a new run over an old one."""
    existing = folder.exists() and any(folder.glob("*.msgpack"))
    if cfg.resume == "never" and existing:
        raise UserError(f"out={folder} already holds a run's checkpoints and resume=never would mix a new run "
                        f"into it; choose another out= (or name=), or delete that folder")
    if cfg.resume == "auto" and not existing:
        return None
    return ckpt.resolve_resume(cfg.resume, folder)


@dataclass(frozen=True)
class RunFolder:
    """Where a run writes: its config, its folder (None: a benchmark's or dry run's fresh state, no folder at all) and
    its ranks (rank 0 alone writes)."""
    cfg: TrainConfig
    path: Optional[Path]
    dist: Dist


class Resumed(NamedTuple):
    """The checkpoint a run continues: its ``path``, its top level with every loop hook's state under its key
    (``core.io.checkpoint.read_meta``), and the keys changed since, applied from its step (words for the log)."""
    path: Path
    top: dict
    changed: str


@dataclass
class RunSetup:
    """A run ready for its loop (``recipes.train.loop.Loop``): fresh, or restored from a checkpoint (``origin``)."""
    where: RunFolder
    optimizer: GradientTransformation   # the run's own, or the one a run hook supplies (build_optimizer)
    state: TrainState
    loop: LoopState                     # the loop's counters: fresh, or the checkpoint's
    layout: Optional[Layout] = None     # parallel=fsdp: where each leaf of the state lives (core.parallel.shard)
    origin: Optional[Resumed] = None    # the checkpoint this run continues, or None for a fresh run

    @property
    def dist(self) -> Dist:
        return self.where.dist

    @property
    def resume(self) -> Optional[Path]:
        """The checkpoint this run continues, or None."""
        return self.origin.path if self.origin else None

    @property
    def resumed(self) -> dict:
        """The resumed checkpoint's top level ({} for a fresh run), every loop hook's state under its key."""
        return self.origin.top if self.origin else {}

    @property
    def changed(self) -> str:
        """The keys changed since the resumed checkpoint ("" for a fresh run)."""
        return self.origin.changed if self.origin else ""

    @contextmanager
    def writing(self, hparams: dict) -> Iterator[tuple[Optional[ckpt.CheckpointManager], Logger]]:
        """The run folder claimed for this process (``core.cli.runs.claim``: a second run on it stops, naming this
        one), then its checkpoint manager and Logger: the first writes into the folder."""
        where = self.where
        with runs.claim(where.path) if where.dist.is_main else nullcontext():
            with self.logger(hparams) as logger:
                yield checkpoint_manager(where.cfg, where.path, where.dist), logger

    def logger(self, hparams: dict) -> Logger:
        """The run's Logger (silent on ranks other than 0), the resolved config ``hparams`` logged."""
        logger = Logger(self.where.path, enabled=self.dist.is_main)
        logger.hparams(hparams, {"val/loss": None})
        if self.changed:
            logger.print(f"resumed from {self.resume} with changed keys: {self.changed}")
            logger.event(int(self.state.step), "resume_changes", changes=self.changed)
        return logger


def checkpoint_manager(cfg: TrainConfig, folder: Path, dist: Dist = Dist()) -> Optional[ckpt.CheckpointManager]:
    """The checkpoint manager of a run of ``cfg`` in ``folder`` (``keep_last``, ``save_every``; the loop adds the
    final and best checkpoints), or None on data-parallel ranks other than 0: rank 0 alone writes."""
    if not dist.is_main:
        return None
    return ckpt.CheckpointManager(folder, keep_last=cfg.keep_last, save_every=cfg.save_every)


def build_optimizer(cfg: TrainConfig, sharded: bool = False, resumed: Optional[dict] = None) \
        -> GradientTransformation:
    """The optimizer a run of ``cfg`` builds its state with: the one a run hook of ``cfg`` supplies
    (``recipes.train.hooks.RunHook.optimizer``, told the resumed checkpoint's top level ``resumed``), else the
    run's own (``recipes.train.optimizer``); ``sharded`` as in ``make_optimizer`` (parallel=fsdp)."""
    for hook in cfg.run_hooks():
        optimizer = hook.optimizer(sharded, resumed or {})
        if optimizer is not None:
            return optimizer
    return make_optimizer(optimizer_spec(cfg), sharded)


def sharded_layout(dist: Dist, params, init, dtype: str) -> Optional[Layout]:
    """``core.parallel.shard.Layout`` of ``params`` over ``dist``'s ranks when ``dist.sharded`` (parallel=fsdp; with
    parallel=fsdp,tp over its data-parallel ranks, the params split across its tensor-parallel ones first), else
    None:
    leaves stacked under ``layers.`` split on their first non-layer dim, others on dim 0; params gathered in bf16
    under dtype=bf16 (FSDP2's ``param_dtype``); ``init`` makes the optimizer state whose leaves follow them. A
    leaf it cannot split is a ConfigError naming it."""
    if not dist.sharded:
        return None
    what = "parallel=fsdp" if dist.tensor is None else "parallel=fsdp,tp"
    gather = torch.bfloat16 if dtype == "bf16" else None
    try:
        if dist.hybrid is not None:   # hsdp: sharded within a dp group, the same in each of the rep groups
            shards, reps = dist.hybrid["dp"], dist.hybrid["rep"]
            return Layout(params, init, stacked=stacked_predicate(None), world=shards.size(),
                          rank=shards.get_local_rank(), group=shards.get_group(), gather_dtype=gather,
                          replicas=(reps.get_group(), reps.size()))
        if dist.tensor is not None:
            dist.tensor.check(params)
        return Layout(params, init, stacked=stacked_predicate(None), world=dist.data_world, rank=dist.data_rank,
                      group=dist.data_group, gather_dtype=gather, tensor=dist.tensor)
    except (LayoutError, ValueError) as e:
        raise ConfigError(f"{what}: {e}") from None


def start(cfg: TrainConfig, folder: Optional[Path], params, *, device, dist: Dist = Dist(),
          tokenizer=None, check: Optional[Callable[[Path, dict], None]] = None) -> RunSetup:
    """The run of ``cfg`` in ``folder`` starting from ``params``, or resumed from the checkpoint ``cfg.resume``
    names there (its tokenizer must be ``tokenizer``'s when given; ``check(path, top level)`` raises when it
    holds another run's settings, before anything is loaded). ``folder`` None: a fresh state for a
    benchmark, no run folder at all. The optimizer is built once (:func:`build_optimizer`): its ``init`` also
    lays out a sharded state."""
    backend.configure(cfg, device)        # tf32 on CUDA; a warning for what this device ignores
    resume = resolve_run_folder(cfg, folder) if folder is not None else None
    meta = ckpt.read_meta(resume) if resume is not None else {}
    if resume is not None and check is not None:
        check(resume, meta)
    diff = _changes(cfg, meta) if resume is not None else {}   # refused keys stop the run before anything is built
    optimizer = build_optimizer(cfg, dist.sharded, meta)
    layout = sharded_layout(dist, params, optimizer.init, cfg.dtype)
    mine = layout.shard_params(params) if layout else params      # fsdp: the moments are made on the shards
    run = RunSetup(RunFolder(cfg, folder, dist), optimizer,
                   init_state(mine, optimizer, cfg.seed, cfg.dtype, spike=cfg.spike.enabled), LoopState(), layout)
    return run if resume is None else _resumed(run, resume, params, meta, diff, tokenizer, device)


def _resumed(run: RunSetup, resume: Path, params, meta: dict, diff: dict, tokenizer, device) -> RunSetup:
    """``run`` (fresh) continued from its checkpoint ``resume``, whose top level is ``meta`` and whose keys
    ``diff`` changes: its state (this rank's cut under fsdp), loop counters and hooks' entries."""
    cfg, layout = run.where.cfg, run.layout
    if layout is None:
        loaded = ckpt.load(resume, template=run.state, device=device)
    else:   # this rank's cut, read as such: no leaf made whole
        loaded = layout.load(resume, init_state(cast(params, device="meta"), run.optimizer, cfg.seed, cfg.dtype,
                                                spike=cfg.spike.enabled), device)
    if tokenizer is not None and loaded.get("tokenizer") and loaded["tokenizer"] != tokenizer.to_dict():
        raise UserError(f"{resume}: its tokenizer differs from this run's ({tokenizer.name}); use another out=")
    state = loaded["state"]
    state = _apply_changes(cfg, diff, state, run.state, meta)
    return replace(run, state=state, loop=LoopState.from_dict(loaded.get("loop")),
                   origin=Resumed(resume, loaded, changes.describe(diff, int(state.step))))


def _changes(cfg: TrainConfig, meta: dict) -> dict:
    """The keys changed since the checkpoint whose top level is ``meta``; a ConfigError for those that cannot
    change (``recipes.train.changes``, and the keys the config's run hooks fix)."""
    diff = changes.changes(meta.get("train") or meta.get("config") or {}, cfg)
    changes.check(diff, changes.FIXED + tuple(k for hook in cfg.run_hooks() for k in hook.fixed_keys))
    return diff


def _apply_changes(cfg: TrainConfig, diff: dict, state: TrainState, fresh: TrainState, meta: dict) -> TrainState:
    """``state`` with the optimizer hyperparameters that ``diff`` changes set to this run's values: ``fresh`` is
    this run's fresh state (its optimizer state made by this config), compared with one made by the checkpoint's
    config (``recipes.train.changes.apply_hyperparameters``)."""
    if not diff:
        return state
    old = apply_overrides(cfg, {k: before for k, (before, _) in diff.items()}, context="the checkpoint's config")
    before = build_optimizer(old, False, meta).init(fresh.params)
    return state._replace(opt_state=changes.apply_hyperparameters(state.opt_state, before, fresh.opt_state))
