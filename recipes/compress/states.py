"""Teacher hidden states for ``recipe=compress``: fixed windows of text, computed on the fly or cached.

A *state set* is the hidden states of one teacher layer over ``n`` fixed windows of ``block_size`` tokens,
``[n, T, D]``. The windows are evenly spaced over a split of the corpus (``core.data.text.eval_batches``: the
same windows every time), so a set is a pure function of (teacher weights, layer, corpus, split, n, T):

- ``cache=true``: computed once into a raw float32 memmap under ``$PURESTEP_CACHE/states/<name>-<key>/``
  (``states.bin`` + ``meta.json``; the key hashes those inputs, the teacher by a SHA-256 of its weights),
  built atomically by ``core.io.cache.build_folder`` (as ``core.data.text``'s token cache is). Every
  width of a sweep and every later run with the same inputs reads it instead of running the teacher.
- ``cache=false``: :class:`TeacherStates` runs the teacher (under ``torch.no_grad``) each time windows
  are asked for; nothing is written. Same numbers, teacher cost on every batch.

Hidden state ``layer`` is index ``layer`` of ``models.llama.apply(..., return_hidden=True)``'s list: 0 is
the embeddings, ``i`` the input of block ``i``, ``L`` (= ``-1``) the last block's output (before the final
norm). Only the first ``layer`` blocks run, and the logits are skipped (see :class:`Teacher`).
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from purestep.core.io.cache import FolderBuilder, open_or_build
from purestep.core.config import UserError
from purestep.core.data.text import cache_root, eval_batches
from purestep.core.tree import fingerprint, tree_map
from purestep.core.io.logging import progress
from purestep.models import llama
from purestep.models.compressor import Moments
from purestep.models.loading import require_llama
from purestep.recipes.distill.teacher import load_teacher

FORMAT = "purestep-states-1"


def resolve_layer(layer: int, n_layers: int) -> int:
    """``layer`` as an index into the ``n_layers + 1`` hidden states (negative counts from the end)."""
    if not -(n_layers + 1) <= layer <= n_layers:
        raise UserError(f"layer={layer}: the teacher has {n_layers} blocks, so its hidden states are "
                        f"layer=0..{n_layers} (0 the embeddings, {n_layers} or -1 the last block's output)")
    return layer % (n_layers + 1)


class Teacher:
    """A frozen Llama teacher cut after block ``layer``: ``states(tokens) -> [B, T, D]``."""

    def __init__(self, path: str, layer: int, device, teacher_dtype: str = "auto"):
        loaded = require_llama(load_teacher(path, device, teacher_dtype, recipe="compress"), "teacher",
                               "compress")                                  # states() returns float32 anyway
        if loaded.tokenizer is None:
            raise UserError(f"teacher={path}: it has no tokenizer to turn the text into its tokens")
        self.source, self.format, self.tokenizer = loaded.source, loaded.format, loaded.tokenizer
        self.n_layers, self.d_model = loaded.config.n_layers, loaded.config.d_model
        self.layer = resolve_layer(layer, self.n_layers)
        self.fingerprint = fingerprint(loaded.params)
        # only the blocks up to `layer` run, and no head (a 49k-vocab SmolLM2 spends a fifth of its forward there)
        self.params = dict(loaded.params, layers=tree_map(lambda t: t[:self.layer], loaded.params["layers"]))
        self.config = replace(loaded.config, n_layers=self.layer)

    def states(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return llama.apply(self.params, tokens, self.config, return_hidden="only")[-1].float()

    def identity(self) -> dict:
        return {"source": self.source, "format": self.format, "fingerprint": self.fingerprint, "layer": self.layer}


# ---------------------------------------------------------------------------------------------- state sets

@dataclass
class Windows:
    """``n`` evenly spaced windows of ``T`` tokens over one split of a corpus."""
    tokens: np.ndarray
    starts: np.ndarray           # [n]
    block_size: int
    description: str

    @classmethod
    def over(cls, tokens, n: int, block_size: int, description: str) -> "Windows":
        starts = eval_batches(tokens, 1, block_size, n, source=description).starts[:, 0]
        return cls(tokens, starts, block_size, description)

    def __len__(self) -> int:
        return len(self.starts)

    def get(self, idx, device=None) -> torch.Tensor:
        rows = np.asarray(self.tokens[self.starts[np.asarray(idx)][:, None] + np.arange(self.block_size)])
        return torch.from_numpy(rows.astype(np.int64)).to(device)


def chunks(states) -> Iterator[torch.Tensor]:
    """A pass over all of a state set (``StoredStates`` or ``TeacherStates``), ``states.chunk`` windows at a time."""
    for i in range(0, states.n, states.chunk):
        yield states.get(np.arange(i, min(i + states.chunk, states.n)))


def moments(states) -> Moments:
    """Mean and second moments of a state set (what PCA and the loss scale need)."""
    m = None
    parts = _progress(chunks(states), states, "computing") if isinstance(states, TeacherStates) else chunks(states)
    for x in parts:
        m = (m or Moments(x.shape[-1])).add(x)
    return m


class StoredStates:
    """States ``[n, T, D]`` held in an array (a memmap from the cache, or a tensor in memory)."""

    def __init__(self, array, device, chunk: int = 16):
        self.array, self.device, self.n, self.chunk = array, device, len(array), chunk

    def get(self, idx) -> torch.Tensor:
        idx = np.asarray(idx)
        if isinstance(self.array, torch.Tensor):
            return self.array[torch.from_numpy(idx)].to(self.device)
        return torch.from_numpy(np.asarray(self.array[idx])).to(self.device)


class TeacherStates:
    """States computed by the teacher whenever they are asked for (``cache=false``)."""

    def __init__(self, teacher: Teacher, windows: Windows, device, chunk: int = 16):
        self.teacher, self.windows, self.device, self.n, self.chunk = teacher, windows, device, len(windows), chunk

    def get(self, idx) -> torch.Tensor:
        return self.teacher.states(self.windows.get(idx, self.device))

    def to_memory(self) -> StoredStates:
        """All states computed once and kept (the held-out set is read at every evaluation)."""
        return StoredStates(torch.cat(list(_progress(chunks(self), self, "computing"))), self.device, self.chunk)


class Batches:
    """Training batch number ``cursor``: ``batch_size`` windows drawn with ``default_rng([seed, cursor])``,
    ``{"x": [B, T, D]}`` (the seekable, checkpointable cursor of ``core.data.text.Batches``). With several ranks the
    draw is of ``batch_size x world_size`` windows and rank r takes its ``batch_size`` (one global batch)."""

    def __init__(self, states, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        self.states, self.batch_size, self.seed, self.rank, self.world = states, batch_size, seed, rank, world_size

    def get(self, cursor: int) -> dict:
        idx = np.random.default_rng([self.seed, int(cursor)]).integers(0, self.states.n, self.batch_size * self.world)
        return {"x": self.states.get(idx[self.rank * self.batch_size:(self.rank + 1) * self.batch_size])}


# ---------------------------------------------------------------------------------------------- the cache

def open_states(teacher: Teacher, windows: Windows, corpus_key: str, *, cache: bool, device):
    """The state set of ``windows`` (a split of the corpus whose token cache is ``corpus_key``)."""
    computed = TeacherStates(teacher, windows, device)
    if not cache:
        return computed
    identity = {"format": FORMAT, "teacher": teacher.fingerprint, "layer": teacher.layer, "corpus": corpus_key,
                "split": windows.description, "block_size": windows.block_size,
                "starts": hashlib.sha256(np.ascontiguousarray(windows.starts, dtype=np.int64).tobytes()).hexdigest()}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache_root("states"))
    shape = (len(windows), windows.block_size, teacher.d_model)

    def layout(meta: dict) -> dict:
        if meta["shape"] != list(shape):
            raise ValueError(f"shape {meta['shape']}")
        return {"states": ("float32", shape)}

    def build(builder: FolderBuilder) -> dict:
        _fill(builder.array("states", np.float32, shape), computed)
        return {**identity, "teacher_source": teacher.source, "shape": list(shape), "dtype": "float32"}

    _, arrays = open_or_build(root / f"{_slug(teacher, corpus_key)}-{key}", layout, build)
    return StoredStates(arrays["states"], device)


def _fill(array: np.ndarray, computed: TeacherStates) -> None:
    """Run the teacher over every window into ``array`` ([n, T, D])."""
    i = 0
    for x in _progress(chunks(computed), computed, "caching"):
        array[i:i + len(x)] = x.cpu().numpy()
        i += len(x)


def _slug(teacher: Teacher, corpus_key: str) -> str:
    name = f"{Path(teacher.source).name}-L{teacher.layer}-{corpus_key.split('-')[0]}"
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:60]


def _progress(parts, states: TeacherStates, verb: str):
    """Pass ``parts`` (chunks of ``states``) through, with a line on stderr at the start, every 10 s and at the end."""
    w = states.windows
    total = states.n * w.block_size
    progress(f"purestep: {verb} teacher states (layer {states.teacher.layer}) of {states.n} windows x {w.block_size} "
          f"tokens of {w.description}")
    t0 = last = time.monotonic()
    done = 0
    for x in parts:
        done += x.shape[0] * x.shape[1]
        yield x
        if time.monotonic() - last > 10:
            last = time.monotonic()
            progress(f"purestep:   {done:,}/{total:,} tokens, {done / (last - t0):.0f} tok/s")
    seconds = time.monotonic() - t0
    progress(f"purestep: {verb} done: {total:,} tokens in {seconds:.1f}s ({total / max(seconds, 1e-9):.0f} tok/s)")
