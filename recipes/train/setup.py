"""The run wiring every training recipe shares, written once: where the run lives, what it resumes, the
optimizer and train state it starts from, and the checkpoint manager and logger it writes with.

``recipes/standard.py``, ``recipes/distill/recipe.py`` and ``recipes/upcycle/phases.py`` (its global phase)
call :func:`start` once their inputs are checked; :func:`start` reads, and writes nothing, so a run that
fails later on bad input leaves no trace. :meth:`RunSetup.writing` claims the folder (an OS lock, see
``core.runs.claim``) and opens the checkpoint manager and logger: the first writes into the run folder.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from core import checkpoint as ckpt, runs
from core.config import ConfigError, UserError, apply_overrides
from core.distributed import Dist
from core.logging import Logger
from core.shard import Layout, LayoutError
from core.state import TrainState, init_state
from core.tree import cast
from optim.health import stacked_predicate
from optim.base import GradientTransformation
from recipes.orchestrator.driver import initial_optimizer
from recipes.train import backend, changes
from recipes.train.config import TrainConfig
from recipes.train.loop import LoopState
from recipes.train.optimizer import make_optimizer, optimizer_spec


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


@dataclass
class RunSetup:
    """A run ready for ``recipes.train.loop.fit``: fresh, or restored from ``resume``."""
    cfg: TrainConfig
    folder: Optional[Path]
    dist: Dist
    resume: Optional[Path]              # the checkpoint this run continues, or None
    optimizer: GradientTransformation   # an orchestrated run's: the strategy it starts (or resumes) with
    state: TrainState
    loop: LoopState
    saved_orchestrator: Optional[dict]  # the orchestrator's state in the resumed checkpoint
    resumed: dict                       # the resumed checkpoint's top level ({} for a fresh run)
    changed: str = ""                   # the keys changed since that checkpoint, applied from its step
    layout: Optional[Layout] = None     # parallel=fsdp: where each leaf of the state lives (core.shard)

    @contextmanager
    def writing(self, hparams: dict) -> Iterator[tuple[Optional[ckpt.CheckpointManager], Logger]]:
        """The run folder claimed for this process (``core.runs.claim``: a second run on it stops, naming this
        one), then its checkpoint manager and Logger: the first writes into the folder."""
        with runs.claim(self.folder) if self.dist.is_main else nullcontext():
            with self.logger(hparams) as logger:
                yield self.checkpoints(), logger

    def checkpoints(self) -> Optional[ckpt.CheckpointManager]:
        """The run's checkpoint manager (None on data-parallel ranks other than 0: rank 0 alone writes)."""
        if not self.dist.is_main:
            return None
        return ckpt.CheckpointManager(self.folder, keep_last=self.cfg.keep_last, save_every=self.cfg.save_every)

    def logger(self, hparams: dict) -> Logger:
        """The run's Logger (silent on ranks other than 0), the resolved config ``hparams`` logged."""
        logger = Logger(self.folder, enabled=self.dist.is_main)
        logger.hparams(hparams, {"val/loss": None})
        if self.changed:
            logger.print(f"resumed from {self.resume} with changed keys: {self.changed}")
            logger.event(int(self.state.step), "resume_changes", changes=self.changed)
        return logger


def layout_of(cfg: TrainConfig, params, dist: Dist) -> Optional[Layout]:
    """The sharded layout of a ``parallel=fsdp`` run of ``cfg`` (None otherwise), its optimizer state probed
    from ``cfg``'s optimizer."""
    return sharded_layout(dist, params, make_optimizer(optimizer_spec(cfg)).init, cfg.dtype)


def sharded_layout(dist: Dist, params, init, dtype: str) -> Optional[Layout]:
    """``core.shard.Layout`` of ``params`` over ``dist``'s ranks when ``dist.sharded`` (parallel=fsdp), else None:
    leaves stacked under ``layers.`` split on their first non-layer dim, others on dim 0; params gathered in bf16
    under dtype=bf16 (FSDP2's ``param_dtype``); ``init`` makes the optimizer state whose leaves follow them. A
    leaf it cannot split is a ConfigError naming it."""
    if not dist.sharded:
        return None
    import torch.distributed as torch_dist
    try:
        return Layout(params, init, stacked=stacked_predicate(None), world=dist.world_size, rank=dist.rank,
                      group=torch_dist.group.WORLD, gather_dtype=torch.bfloat16 if dtype == "bf16" else None)
    except LayoutError as e:
        raise ConfigError(f"parallel=fsdp: {e}") from None


def start(cfg: TrainConfig, folder: Optional[Path], params, *, device, dist: Dist = Dist(),
          tokenizer=None) -> RunSetup:
    """The run of ``cfg`` in ``folder`` starting from ``params``, or resumed from the checkpoint ``cfg.resume``
    names there (its tokenizer must be ``tokenizer``'s when given). ``folder`` None: a fresh state for a
    benchmark, no run folder at all."""
    backend.configure(cfg, device)        # tf32 on CUDA; a warning for what this device ignores
    resume = resolve_run_folder(cfg, folder) if folder is not None else None
    layout = layout_of(cfg, params, dist)
    # an orchestrated run starts on (or resumes with) the orchestrator's strategy
    optimizer = initial_optimizer(cfg, resume) if cfg.orchestrator.enabled else \
        make_optimizer(optimizer_spec(cfg), psum=layout.psum if layout else None)
    mine = layout.shard_params(params) if layout else params      # fsdp: the moments are made on the shards
    state = init_state(mine, optimizer, cfg.seed, cfg.dtype, spike=cfg.spike.enabled)
    loop, saved_orchestrator, loaded, changed = LoopState(), None, {}, ""
    if resume is not None:
        diff = _changes(cfg, ckpt.read_meta(resume))      # refused keys stop the run before the state is read
        template = state if layout is None else init_state(cast(params, device="meta"), optimizer, cfg.seed,
                                                           cfg.dtype, spike=cfg.spike.enabled)
        loaded = ckpt.load(resume, template=template, device=device)   # fsdp: full leaves, then this rank's cut
        if tokenizer is not None and loaded.get("tokenizer") and loaded["tokenizer"] != tokenizer.to_dict():
            raise UserError(f"{resume}: its tokenizer differs from this run's ({tokenizer.name}); use another out=")
        state, loop = loaded["state"], LoopState.from_dict(loaded.get("loop"))
        state = state if layout is None else layout.shard(state)
        saved_orchestrator = loaded.get("orchestrator")
        state = _apply_changes(cfg, diff, state, mine)
        changed = changes.describe(diff, int(state.step))
    return RunSetup(cfg, folder, dist, resume, optimizer, state, loop, saved_orchestrator, loaded, changed, layout)


def _changes(cfg: TrainConfig, meta: dict) -> dict:
    """The keys changed since the checkpoint whose top level is ``meta``; a ConfigError for those that cannot
    change (``recipes.train.changes``)."""
    diff = changes.changes(meta.get("train") or meta.get("config") or {}, cfg)
    changes.check(diff)
    return diff


def _apply_changes(cfg: TrainConfig, diff: dict, state: TrainState, params) -> TrainState:
    """``state`` with the optimizer hyperparameters that ``diff`` changes set to this run's values."""
    if not diff:
        return state
    old = apply_overrides(cfg, {k: before for k, (before, _) in diff.items()}, context="the checkpoint's config")
    before, after = (make_optimizer(optimizer_spec(c)).init(params) for c in (old, cfg))
    return state._replace(opt_state=changes.apply_hyperparameters(state.opt_state, before, after))
