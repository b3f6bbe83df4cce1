"""The data keys every training recipe shares, applied once: which corpus ``data=`` names (raw text or JSONL,
``core.data.documents.prepare_data``) and how many steps ``epochs=`` means."""
from __future__ import annotations

import math
from dataclasses import replace

from purestep.core.config import ConfigError
from purestep.core.device import check_fits
from purestep.core.data.documents import DocCorpus, prepare_data

MAX_STEPS = 2**63 - 1          # the train state's step and data cursor are int64 tensors


def open_data(cfg, tokenizer):
    """The corpus of ``cfg.data`` (``tokenizer``: a spec or a tokenizer object, e.g. ``init=``'s), with the
    JSONL keys ``text_field``, ``loss_on``, ``pack``, ``val_fraction`` and ``val_data``."""
    return prepare_data(cfg.data, tokenizer, text_field=cfg.text_field, loss_on=cfg.loss_on, pack=cfg.pack,
                        val_fraction=cfg.val_fraction, val_data=cfg.val_data)


def check_batch(cfg, vocab: int, device, world_size: int = 1) -> None:
    """Refuse a ``batch_size`` x ``block_size`` whose logits alone (fp32, for the loss; the validation batch is
    ``world_size`` micro-batches) exceed the device's memory (``core.device.check_fits``)."""
    check_fits(f"batch_size={cfg.batch_size} x block_size={cfg.block_size} (its logits: x vocab {vocab:,} x 4 bytes"
               + (f" x {world_size} ranks' validation rows" if world_size > 1 else "") + ")",
               cfg.batch_size * world_size * cfg.block_size * vocab * 4, device)


def with_epochs(cfg, corpus, batches):
    """``cfg`` with ``steps`` set from ``epochs`` when it is > 0: rows of the epoch over the global batch (JSONL),
    or train tokens over the tokens of a step (raw text, whose batches are random windows)."""
    if cfg.epochs <= 0:
        return cfg
    if hasattr(batches, "steps_for"):
        steps = batches.steps_for(cfg.epochs)
    else:
        per_step = cfg.batch_size * cfg.block_size * cfg.grad_accum * batches.world_size
        steps = max(1, math.ceil(cfg.epochs * corpus.meta["train_tokens"] / per_step))
    if steps > MAX_STEPS:
        raise ConfigError(f"bad value for 'epochs': epochs={cfg.epochs:g} is {steps:.3g} steps, more than a run's "
                          f"step counter holds ({MAX_STEPS:.3g}); give fewer epochs")
    return replace(cfg, steps=steps)


def describe(corpus) -> str:
    """``<source>: N train / M val tokens`` (and the documents and skipped chats of JSONL)."""
    m = corpus.meta
    text = f"{m['source']}: {m['train_tokens']:,} train / {m['val_tokens']:,} val tokens"
    if isinstance(corpus, DocCorpus):
        text += (f" ({m['train_documents']:,} / {m['val_documents']:,} documents, pack={corpus.pack}, "
                 f"loss_on={'assistant' if corpus.assistant else 'all'}")
        text += f"; {m['skipped']:,} without an assistant turn skipped)" if m["skipped"] else ")"
    return text
