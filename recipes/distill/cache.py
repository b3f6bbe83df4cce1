"""Offline teacher cache: ``bin/run recipe=distill_cache teacher=PATH out=CACHE``, then ``recipe=distill cache=CACHE``.

Runs the teacher once over the training batches a distill run will see (``batches.get(cursor)`` for cursor
0 .. steps-1 with the same data, seed, batch_size, block_size and grad_accum, so the cache is keyed by
cursor) and stores a sparse signal per position, since full logits are out of reach (1B tokens x 128k
vocab x 2 B = 256 TB):

- ``mode=topk``: the teacher's k most likely ids, their log-probs (fp16) and the missing mass
  1 - sum(top-k p) (fp32), used as an "other" bucket by ``models.losses.topk_kd_loss``
  (DistillKit ``distillkit/lossfuncs/kl.py``; MaxText-KD);
- ``mode=sample``: Random-Sampling KD (Anshumann et al., ACL 2025): ``samples`` ids drawn from the teacher
  with replacement, stored as distinct ids + uint16 counts (``models.losses.sample_teacher``); unbiased,
  unlike top-k.

Ids are uint16 when the vocabulary fits (as ``core.data.text`` stores tokens), else int32. Targets are
captured at ``temperature``, which the distill run must use (a softened top-k cannot be re-softened
exactly). Layout: ``meta.json`` (format, mode, k/samples, dtypes and shapes, batch/block/seed/grad_accum/
steps, temperature, teacher identity with a hash of its weights, data identity) and one raw numpy memmap
per array (``ids.bin``, ``logprobs.bin``, ``missing.bin`` or ``ids.bin``, ``counts.bin``) of shape
``[steps, *batch_x_shape, width]``. It is written by ``core.io.cache.build_folder`` (a temporary folder next to
``out``, renamed into place), so an interrupted build never leaves a cache that a run would trust.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.io import cache
from core.config import ConfigError, UserError, option, same_as
from core.device import resolve_device
from core.gradients import autocast
from core.io.logging import progress
from models import llama, losses
from recipes.distill.teacher import (data_identity, held_dtype_hint, load_teacher, teacher_data,
                                     teacher_dtype_option, teacher_identity, teacher_option)
from recipes.train.config import TrainConfig

DESCRIPTION = "run a teacher once over a distill run's batches and cache top-k or sampled targets"

FORMAT = "purestep-kd-cache-1"
MODES = ("topk", "sample")
RUN_KEYS = ("batch_size", "block_size", "seed", "grad_accum", "temperature")


@dataclass
class Config:
    teacher: str = teacher_option()
    teacher_dtype: str = teacher_dtype_option()
    out: str = option("", "cache folder to write (required; built in a temporary folder, then renamed)")
    mode: str = option("topk", "topk (ids + log-probs + missing mass) or sample (Random-Sampling KD ids + counts)",
                       choices=MODES)
    k: int = option(32, "mode=topk: teacher ids kept per position", min=1)
    samples: int = option(32, "mode=sample: draws from the teacher per position (kept as distinct ids + counts)", min=1)
    temperature: float = option(1.0, "teacher temperature the targets are captured at (the distill run uses it)",
                                above=0)
    data: str = same_as(TrainConfig, "data")
    tokenizer: str = same_as(TrainConfig, "tokenizer")
    steps: int = same_as(TrainConfig, "steps")
    seed: int = same_as(TrainConfig, "seed")
    batch_size: int = same_as(TrainConfig, "batch_size")
    block_size: int = same_as(TrainConfig, "block_size")
    grad_accum: int = same_as(TrainConfig, "grad_accum")
    device: str = same_as(TrainConfig, "device")
    dtype: str = same_as(TrainConfig, "dtype")


def _id_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2 ** 16 else "int32"


def _layout(meta: dict) -> dict:
    """``{file stem: (dtype, shape)}`` of a cache described by ``meta``."""
    lead, width = [meta["steps"], *meta["x_shape"]], meta["width"]
    if meta["mode"] == "topk":
        return {"ids": (meta["id_dtype"], lead + [width]), "logprobs": ("float16", lead + [width]),
                "missing": ("float32", lead)}
    return {"ids": (meta["id_dtype"], lead + [width]), "counts": ("uint16", lead + [width])}


def bytes_per_position(meta: dict) -> int:
    return sum(np.dtype(dt).itemsize * int(np.prod(shape[1 + len(meta["x_shape"]):]))
               for dt, shape in _layout(meta).values())


class TeacherCache:
    """A built cache opened read-only: ``targets(cursor)`` gives the batch entries the KD loss reads."""

    def __init__(self, path: Path, meta: dict, arrays: dict):
        self.path, self.meta, self.arrays, self.mode = path, meta, arrays, meta["mode"]

    @classmethod
    def open(cls, path) -> "TeacherCache":
        path = Path(path).expanduser()
        try:
            meta = cache.read_meta(path)
        except cache.CacheError:
            raise UserError(f"cache={path}: not a teacher cache (no readable meta.json); build one with "
                            f"recipe=distill_cache") from None
        if meta.get("format") != FORMAT:
            raise UserError(f"cache={path}: not a teacher cache of format {FORMAT} (meta.json says "
                            f"{meta.get('format')})")
        try:
            meta, arrays = cache.read_folder(path, _layout)
        except cache.CacheError as e:
            raise UserError(f"cache={path}: {e}; rebuild it with recipe=distill_cache") from None
        return cls(path, meta, arrays)

    def describe(self) -> str:
        what = f"top-{self.meta['width']}" if self.mode == "topk" else f"{self.meta['width']}-sample"
        return f"{what} cache {self.path} (T={self.meta['temperature']:g}, {self.meta['steps']} steps)"

    def check_run(self, cfg, teacher_id: dict, data_id: dict):
        """A one-line UserError unless this cache was built for ``cfg``'s batches, teacher and data."""
        m = self.meta
        wrong = [f"{k}: cache {m[k]}, run {getattr(cfg, k)}" for k in RUN_KEYS if m[k] != getattr(cfg, k)]
        if cfg.steps > m["steps"]:
            wrong.append(f"steps: cache covers {m['steps']}, run needs {cfg.steps}")
        if m["data"] != data_id:
            wrong.append(f"data: cache {m['data']['source']} ({m['data']['tokens']}), run {data_id['source']} "
                         f"({data_id['tokens']})")
        if m["teacher"]["fingerprint"] != teacher_id["fingerprint"]:
            held = held_dtype_hint(m["teacher"], teacher_id)
            wrong.append(f"teacher: {held}" if held else
                         f"teacher: cache {m['teacher']['source']} (weights {m['teacher']['fingerprint']}), "
                         f"run {teacher_id['source']} (weights {teacher_id['fingerprint']})")
        if wrong:
            raise UserError(f"cache={self.path} does not match this run: {'; '.join(wrong)}; rebuild it with "
                            f"recipe=distill_cache and the run's settings")
        if cfg.temperature_mode != "fixed":
            raise UserError(f"cache={self.path}: cached targets fix the teacher at T={m['temperature']:g}; use "
                            f"temperature_mode=fixed (or the online teacher)")
        check_divergence(cfg, self.mode, self.path)

    def targets(self, cursor: int, device=None) -> dict:
        def tensor(stem, dtype=None):
            a = np.asarray(self.arrays[stem][cursor])
            return torch.from_numpy(a.astype(dtype) if dtype else a.copy()).to(device)
        if self.mode == "topk":
            return {"topk_ids": tensor("ids", np.int64), "topk_logprobs": tensor("logprobs"),
                    "topk_missing": tensor("missing")}
        return {"sample_ids": tensor("ids", np.int64), "sample_counts": tensor("counts", np.int32)}


