"""Document data (JSONL shards, ``core.data.jsonl``) -> deterministic, seekable batches with loss masks and packing.

Follows torchtune's SFT datasets (``torchtune/datasets/_packed.py``, ``_sft.py``: target masking with the
ignore index, packed rows with a per-document mask and restarting positions) and Levanter's resumable data
pipeline (the order is a function of the step, not of a stateful shuffle buffer).

- ``loss_on=all``: every next-token target inside a document is trained on; ``loss_on=assistant``: only
  targets that are assistant tokens (``core.data.chat.segments``). A target outside its document, a masked target
  and padding get -1, the ignore index of ``models.losses.cross_entropy``, so every recipe's loss sees it.
  Under ``assistant`` a document with no assistant token (a chat without an assistant turn, a text record)
  is skipped and counted (``meta["skipped"]``; the recipes log it); if every document is skipped the run
  is refused.
- ``pack=true``: the epoch's documents are concatenated in a shuffled order and cut into windows of
  ``block_size + 1`` tokens (``x``, and ``y`` shifted by one; a document crossing a window boundary
  continues in the next window). ``batch["doc"]`` holds each token's document number, so attention stays
  inside a document and RoPE positions restart at each one (``models.llama.attention_mask``,
  ``doc_positions``). ``pack=false``: one document per row, padded with -1 targets; a document longer than
  ``block_size + 1`` tokens is split into several rows.
- Row ``i`` of epoch ``e`` comes from ``np.random.default_rng([seed, e]).permutation``; global row ``g`` of
  the run is row ``g % rows`` of epoch ``g // rows``, and the batch at ``cursor`` holds global rows
  ``cursor * G .. (cursor + 1) * G - 1`` (``G = grad_accum * world_size * batch_size``): a pure function of
  ``(seed, epoch, cursor)``, so the checkpointed cursor is all a resume needs. Rank ``r`` builds only its
  own rows ``r*batch_size:(r+1)*batch_size`` of each micro-batch.
- Validation: a document is validation when its line hash (``core.data.jsonl``) is below ``val_fraction``
  (at least one document each side), or every document of ``val_data=``.
"""
from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np
import torch

from purestep.core.data import text as text_data
from purestep.core.data.jsonl import find_jsonl, shard
from purestep.core.data.tokenizers import DataError, make_tokenizer

LOSS_ON = ("all", "assistant")


