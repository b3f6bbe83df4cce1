"""The teacher side of distillation, shared by ``recipe=distill`` (``recipes/distill/recipe.py``) and
``recipe=distill_cache`` (``recipes/distill/cache.py``): loading the teacher, tokenizing the data with its
tokenizer, and the identities a cache and a resumed run are checked against.
"""
from __future__ import annotations

import os

from core.config import UserError, option
from core.data import prepare
from core.tree import fingerprint
from models.loading import LoadedModel, load_model
from recipes.train.config import TrainConfig


def teacher_option():
    """The ``teacher=`` key of both recipes."""
    return option("", "teacher: checkpoint or run folder, Hugging Face folder, .gguf, or 'smollm2'")


def load_teacher(path: str, device) -> LoadedModel:
    """The teacher as a ``LoadedModel`` (a missing or unreadable path is a one-line UserError)."""
    if not path:
        raise UserError("recipe=distill needs teacher=PATH (a checkpoint or run folder, a Hugging Face folder, "
                        "a .gguf file, or 'smollm2')")
    return load_model(path, device=device)


def tokenizer_for(teacher, spec: str):
    """The teacher's tokenizer; ``tokenizer=`` only for a teacher stored without one."""
    if teacher.tokenizer is None:
        return spec
    if spec != TrainConfig.tokenizer:
        raise UserError(f"tokenizer={spec}: distillation uses the teacher's own tokenizer "
                        f"({teacher.tokenizer.name}); leave tokenizer unset")
    return teacher.tokenizer


def teacher_identity(teacher) -> dict:
    return {"source": teacher.source, "format": teacher.format, "fingerprint": fingerprint(teacher.params)}


def data_identity(corpus) -> dict:
    """What a cache must match of the data: the token cache key (files, sizes, mtimes, tokenizer) and length."""
    return {"source": corpus.meta["source"], "tokens": os.path.basename(corpus.path),
            "train_tokens": int(corpus.meta["train_tokens"])}


def teacher_data(teacher, tokenizer_spec: str, data: str):
    """``(corpus, tokenizer)``: ``data`` tokenized with the teacher's tokenizer, checked against its vocab."""
    corpus = prepare(data, tokenizer_for(teacher, tokenizer_spec))
    tok = corpus.tokenizer
    if tok.vocab_size > teacher.config.vocab_size:
        raise UserError(f"teacher {teacher.source}: its vocabulary ({teacher.config.vocab_size}) is smaller "
                        f"than the tokenizer's ({tok.vocab_size})")
    return corpus, tok