def check_divergence(cfg, mode: str, path) -> None:
    """A ConfigError naming ``kl=`` and the cache unless a ``mode`` cache gives ``cfg.kl``: top-k gives the forward KL
    and the generalized JSD over its k ids and an "other" bucket (``models.losses.topk_kd_loss``), short of beta = 1
    (the reverse KL, infinite wherever the cached missing mass rounded to 0); a sampled cache gives the forward KL's
    gradient only (soft-target CE over the drawn ids: it holds no teacher probabilities for a mixture or a reverse
    KL)."""
    if cfg.kl == "forward" or (mode == "topk" and cfg.kl == "jsd" and cfg.beta < 1):
        return
    what = f"kl={cfg.kl}" + (f" beta={cfg.beta:g}" if cfg.kl == "jsd" else "")
    if mode == "topk":
        gives = "forward KL and kl=jsd with beta < 1 (over the k ids and the missing mass)"
    else:
        gives = "the forward KL only (counts of drawn ids, not the teacher's probabilities)"
    raise ConfigError(f"{what} with cache={path}: a {mode} cache gives {gives}; choose one of those or distill "
                      f"online (drop cache=)")


# ---------------------------------------------------------------------------------------------- building

def _check(cfg: Config, vocab_size: int):
    if not cfg.out:
        raise UserError("recipe=distill_cache needs out=PATH (the cache folder to write)")
    if cfg.temperature <= 0:
        raise UserError("temperature must be > 0")
    if cfg.mode == "topk" and not 1 <= cfg.k <= vocab_size:
        raise UserError(f"bad value for 'k': {cfg.k}; it must be in [1, {vocab_size}] (the teacher's vocabulary)")
    if cfg.mode == "sample" and not 1 <= cfg.samples < 2 ** 16:
        raise UserError(f"bad value for 'samples': {cfg.samples}; it must be in [1, 65535]")


