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

from core import checkpoint as ckpt, runs
from core.config import UserError, apply_overrides
from core.distributed import Dist
from core.logging import Logger
from core.state import TrainState, init_state
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


def start(cfg: TrainConfig, folder: Optional[Path], params, *, device, dist: Dist = Dist(),
          tokenizer=None) -> RunSetup:
    """The run of ``cfg`` in ``folder`` starting from ``params``, or resumed from the checkpoint ``cfg.resume``
    names there (its tokenizer must be ``tokenizer``'s when given). ``folder`` None: a fresh state for a
    benchmark, no run folder at all."""
    backend.configure(cfg, device)        # tf32 on CUDA; a warning for what this device ignores
    resume = resolve_run_folder(cfg, folder) if folder is not None else None
    # an orchestrated run starts on (or resumes with) the orchestrator's strategy
    optimizer = initial_optimizer(cfg, resume) if cfg.orchestrator.enabled else make_optimizer(optimizer_spec(cfg))
    state = init_state(params, optimizer, cfg.seed, cfg.dtype, spike=cfg.spike.enabled)
    loop, saved_orchestrator, loaded, changed = LoopState(), None, {}, ""
    if resume is not None:
        diff = _changes(cfg, ckpt.read_meta(resume))      # refused keys stop the run before the state is read
        loaded = ckpt.load(resume, template=state, device=device)
        if tokenizer is not None and loaded.get("tokenizer") and loaded["tokenizer"] != tokenizer.to_dict():
            raise UserError(f"{resume}: its tokenizer differs from this run's ({tokenizer.name}); use another out=")
        state, loop = loaded["state"], LoopState.from_dict(loaded.get("loop"))
        saved_orchestrator = loaded.get("orchestrator")
        state = _apply_changes(cfg, diff, state, params)
        changed = changes.describe(diff, int(state.step))
    return RunSetup(cfg, folder, dist, resume, optimizer, state, loop, saved_orchestrator, loaded, changed)


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
