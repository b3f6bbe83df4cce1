"""Offline teacher cache: ``purestep recipe=distill_cache teacher=PATH out=CACHE``, then ``recipe=distill cache=CACHE``.

Runs the teacher once over the training batches a distill run will see (``batches.get(cursor)`` for cursor
0 .. steps-1 with the same data, seed, batch_size, block_size and grad_accum, so the cache is keyed by
cursor) and stores a sparse signal per position, since full logits are out of reach (1B tokens x 128k
vocab x 2 B = 256 TB):

- ``mode=topk``: the teacher's k most likely ids, their log-probs (fp16) and the missing mass
  1 - sum(top-k p) (fp32), used as an "other" bucket by ``models.losses.topk_kd_loss``
  (DistillKit ``distillkit/lossfuncs/kl.py``; MaxText-KD);
- ``mode=topk_packed`` (the default): the same targets, compact (``recipes.distill.packing``): ids bit-packed to
  ceil(log2 V) bits, log-probs as ``value_bits``-bit codes on a per-position scale, two fp16 numbers per position
  (100 bytes/token at k=32 over SmolLM2's vocabulary against 132), decoded to the top-k targets when read; at 8 bits
  its rounding adds KL of the same order as fp16's (SmolLM2: docs/distill.md, "Offline teacher");
- ``mode=sample``: Random-Sampling KD (Anshumann et al., ACL 2025): ``samples`` ids drawn from the teacher
  with replacement, stored as distinct ids + uint16 counts (``models.losses.sample_teacher``); unbiased,
  unlike top-k.

Ids are uint16 when the vocabulary fits (as ``core.data.text`` stores tokens), else int32. Targets are
captured at ``temperature``, which the distill run must use (a softened top-k cannot be re-softened
exactly). A top-k build measures what its cache loses of the full teacher distribution
(``models.losses.cache_kl``): the mean KL that rounding the stored values adds over the k + 1 outcomes the loss sees
(``kl_rounding``: what the format adds) and the mean KL of the teacher's tail from an even spread of the missing
mass (``kl_truncation``: what keeping k ids loses); it prints both and keeps them in ``meta.json``.

Layout: ``meta.json`` (format, mode, k/samples, dtypes and shapes, batch/block/seed/grad_accum/steps, temperature,
teacher identity with a hash of its weights, data identity) and one raw numpy memmap per array (``ids.bin``,
``logprobs.bin``, ``missing.bin``; ``ids.bin``, ``codes.bin``, ``scale.bin`` packed; or ``ids.bin``,
``counts.bin``) of shape
``[steps, *batch_x_shape, width]``. It is written by ``core.io.cache.build_folder`` (a temporary folder next to
``out``, renamed into place), so an interrupted build never leaves a cache that a run would trust.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from purestep.core.io import cache
from purestep.core.config import ConfigError, UserError, option, same_as
from purestep.core.device import resolve_device
from purestep.core.gradients import autocast
from purestep.core.io.logging import progress
from purestep.models import llama, losses
from purestep.models.loading import require_llama
from purestep.recipes.distill import packing
from purestep.recipes.distill.teacher import (data_identity, held_dtype_hint, load_teacher, teacher_data,
                                     teacher_dtype_option, teacher_identity, teacher_option)
from purestep.recipes.train.config import TrainConfig

DESCRIPTION = "run a teacher once over a distill run's batches and cache top-k or sampled targets"

FORMAT = "purestep-kd-cache-1"
MODES = ("topk", "topk_packed", "sample")
TOPK = ("topk", "topk_packed")           # the modes whose targets are top-k ids, log-probs and missing mass
MEASURED = ("kl_rounding", "kl_truncation")   # meta.json keys a build measures (not settings a run must match)
RUN_KEYS = ("batch_size", "block_size", "seed", "grad_accum", "temperature")


@dataclass
class Config:
    teacher: str = teacher_option()
    teacher_dtype: str = teacher_dtype_option()
    out: str = option("", "cache folder to write (required; built in a temporary folder, then renamed)")
    mode: str = option("topk_packed", "topk_packed (top-k ids bit-packed, log-probs in value_bits-bit codes, the "
                                      "missing mass), topk (the same in fp16/int, 1.3x the bytes) or sample "
                                      "(Random-Sampling KD ids + counts)", choices=MODES)
    k: int = option(32, "mode=topk|topk_packed: teacher ids kept per position", min=1)
    value_bits: int = option(8, "mode=topk_packed: bits per log-prob code (a per-position linear scale)", min=2,
                             max=16)
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
    if meta["mode"] == "topk_packed":
        return {"ids": ("uint8", lead + [packing.packed_width(width, meta["id_bits"])]),
                "codes": ("uint8", lead + [packing.packed_width(width, meta["value_bits"])]),
                "scale": ("float16", lead + [2])}
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
        what = (f"{self.meta['width']}-sample" if self.mode == "sample" else f"top-{self.meta['width']}"
                + (f" packed ({self.meta['value_bits']}-bit values)" if self.mode == "topk_packed" else ""))
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

        def unpacked(stem, bits):
            a = packing.unpack_bits(np.asarray(self.arrays[stem][cursor]), bits, self.meta["width"])
            return torch.from_numpy(a).to(device)
        if self.mode == "topk_packed":
            ids, codes = unpacked("ids", self.meta["id_bits"]), unpacked("codes", self.meta["value_bits"])
            logprobs, missing = packing.dequantize(codes, tensor("scale"))
            return {"topk_ids": ids, "topk_logprobs": logprobs, "topk_missing": missing}
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
    if cfg.kl == "forward" or (mode in TOPK and cfg.kl == "jsd" and cfg.beta < 1):
        return
    what = f"kl={cfg.kl}" + (f" beta={cfg.beta:g}" if cfg.kl == "jsd" else "")
    if mode in TOPK:
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
    if cfg.mode in TOPK and not 1 <= cfg.k <= vocab_size:
        raise UserError(f"bad value for 'k': {cfg.k}; it must be in [1, {vocab_size}] (the teacher's vocabulary)")
    if cfg.mode == "sample" and not 1 <= cfg.samples < 2 ** 16:
        raise UserError(f"bad value for 'samples': {cfg.samples}; it must be in [1, 65535]")


def run(cfg: Config) -> TeacherCache:
    device = resolve_device(cfg.device)
    teacher = require_llama(load_teacher(cfg.teacher, device, cfg.teacher_dtype, recipe="distill_cache"), "teacher",
                            "distill_cache")
    tcfg = teacher.config
    _check(cfg, tcfg.vocab_size)
    corpus, tok = teacher_data(teacher, cfg.tokenizer, cfg.data)
    batches = corpus.batches(cfg.batch_size, cfg.block_size, cfg.seed, grad_accum=cfg.grad_accum, device=device)
    x_shape = list(batches.get(0)["x"].shape)
    meta = {"format": FORMAT, "mode": cfg.mode, "width": cfg.k if cfg.mode in TOPK else cfg.samples,
            "id_dtype": _id_dtype(tcfg.vocab_size), "x_shape": x_shape, "steps": cfg.steps,
            "batch_size": cfg.batch_size, "block_size": cfg.block_size, "seed": cfg.seed,
            "grad_accum": cfg.grad_accum, "temperature": cfg.temperature, "dtype": cfg.dtype,
            "teacher": teacher_identity(teacher), "data": data_identity(corpus),
            "vocab_size": tcfg.vocab_size, "tokenizer": tok.name}   # its identity is in the data's token cache key
    if cfg.mode == "topk_packed":
        meta.update(id_bits=packing.id_bits(tcfg.vocab_size), value_bits=cfg.value_bits)
    out = Path(cfg.out).expanduser()
    if out.exists():
        try:
            existing = TeacherCache.open(out)
        except UserError:
            existing = None
        settings = existing and {k: v for k, v in existing.meta.items() if k not in MEASURED}
        if settings == meta:
            progress(f"distill_cache: {out} already holds this cache; nothing to do")
            return existing
        raise UserError(f"out={out} already exists (and is not this cache); remove it or choose another out=")

    layout = _layout(meta)
    tokens = cfg.steps * int(np.prod(x_shape))
    per_token = bytes_per_position(meta)
    progress(f"distill_cache: teacher {teacher.format}: {teacher.source}; {cfg.mode} "
          f"({'samples' if cfg.mode == 'sample' else 'k'}={meta['width']}, T={cfg.temperature:g}) over {cfg.steps} "
          f"batches of {x_shape} = {tokens:,} tokens; {per_token} B/token, {per_token * tokens / 1e6:.1f} MB")
    def build(builder: cache.FolderBuilder) -> dict:
        lost = _fill(cfg, teacher, batches, {stem: builder.array(stem, dt, shape) for stem, (dt, shape)
                                             in layout.items()}, device)
        return {**meta, **lost}

    cache.build_folder(out, build)
    built = TeacherCache.open(out)
    size = sum(f.stat().st_size for f in out.iterdir())
    lost = (f"; against the full teacher it adds a mean KL of {built.meta['kl_rounding']:.3g} nats/token by rounding "
            f"(over the k ids and the rest), and its tail spread evenly {built.meta['kl_truncation']:.3g}"
            if "kl_rounding" in built.meta else "")
    progress(f"distill_cache: wrote {out}: {size / 1e6:.2f} MB for {tokens:,} tokens = {per_token} bytes/token"
             f"{lost}")
    return built


def _fill(cfg: Config, teacher, batches, arrays: dict, device) -> dict:
    """Teacher forward per cursor, sparse targets into the memmaps; progress every few seconds. Returns a top-k
    cache's mean ``kl_rounding`` and ``kl_truncation`` over its positions (module docstring; none for a sampled
    one)."""
    t0 = last = time.monotonic()
    tcfg, sums, positions = teacher.config, torch.zeros(2, dtype=torch.float64), 0
    for cursor in range(cfg.steps):
        x = batches.get(cursor)["x"]
        with torch.no_grad(), autocast(cfg.dtype, device.type):
            logits = llama.apply(teacher.params, x.reshape(-1, x.shape[-1]), tcfg)
        logits = logits.reshape(*x.shape, -1)
        if cfg.mode in TOPK:
            log_p = losses.tempered_log_probs(logits, cfg.temperature)     # once: the targets and what they lose
            ids, logprobs, missing = losses.topk_targets(log_p, cfg.k)
            stored = _store_topk(cfg, arrays, cursor, tcfg.vocab_size, ids, logprobs, missing)
            rounding, truncation = losses.cache_kl(log_p, ids, *stored)
            sums += torch.stack([rounding.double().sum(), truncation.double().sum()]).cpu()
            positions += rounding.numel()
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
    if not positions:
        return {}
    rounding, truncation = (sums / positions).tolist()
    return {"kl_rounding": rounding, "kl_truncation": truncation}


def _store_topk(cfg: Config, arrays: dict, cursor: int, vocab_size: int, ids, logprobs, missing) -> tuple:
    """Writes one batch's top-k targets in ``cfg.mode``'s layout; returns ``(logprobs, missing)`` as a run will
    read them back (rounded as stored)."""
    if cfg.mode == "topk_packed":
        codes, scale = packing.quantize(logprobs, cfg.value_bits)
        arrays["ids"][cursor] = packing.pack_bits(ids.cpu().numpy(), packing.id_bits(vocab_size))
        arrays["codes"][cursor] = packing.pack_bits(codes.cpu().numpy(), cfg.value_bits)
        arrays["scale"][cursor] = scale.cpu().numpy()
        return packing.dequantize(codes, scale)
    arrays["ids"][cursor] = ids.cpu().numpy().astype(arrays["ids"].dtype)
    arrays["logprobs"][cursor] = logprobs.to(torch.float16).cpu().numpy()
    arrays["missing"][cursor] = missing.float().cpu().numpy()
    return logprobs.to(torch.float16).float(), missing.float()