class _Rows:
    """The rows of one split: a document table ``(shard, start, length)`` laid out packed or one per row."""

    def __init__(self, shards: list, table: np.ndarray, block_size: int, pack: bool, assistant: bool):
        self.shards, self.table, self.T, self.pack, self.assistant = shards, table, block_size, pack, assistant
        lengths = table[:, 2]
        if pack:
            self.n = int((lengths.sum() - 1) // block_size)
        else:   # chunks of a document: [k*T, k*T + T + 1), at least one per document
            per_doc = np.maximum(1, -(-(lengths - 1) // block_size))
            self.chunks = np.stack([np.repeat(np.arange(len(table)), per_doc),
                                    np.concatenate([np.arange(k) for k in per_doc]) * block_size], 1)
            self.n = len(self.chunks)
        self._cache = (None, None)    # ((epoch, seed), (order, cum)): one attribute, read whole by any thread

    def _order(self, epoch: int, seed: int):
        """The epoch's permutation (-1: the natural order) and, packed, the cumulative document lengths."""
        key, cached = self._cache
        if key != (epoch, seed):
            count = len(self.table) if self.pack else self.n
            order = np.arange(count) if epoch < 0 else np.random.default_rng([seed, epoch]).permutation(count)
            cum = np.concatenate([[0], np.cumsum(self.table[order, 2])]) if self.pack else None
            cached = (order, cum)
            self._cache = ((epoch, seed), cached)
        return cached

    def _piece(self, doc: int, lo: int, hi: int):
        s, start, _ = self.table[doc]
        tokens, roles = self.shards[s]["tokens"], self.shards[s]["roles"]
        return np.asarray(tokens[start + lo:start + hi], dtype=np.int64), np.asarray(roles[start + lo:start + hi])

    def row(self, epoch: int, seed: int, i: int):
        """``(tokens, roles, doc)`` of ``T + 1`` entries (doc -1: padding) of row ``i`` of ``epoch``."""
        order, cum = self._order(epoch, seed)
        T = self.T
        tokens, roles = np.zeros(T + 1, np.int64), np.zeros(T + 1, np.uint8)
        doc = np.full(T + 1, -1, np.int64)
        if self.pack:
            lo, hi = i * T, i * T + T + 1
            k = int(np.searchsorted(cum, lo, side="right")) - 1
            while k < len(order) and cum[k] < hi:
                a, b = max(lo, cum[k]), min(hi, cum[k + 1])
                t, r = self._piece(order[k], a - cum[k], b - cum[k])
                tokens[a - lo:b - lo], roles[a - lo:b - lo], doc[a - lo:b - lo] = t, r, k
                k += 1
        else:
            d, lo = self.chunks[order[i]]
            t, r = self._piece(d, lo, min(lo + T + 1, self.table[d, 2]))
            tokens[:len(t)], roles[:len(t)], doc[:len(t)] = t, r, 0
        return tokens, roles, doc

    def batch(self, rows: list) -> dict:
        """``{"x", "y"[, "doc"]}`` int64 arrays ``[len(rows), T]`` of ``(tokens, roles, doc)`` rows."""
        tokens, roles, doc = (np.stack(a) for a in zip(*rows))
        y = tokens[:, 1:].copy()
        keep = (doc[:, 1:] == doc[:, :-1]) & (doc[:, 1:] >= 0)
        if self.assistant:
            keep &= roles[:, 1:] == 1
        y[~keep] = -1
        out = {"x": tokens[:, :-1], "y": y}
        if self.pack:
            out["doc"] = doc[:, :-1]
        return out


def _tensors(out: dict, device, pin: bool) -> dict:
    return {k: text_data._to_device(torch.from_numpy(np.ascontiguousarray(v)), device, pin) for k, v in out.items()}


class DocBatches:
    """``get(cursor)``: the batch at ``cursor`` (see the module docstring); the interface of
    ``core.data.text.Batches``."""

    def __init__(self, rows: _Rows, batch_size: int, seed: int, grad_accum: int = 1, rank: int = 0,
                 world_size: int = 1, device=None, pin_memory=None, source: str = "data"):
        if rows.n < 1:
            raise DataError(f"{source}: too little data for one row of block_size + 1 = {rows.T + 1} tokens")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.grad_accum, self.rank, self.world_size = grad_accum, rank, world_size
        self.device, self.pin_memory = text_data._placement(device, pin_memory)
        self.global_batch = grad_accum * world_size * batch_size

    @property
    def rows_per_epoch(self) -> int:
        return self.rows.n

    def epoch(self, cursor: int) -> float:
        """Epochs done once the batch at ``cursor`` is consumed."""
        return (int(cursor) + 1) * self.global_batch / self.rows.n

    def steps_for(self, epochs: float) -> int:
        return max(1, math.ceil(epochs * self.rows.n / self.global_batch))

    def get(self, cursor: int) -> dict:
        b, per = self.batch_size, self.world_size * self.batch_size
        first = int(cursor) * self.global_batch
        rows = [self.rows.row((g := first + m * per + self.rank * b + j) // self.rows.n, self.seed, g % self.rows.n)
                for m in range(self.grad_accum) for j in range(b)]
        out = self.rows.batch(rows)
        if self.grad_accum > 1:
            out = {k: v.reshape(self.grad_accum, b, -1) for k, v in out.items()}
        return _tensors(out, self.device, self.pin_memory)


class DocEvalBatches:
    """``n`` fixed validation batches: ``n * batch_size`` evenly spaced rows of the natural order."""

    def __init__(self, rows: _Rows, batch_size: int, n: int, device=None, source: str = "validation"):
        if rows.n < 1:
            raise DataError(f"{source}: too little data for one row of block_size + 1 = {rows.T + 1} tokens")
        self.rows = rows
        self.index = np.linspace(0, rows.n - 1, n * batch_size).round().astype(np.int64).reshape(n, batch_size)
        self.device, self.pin_memory = text_data._placement(device, None)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict:
        return _tensors(self.rows.batch([self.rows.row(-1, 0, int(j)) for j in self.index[i]]), self.device,
                        self.pin_memory)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class Stream:
    """A split's documents as one token sequence in file order, read on demand: ``len`` and slices (``val[:32]``,
    a sample prompt) touch only the documents they cover; any other index reads the whole split once."""

    def __init__(self, shards: list, table: np.ndarray):
        self.shards, self.table, self._all = shards, table, None
        self.cum = np.concatenate([[0], np.cumsum(table[:, 2])])

    def __len__(self) -> int:
        return int(self.cum[-1])

    def _range(self, lo: int, hi: int) -> np.ndarray:
        first = int(np.searchsorted(self.cum, lo, side="right")) - 1
        parts = []
        for k in range(max(first, 0), len(self.table)):
            if self.cum[k] >= hi:
                break
            s, start, _ = self.table[k]
            a, b = max(lo, self.cum[k]) - self.cum[k], min(hi, self.cum[k + 1]) - self.cum[k]
            parts.append(np.asarray(self.shards[s]["tokens"][start + a:start + b]))
        return np.concatenate(parts) if parts else np.zeros(0, np.asarray(self.shards[0]["tokens"][:0]).dtype)

    def __getitem__(self, key):
        if isinstance(key, slice) and key.step in (None, 1):
            lo, hi, _ = key.indices(len(self))
            return self._range(lo, max(lo, hi))
        if self._all is None:
            self._all = self._range(0, len(self))
        return self._all[key]

    def __array__(self, dtype=None, copy=None):
        return self[:] if dtype is None else self[:].astype(dtype)


class DocCorpus:
    """JSONL documents of both splits; ``batches``/``eval_batches`` as ``core.data.text.Corpus`` has them.

    ``train``/``val`` are :class:`Stream` views of the splits' documents concatenated in file order (for
    recipes that read the rendered text as a token stream, such as upcycle and compress). ``path`` names
    this set of shards and settings (an identity for caches keyed by the data; no folder is created there)."""

    def __init__(self, shards: list, tables: dict, tokenizer, meta: dict, pack: bool, assistant: bool):
        self.shards, self.tables, self.tokenizer, self.meta = shards, tables, tokenizer, meta
        self.pack, self.assistant, self.path = pack, assistant, meta["cache"]
        self.train, self.val = Stream(shards, tables["train"]), Stream(shards, tables["val"])

    def describe(self, split: str) -> str:
        return f"{self.meta['source']} ({ {'train': 'train', 'val': 'validation'}[split]} split)"

    def rows(self, split: str, block_size: int) -> _Rows:
        return _Rows(self.shards, self.tables[split], block_size, self.pack, self.assistant)

    def batches(self, batch_size: int, block_size: int, seed: int, fim=None, **kw) -> DocBatches:
        if fim is not None:
            raise DataError("fim_rate > 0 is for raw text (code corpora), not JSONL documents; use fim_rate=0")
        return DocBatches(self.rows("train", block_size), batch_size, seed, source=self.describe("train"), **kw)

    def eval_batches(self, batch_size: int, block_size: int, n: int, device=None, **kw) -> DocEvalBatches:
        return DocEvalBatches(self.rows("val", block_size), batch_size, n, device=device, source=self.describe("val"))


def _table(shards: list, first: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(table [n, 3] of (shard, start, length), hashes, assistant counts)`` over every document."""
    tables, hashes, counts = [], [], []
    for s, arrays in enumerate(shards, first):
        starts = np.asarray(arrays["starts"])
        tables.append(np.stack([np.full(len(starts) - 1, s), starts[:-1], np.diff(starts)], 1))
        hashes.append(np.asarray(arrays["hashes"])), counts.append(np.asarray(arrays["assistant"]))
    return np.concatenate(tables), np.concatenate(hashes), np.concatenate(counts)


def _split(hashes: np.ndarray, fraction: float) -> np.ndarray:
    """Validation flags: hash below ``fraction``, at least one document each side."""
    val = hashes < fraction
    if not val.any():
        val[np.argmin(hashes)] = True
    if val.all():
        val[np.argmax(hashes)] = False
    return val


def prepare_docs(files: list, tok, *, text_field="text", loss_on="all", pack=True, val_fraction=0.1,
                 val_files=None, cache_dir=None, source="") -> DocCorpus:
    """Tokenize (once, cached per file) and open the JSONL ``files``; see the module docstring."""
    if loss_on not in LOSS_ON:
        raise DataError(f"loss_on={loss_on}: choose one of {', '.join(LOSS_ON)}")
    root = cache_dir or text_data.cache_root("docs")
    built = [shard(p, tok, root, text_field) for p in files + (val_files or [])]
    folders, shards = [f for f, _ in built], [a for _, a in built[:len(files)]]
    table, hashes, counts = _table(shards)
    if val_files:
        extra = [a for _, a in built[len(files):]]
        val_table, _, val_counts = _table(extra, len(shards))
        shards, tables, kept = shards + extra, {"train": table, "val": val_table}, {"train": counts, "val": val_counts}
    else:
        val = _split(hashes, val_fraction)
        tables, kept = {"train": table[~val], "val": table[val]}, {"train": counts[~val], "val": counts[val]}
    skipped = 0
    if loss_on == "assistant":
        for split in tables:
            has = kept[split] > 0
            skipped += int((~has).sum())
            if not has.any():
                raise DataError(f"{source}: loss_on=assistant but no {split} document has an assistant turn "
                                f"({len(has)} skipped); use loss_on=all or add chats with assistant answers")
            tables[split] = tables[split][has]
    identity = json.dumps([[os.path.basename(f) for f in folders], val_fraction, bool(val_files), loss_on])
    meta = {"source": source, "files": len(files), "skipped": skipped, "shards": folders,
            "cache": os.path.join(root, "set-" + hashlib.sha256(identity.encode()).hexdigest()[:16]),
            "train_tokens": int(tables["train"][:, 2].sum()), "val_tokens": int(tables["val"][:, 2].sum()),
            "train_documents": len(tables["train"]), "val_documents": len(tables["val"]),
            "split": "val_data" if val_files else f"by line hash < {val_fraction}"}
    return DocCorpus(shards, tables, tok, meta, pack, loss_on == "assistant")


def prepare_data(data: str, tokenizer_spec="byte", *, text_field="text", loss_on="all", pack=True,
                 val_fraction=0.1, val_data="", cache_dir=None):
    """``data=`` of any kind: JSONL (a ``DocCorpus``) or raw text (``core.data.text.prepare``, unchanged)."""
    files = find_jsonl(data)
    if files is None:
        for key, value, default in (("loss_on", loss_on, "all"), ("val_data", val_data, "")):
            if value != default:
                raise DataError(f"{key}={value} applies to JSONL data (.jsonl / .jsonl.gz); data={data} is raw text")
        return text_data.prepare(data, tokenizer_spec, cache_dir, val_fraction)
    if tokenizer_spec == "char":
        raise DataError("tokenizer=char builds its vocabulary from raw text; JSONL data needs tokenizer=byte, a "
                        "tokenizer.json or init= with its own tokenizer")
    tok = make_tokenizer(tokenizer_spec) if isinstance(tokenizer_spec, str) else tokenizer_spec
    val_files = None
    if val_data:
        val_files = find_jsonl(val_data)
        if val_files is None:
            raise DataError(f"val_data={val_data}: not a .jsonl / .jsonl.gz file, folder or glob")
    source = files[0] if len(files) == 1 else f"{data} ({len(files)} JSONL files)"
    return prepare_docs(files, tok, text_field=text_field, loss_on=loss_on, pack=pack, val_fraction=val_fraction,
                        val_files=val_files, cache_dir=cache_dir, source=source)


def prepare_text(data: str, tokenizer_spec="byte", cache_dir=None) -> text_data.Corpus:
    """``data=`` as one token stream per split (``core.data.text.Corpus``) for recipes that read text as windows of
    a stream (upcycle, compress, distill's teacher cache, benchmarks): raw text as ``core.data.text.prepare`` has it;
    JSONL documents rendered (chats by their template), each followed by its separator, concatenated in file
    order; every token is a target (``loss_on``/``pack`` are for ``standard`` and ``distill``)."""
    files = find_jsonl(data)
    if files is None:
        return text_data.prepare(data, tokenizer_spec, cache_dir)
    docs = prepare_data(data, tokenizer_spec, cache_dir=cache_dir)
    meta = {**docs.meta, "rendered": "JSONL documents rendered and concatenated (core.data.documents.prepare_text)"}
    return text_data.Corpus(docs.train[:], docs.val[:], docs.tokenizer, meta, docs.path)