def run(cfg: Config) -> TeacherCache:
    device = resolve_device(cfg.device)
    teacher = load_teacher(cfg.teacher, device, cfg.teacher_dtype, recipe="distill_cache")
    tcfg = teacher.config
    _check(cfg, tcfg.vocab_size)
    corpus, tok = teacher_data(teacher, cfg.tokenizer, cfg.data)
    batches = corpus.batches(cfg.batch_size, cfg.block_size, cfg.seed, grad_accum=cfg.grad_accum, device=device)
    x_shape = list(batches.get(0)["x"].shape)
    meta = {"format": FORMAT, "mode": cfg.mode, "width": cfg.k if cfg.mode == "topk" else cfg.samples,
            "id_dtype": _id_dtype(tcfg.vocab_size), "x_shape": x_shape, "steps": cfg.steps,
            "batch_size": cfg.batch_size, "block_size": cfg.block_size, "seed": cfg.seed,
            "grad_accum": cfg.grad_accum, "temperature": cfg.temperature, "dtype": cfg.dtype,
            "teacher": teacher_identity(teacher), "data": data_identity(corpus),
            "vocab_size": tcfg.vocab_size, "tokenizer": tok.name}   # its identity is in the data's token cache key
    out = Path(cfg.out).expanduser()
    if out.exists():
        try:
            existing = TeacherCache.open(out)
        except UserError:
            existing = None
        if existing is not None and existing.meta == meta:
            progress(f"distill_cache: {out} already holds this cache; nothing to do")
            return existing
        raise UserError(f"out={out} already exists (and is not this cache); remove it or choose another out=")

    layout = _layout(meta)
    tokens = cfg.steps * int(np.prod(x_shape))
    per_token = bytes_per_position(meta)
    progress(f"distill_cache: teacher {teacher.format}: {teacher.source}; {cfg.mode} "
          f"({'k' if cfg.mode == 'topk' else 'samples'}={meta['width']}, T={cfg.temperature:g}) over {cfg.steps} "
          f"batches of {x_shape} = {tokens:,} tokens; {per_token} B/token, {per_token * tokens / 1e6:.1f} MB")
    def build(builder: cache.FolderBuilder) -> dict:
        _fill(cfg, teacher, batches, {stem: builder.array(stem, dt, shape) for stem, (dt, shape) in layout.items()},
              device)
        return meta

    cache.build_folder(out, build)
    size = sum(f.stat().st_size for f in out.iterdir())
    progress(f"distill_cache: wrote {out}: {size / 1e6:.2f} MB for {tokens:,} tokens = {per_token} bytes/token")
    return TeacherCache.open(out)


def _fill(cfg: Config, teacher, batches, arrays: dict, device):
    """Teacher forward per cursor, sparse targets into the memmaps; progress every few seconds."""
    t0 = last = time.monotonic()
    tcfg = teacher.config
    for cursor in range(cfg.steps):
        x = batches.get(cursor)["x"]
        with torch.no_grad(), autocast(cfg.dtype, device.type):
            logits = llama.apply(teacher.params, x.reshape(-1, x.shape[-1]), tcfg)
        logits = logits.reshape(*x.shape, -1)
        if cfg.mode == "topk":
            ids, logprobs, missing = losses.teacher_topk(logits, cfg.k, cfg.temperature)
            arrays["logprobs"][cursor] = logprobs.to(torch.float16).cpu().numpy()
            arrays["missing"][cursor] = missing.float().cpu().numpy()
        else:
            gen = torch.Generator(device).manual_seed(cfg.seed * 1_000_003 + cursor)
            ids, counts = losses.sample_teacher(logits, cfg.samples, cfg.temperature, generator=gen)
            arrays["counts"][cursor] = counts.cpu().numpy().astype(np.uint16)
        arrays["ids"][cursor] = ids.cpu().numpy().astype(arrays["ids"].dtype)
        now = time.monotonic()
        if now - last >= 5.0 or cursor + 1 == cfg.steps:
            last = now
            rate = (cursor + 1) / max(now - t0, 1e-9)
            progress(f"distill_cache: {cursor + 1}/{cfg.steps} batches, {now - t0:.0f}s, "
                     f"eta {(cfg.steps - cursor - 1) / rate:.0f}s")
