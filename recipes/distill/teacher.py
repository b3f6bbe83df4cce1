"""The teacher side of distillation, shared by ``recipe=distill`` (``recipes/distill/recipe.py``) and
``recipe=distill_cache`` (``recipes/distill/cache.py``): loading the teacher, tokenizing the data with its
tokenizer, and the identities a cache and a resumed run are checked against. ``upcycle`` and ``compress``
load their frozen teachers through :func:`load_teacher` too, so ``teacher_dtype=`` means the same everywhere.

``teacher_dtype=auto`` holds a frozen teacher in bfloat16 on CUDA (half the memory and bandwidth, tensor-core
matmuls, as Hugging Face's ``torch_dtype=torch.bfloat16``) and elsewhere in the dtype it is stored in, half
types widened to float32, as every teacher was held before this key (a CPU run's numbers stay the same, and a
CPU without bf16 matmul instructions runs bf16 slower). On a CPU that has them (AMX/AVX512-BF16, as this
repository's box) ``teacher_dtype=bf16`` is the faster choice: it runs SmolLM2-135M's forward several times as
fast as fp32 (docs/distill.md, on ``teacher_dtype``). The params are cast once at load, on the host, then moved;
``models.llama`` keeps norms and ``models.losses`` the softmaxes in float32 whatever the dtype.
"""
from __future__ import annotations

import os

import torch

from purestep.core.config import UserError, option
from purestep.core.parallel.distributed import Dist
from purestep.core.data.documents import prepare_text
from purestep.core.tree import cast, fingerprint
from purestep.models import llama
from purestep.models.loading import LoadedModel, load_model
from purestep.recipes.train.config import TrainConfig
from purestep.recipes.train.data import open_data
from purestep.recipes.train.setup import sharded_layout


def teacher_option():
    """The ``teacher=`` key of both recipes."""
    return option("", "teacher: checkpoint or run folder, Hugging Face folder, .gguf, or 'smollm2'")


TEACHER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def teacher_dtype_option():
    """The ``teacher_dtype=`` key of every recipe with a frozen teacher (distill, distill_cache, upcycle,
    compress, and sharded training)."""
    return option("auto", "dtype the frozen teacher is held and run in: auto (bf16 on CUDA, else as stored, "
                          "half types widened to fp32), fp32 or bf16", choices=("auto", *TEACHER_DTYPES))


def resolve_teacher_dtype(choice: str, device_type: str, stored: torch.dtype) -> torch.dtype:
    """The dtype ``teacher_dtype=choice`` means on a ``device_type`` device for a teacher stored in ``stored``."""
    if choice in TEACHER_DTYPES:
        return TEACHER_DTYPES[choice]
    if choice != "auto":
        raise UserError(f"teacher_dtype={choice}: expected auto, {', '.join(TEACHER_DTYPES)}")
    return torch.bfloat16 if device_type == "cuda" else llama.upcast(stored)


def load_teacher(path: str, device, teacher_dtype: str = "auto", recipe: str = "distill") -> LoadedModel:
    """The teacher as a ``LoadedModel``, its params cast once to ``teacher_dtype`` (see the module docstring;
    a missing or unreadable path is a one-line UserError)."""
    if not path:
        raise UserError(f"recipe={recipe} needs teacher=PATH (a checkpoint or run folder, a Hugging Face folder, "
                        "a .gguf file, or 'smollm2')")
    loaded = load_model(path, dtype=None)       # on the host as stored: one move to the device, already cast
    device_type = torch.device(device).type if device is not None else "cpu"
    dtype = resolve_teacher_dtype(teacher_dtype, device_type, loaded.params["embed"].dtype)
    loaded.params = cast(loaded.params, dtype, device)
    return loaded


def compute_view(params: dict) -> dict:
    """``params`` widened to at least float32 (no copy when they already are): for the statistics and linear
    algebra that must not run in a half type (upcycle's surgery, a student initialized from teacher weights)."""
    return cast(params, llama.upcast(params["embed"].dtype))


def tokenizer_for(teacher, spec: str):
    """The teacher's tokenizer; ``tokenizer=`` only for a teacher stored without one."""
    if teacher.tokenizer is None:
        return spec
    if spec != TrainConfig.tokenizer:
        raise UserError(f"tokenizer={spec}: distillation uses the teacher's own tokenizer "
                        f"({teacher.tokenizer.name}); leave tokenizer unset")
    return teacher.tokenizer


def teacher_identity(teacher) -> dict:
    """Source, format and a hash of the weights as held (so a bf16 teacher's cache is not an fp32 teacher's)."""
    return {"source": teacher.source, "format": teacher.format, "fingerprint": fingerprint(teacher.params),
            "dtype": str(teacher.params["embed"].dtype).removeprefix("torch.")}


def held_dtype_hint(old: dict, new: dict) -> str:
    """``held in bfloat16 (teacher_dtype=bf16) there, in float32 here`` when the two identities name one
    source held in two dtypes (empty otherwise)."""
    if not old.get("dtype") or old["dtype"] == new["dtype"] or old.get("source") != new["source"]:
        return ""
    names = {str(v).removeprefix("torch."): k for k, v in TEACHER_DTYPES.items()}
    setting = f" (teacher_dtype={names[old['dtype']]})" if old["dtype"] in names else ""
    return f"held in {old['dtype']}{setting} there, in {new['dtype']} here"


def data_identity(corpus) -> dict:
    """What a cache must match of the data: the token cache key (files, sizes, mtimes, tokenizer) and length."""
    return {"source": corpus.meta["source"], "tokens": os.path.basename(corpus.path),
            "train_tokens": int(corpus.meta["train_tokens"])}


def teacher_data(teacher, tokenizer_spec: str, data: str, cfg=None):
    """``(corpus, tokenizer)``: ``data`` tokenized with the teacher's tokenizer, checked against its vocab; with
    a training ``cfg``, its JSONL keys apply (``recipes.train.data.open_data``), else JSONL is read as rendered
    text (``core.data.documents.prepare_text``)."""
    tok = tokenizer_for(teacher, tokenizer_spec)
    corpus = open_data(cfg, tok) if cfg is not None else prepare_text(data, tok)
    tok = corpus.tokenizer
    if tok.vocab_size > teacher.config.vocab_size:
        raise UserError(f"teacher {teacher.source}: its vocabulary ({teacher.config.vocab_size}) is smaller "
                        f"than the tokenizer's ({tok.vocab_size})")
    return corpus, tok


def shard_teacher(shard: bool, dist: Dist, teacher: LoadedModel):
    """``({"teacher": params}, layout)``: the frozen inputs of the train step, this rank's shards of the teacher
    when ``shard`` (``teacher_shard=true``: ``core.parallel.shard``, no optimizer state), else the whole teacher and
    None."""
    if not shard:
        return {"teacher": teacher.params}, None
    if not dist.sharded:
        raise UserError("teacher_shard=true shards the teacher across the ranks of parallel=fsdp; add parallel=fsdp "
                        "(under torchrun) or drop teacher_shard")
    layout = sharded_layout(dist, teacher.params, lambda p: (), "fp32")
    return {"teacher": layout.shard_params(teacher.params)}, layout
