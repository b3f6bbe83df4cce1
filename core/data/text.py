"""Data: text sources -> a cached token memmap -> deterministic, seekable batches.

Follows nanoGPT: ``data/shakespeare_char/prepare.py`` (tokenize once into ``train.bin``/``val.bin``,
uint16, the last 10% of a file is validation, the char vocabulary is built over the whole file) and
``train.py:get_batch`` (random windows of ``block_size + 1`` tokens from a memmap, ``y`` is ``x``
shifted by one). Unlike ``get_batch``, batch number ``cursor`` is a pure function of
``(seed, cursor)``, so the cursor in the train state is all a resume needs.

Sources (the ``data=`` string):

- a file: split by position, the last 10% (``val_fraction``) of its tokens is validation (``int(n * 0.9)``);
- a folder: every text file under it, recursively; a text file is non-empty with no NUL byte in its
  first 8000 bytes (git's binary heuristic); hidden files and folders and ``__pycache__`` are skipped;
- a glob such as ``docs/**/*.rst.txt`` (``**`` recurses), text files only;
- ``stdlib``: the running Python's standard library ``*.py`` sources, without ``site-packages`` /
  ``dist-packages`` and without the test suites (folders named ``test``, ``tests``, ``idle_test``:
  distro Pythons often do not ship them, and some are deliberately not UTF-8). Python 3.11 gives
  about 730 files, 12 MB, 12M byte tokens.

Several files are split by file: a file is validation when the SHA-256 of its path relative to the
source root (with ``/``) maps below 0.1, about 10% of files; if that leaves either side empty, the
file with the smallest (or largest) hash moves over. One file found through a folder or glob is split
by position like a single file. Each file is followed by a separator: the tokenizer's EOS if it has
one, else the encoding of ``"\\n"``. A char vocabulary is built over the whole corpus (train and
validation, plus ``"\\n"`` when there are several files), as nanoGPT does, so validation never holds
an unknown character.

The cache lives in ``$PURESTEP_CACHE/tokens/<name>-<key>/`` (default ``~/.cache/purestep/tokens``):
``train.bin``, ``val.bin`` (uint16 when every id fits, else uint32) and ``meta.json``. The key hashes
the file list with sizes and mtimes, the tokenizer identity (its ``to_dict``; for ``char`` the word
itself, since the vocabulary is a function of those files) and the cache format version. A cache is
built by ``core.io.cache.build_folder`` (a temporary folder renamed into place), so an interrupted run never
leaves a cache that is later trusted; a cache whose file sizes disagree with its ``meta.json``, whose
``meta.json`` is unreadable, or whose token ids do not fit its tokenizer is rebuilt.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import time
from dataclasses import dataclass

import numpy as np
import torch

from purestep.core.io import cache
from purestep.core.io.logging import progress
from purestep.core.data.tokenizers import CharTokenizer, DataError, decode_utf8, make_tokenizer, tokenizer_from_dict

__all__ = ["DataError", "Source", "find_source", "Corpus", "prepare", "Batches", "EvalBatches",
           "eval_batches", "cache_root"]

CACHE_VERSION = 1
VAL_FRACTION = 0.1
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


# ----------------------------------------------------------------------------------------------- sources

@dataclass(frozen=True)
class Source:
    description: str     # names the path, for messages and meta.json
    root: str            # folder the relative paths (and so the split) are taken from
    files: list          # absolute paths, sorted by relative path
    by_position: bool    # one file: split by position; several: split by file


def is_text_file(path: str) -> bool:
    """Non-empty and no NUL byte in the first 8000 bytes (git's ``buffer_is_binary``)."""
    if os.path.getsize(path) == 0:
        return False
    with open(path, "rb") as f:
        return b"\0" not in f.read(8000)


def _walk(root: str, keep_dir, keep_file) -> list:
    found = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if keep_dir(x))
        found += [os.path.join(d, f) for f in sorted(files) if keep_file(d, f)]
    return found


def _visible(name: str) -> bool:
    return not name.startswith(".") and name != "__pycache__"


def find_source(data: str) -> Source:
    """Resolve the ``data=`` string into a list of files (see the module docstring)."""
    if data == "stdlib":
        root = os.path.realpath(sysconfig.get_paths()["stdlib"])
        files = _walk(root, lambda d: _visible(d) and d not in STDLIB_SKIP,
                      lambda d, f: f.endswith(".py") and os.path.getsize(os.path.join(d, f)) > 0)
        desc = f"stdlib {root} (*.py, without tests and site-packages)"
        return _multi(desc, root, files, data)
    path = os.path.abspath(os.path.expanduser(data))
    if os.path.isfile(path):
        if os.path.getsize(path) == 0:
            raise DataError(f"data file is empty: {path}")
        if not is_text_file(path):        # a folder or a glob skips binaries; a file given by name is refused
            raise DataError(f"data file {path} is binary (a NUL byte in its first 8000 bytes), not text")
        return Source(path, os.path.dirname(path), [path], by_position=True)
    if os.path.isdir(path):
        files = _walk(path, _visible, lambda d, f: _visible(f) and is_text_file(os.path.join(d, f)))
        return _multi(f"folder {path}", path, files, data)
    if glob.has_magic(data):
        pattern = os.path.expanduser(data)
        files = sorted(os.path.abspath(p) for p in glob.glob(pattern, recursive=True)
                       if os.path.isfile(p) and is_text_file(p))
        base = []
        for part in pattern.split(os.sep):
            if glob.has_magic(part):
                break
            base.append(part)
        root = os.path.abspath(os.sep.join(base) or ".")
        return _multi(f"glob {data}", root, files, data)
    raise DataError(f"data not found: {data} (expected a file, a folder, a glob like 'docs/**/*.txt', "
                    f"or 'stdlib')")


def _multi(desc: str, root: str, files: list, data: str) -> Source:
    if not files:
        raise DataError(f"no text files found for data={data} ({desc})")
    files = sorted(files, key=lambda p: _rel(p, root))
    return Source(f"{desc} ({len(files)} files)" if len(files) > 1 else files[0], root, files,
                  by_position=len(files) == 1)


def _rel(path: str, root: str) -> str:
    return os.path.relpath(path, root).replace(os.sep, "/")


def _unit_hash(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2.0**64


def split_files(source: Source, fraction: float = VAL_FRACTION) -> tuple[list, list]:
    """``(train_files, val_files)``: about ``fraction`` of files by path hash, at least one each."""
    h = {p: _unit_hash(_rel(p, source.root)) for p in source.files}
    val = [p for p in source.files if h[p] < fraction]
    if not val:
        val = [min(source.files, key=h.get)]
    if len(val) == len(source.files):
        val.remove(max(val, key=h.get))
    return [p for p in source.files if p not in set(val)], val


# ----------------------------------------------------------------------------------------------- cache

def cache_root(kind: str = "tokens") -> str:
    """``$PURESTEP_CACHE/<kind>`` (default ``~/.cache/purestep/<kind>``): where every cache of the project
    lives (tokens here; teacher states, teacher outputs and converted models elsewhere)."""
    base = os.environ.get("PURESTEP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "purestep")
    return os.path.join(base, kind)


def _cache_key(source: Source, tokenizer_identity: dict, fraction: float = VAL_FRACTION) -> str:
    stats = [[p, st.st_size, st.st_mtime_ns] for p, st in ((p, os.stat(p)) for p in source.files)]
    other = {} if fraction == VAL_FRACTION else {"val_fraction": fraction}   # the default's keys are unchanged
    blob = json.dumps({"version": CACHE_VERSION, "files": stats, "by_position": source.by_position,
                       "tokenizer": tokenizer_identity, **other}, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def _slug(source: Source, data: str, tokenizer_spec: str) -> str:
    if data == "stdlib":
        name = "stdlib"
    else:
        name = os.path.basename(source.files[0] if source.by_position else source.root)
    tok = tokenizer_spec if tokenizer_spec in ("byte", "char") else "bpe"
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in f"{name}-{tok}")[:60]


def _layout(meta: dict) -> dict:
    """``{file stem: (dtype, shape)}`` of a token cache described by ``meta`` (another version is not one)."""
    if meta["version"] != CACHE_VERSION:
        raise ValueError(f"version {meta['version']}")
    return {split: (meta["dtype"], [meta[f"{split}_tokens"]]) for split in ("train", "val")}


class _Progress:
    """Brief progress on stderr: one line at the start, one every few seconds, one at the end."""

    def __init__(self, what: str, every: float = 5.0):
        self.what, self.every = what, every
        self.t0 = self.last = time.monotonic()
        progress(f"purestep: tokenizing {what}")

    def update(self, done: int, total: int, tokens: int):
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            progress(f"purestep:   {done}/{total} files, {tokens:,} tokens, {now - self.t0:.0f}s")

    def done(self, train: int, val: int):
        progress(f"purestep: tokenized {self.what}: {train:,} train + {val:,} val tokens in "
                 f"{time.monotonic() - self.t0:.1f}s")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _build(source: Source, tok, folder, fraction: float = VAL_FRACTION) -> dict:
    """Tokenize ``source`` into ``folder``/{train,val}.bin; return the meta dict (``core.io.cache`` writes it).

    ``tok`` None means a char tokenizer, built here over the whole corpus (nanoGPT) plus "\n" for the
    separator when there are several files.
    """
    if tok is None:
        chars = {"\n"} if not source.by_position else set()
        for p in source.files:
            chars |= set(decode_utf8(_read(p), p))
        tok = CharTokenizer("".join(chars))
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    status = _Progress(f"{source.description} with the {tok.name} tokenizer (vocab {tok.vocab_size:,})")
    counts = {"train": 0, "val": 0}

    def write(split, f, ids):
        f.write(np.asarray(ids).astype(dtype).tobytes())
        counts[split] += len(ids)

    with open(os.path.join(folder, "train.bin"), "wb") as ftrain, \
            open(os.path.join(folder, "val.bin"), "wb") as fval:
        if source.by_position:
            ids = tok.encode_bytes(_read(source.files[0]), source=source.files[0])
            n_train = int(len(ids) * (1 - fraction))
            if n_train == 0 or n_train == len(ids):
                raise DataError(f"{source.files[0]}: {len(ids)} tokens, too few to split into train and "
                                f"validation (the last {fraction:.0%} is validation)")
            write("train", ftrain, ids[:n_train])
            write("val", fval, ids[n_train:])
            split_rule = f"by position: the last {fraction:.0%} of tokens is validation"
            separator, n_val_files = [], 0
        else:
            train_files, val_files = split_files(source, fraction)
            separator = [tok.eos_id] if tok.eos_id is not None else tok.encode("\n")
            val_set = set(val_files)
            for i, p in enumerate(source.files):
                split = "val" if p in val_set else "train"
                ids = tok.encode_bytes(_read(p), source=p)
                write(split, fval if split == "val" else ftrain, np.concatenate([ids, separator]))
                status.update(i + 1, len(source.files), counts["train"] + counts["val"])
            split_rule = ("by file: validation when the first 8 bytes of sha256(path relative to the root) "
                          f"/ 2**64 < {fraction:g}, at least one file each side")
            n_val_files = len(val_files)
    status.done(counts["train"], counts["val"])
    meta = {
        "version": CACHE_VERSION, "dtype": np.dtype(dtype).name,
        "train_tokens": counts["train"], "val_tokens": counts["val"], "vocab_size": tok.vocab_size,
        "tokenizer": tok.to_dict(), "source": source.description, "root": source.root,
        "files": len(source.files), "val_files": n_val_files, "split": split_rule,
        "separator": [int(i) for i in separator],
    }
    return meta


# ----------------------------------------------------------------------------------------------- corpus

@dataclass
class Corpus:
    train: np.ndarray    # 1-d token memmap
    val: np.ndarray
    tokenizer: object
    meta: dict
    path: str            # the cache folder

    def describe(self, split: str) -> str:
        name = {"train": "train", "val": "validation"}[split]
        return f"{self.meta['source']} ({name} split)"

    def batches(self, batch_size: int, block_size: int, seed: int, **kw) -> Batches:
        """``Batches`` over the train split (errors name the source)."""
        return Batches(self.train, batch_size, block_size, seed, source=self.describe("train"), **kw)

    def eval_batches(self, batch_size: int, block_size: int, n: int, **kw) -> EvalBatches:
        """``eval_batches`` over the validation split (errors name the source)."""
        return eval_batches(self.val, batch_size, block_size, n, source=self.describe("val"), **kw)


def prepare(data: str, tokenizer_spec="byte", cache_dir: str | None = None,
            val_fraction: float = VAL_FRACTION) -> Corpus:
    """Tokenize ``data`` once (cached, see the module docstring) and open its train/val memmaps.

    ``tokenizer_spec`` is a spec for ``make_tokenizer`` (``byte``, ``char``, a tokenizer.json path) or a
    tokenizer object, e.g. the one stored in a checkpoint being fine-tuned (its exact vocab is kept).
    ``cache_dir`` replaces the cache root (``$PURESTEP_CACHE/tokens``): the cache goes to
    ``cache_dir/<name>-<key>/``; ``val_fraction`` replaces the 10% held out."""
    source = find_source(data)
    if isinstance(tokenizer_spec, str):
        tok = None if tokenizer_spec == "char" else make_tokenizer(tokenizer_spec)
    else:
        tok, tokenizer_spec = tokenizer_spec, tokenizer_spec.name
    identity = {"type": "char"} if tok is None else tok.to_dict()
    root = cache_dir or cache_root()
    folder = os.path.join(root, f"{_slug(source, data, tokenizer_spec)}-{_cache_key(source, identity, val_fraction)}")
    extra = {} if val_fraction == VAL_FRACTION else {"fraction": val_fraction}
    meta, arrays, tokenizer = _open_tokens(folder, lambda builder: _build(source, tok, builder.path, **extra),
                                           source.description)
    return Corpus(arrays["train"], arrays["val"], tokenizer, meta, folder)


def _open_tokens(folder: str, build, description: str):
    """``(meta, arrays, tokenizer)`` of the token cache at ``folder``, built first if missing or incomplete;
    rebuilt once if damaged (a tokenizer ``meta.json`` cannot rebuild, a token id outside its vocabulary);
    a DataError naming the folder if still unreadable."""
    try:
        meta, arrays = cache.open_or_build(folder, _layout, build)
        tokenizer, damage = _read_tokens(meta, arrays)
        if damage:
            progress(f"purestep: token cache {folder} is damaged ({damage}); rebuilding it")
            cache.build_folder(folder, build)
            meta, arrays = cache.read_folder(folder, _layout)
            tokenizer, damage = _read_tokens(meta, arrays)
    except cache.CacheError as e:
        damage = str(e)
    if damage:
        raise DataError(f"token cache {folder} is unreadable after tokenizing {description}: {damage}; "
                        "delete it") from None
    return meta, arrays, tokenizer


def _read_tokens(meta: dict, arrays: dict, chunk: int = 1 << 24):
    """``(tokenizer, None)`` for a sound cache, ``(None, what is wrong)`` for a damaged one. Every token id is
    checked against the vocabulary, chunk by chunk (one cheap read: docs/design.md, 'Measured choices')."""
    try:
        tokenizer = tokenizer_from_dict(meta["tokenizer"])
    except (KeyError, TypeError, ValueError, AttributeError, DataError) as e:
        return None, f"meta.json holds no readable tokenizer ({type(e).__name__}: {e})"
    for split in ("train", "val"):
        tokens = arrays[split]
        for start in range(0, len(tokens), chunk):
            top = int(tokens[start:start + chunk].max())
            if top >= tokenizer.vocab_size:
                return None, f"{split}.bin holds token id {top}, outside the vocabulary of {tokenizer.vocab_size}"
    return tokenizer, None


# ----------------------------------------------------------------------------------------------- batches

def _check_length(tokens, block_size: int, source: str | None):
    if len(tokens) < block_size + 1:
        where = source or getattr(tokens, "filename", None) or "token array"
        raise DataError(f"{where}: {len(tokens):,} tokens, fewer than block_size + 1 = {block_size + 1} "
                        f"needed for one window")


def _placement(device, pin_memory):
    device = torch.device(device) if device is not None else None
    cuda = device is not None and device.type == "cuda"
    if pin_memory is None:
        pin_memory = cuda
    if pin_memory and not cuda:
        raise ValueError("pin_memory=True needs a CUDA device")
    return device, pin_memory


def _to_device(t: torch.Tensor, device, pin: bool) -> torch.Tensor:
    t = t.contiguous()
    if pin:
        t = t.pin_memory()
    return t if device is None else t.to(device, non_blocking=pin)


class Batches:
    """Batch number ``cursor`` as a pure function of ``(seed, cursor)`` (nanoGPT's ``get_batch``, seekable).

    The global batch for a cursor is ``grad_accum x (world_size * batch_size)`` windows whose offsets come
    from ``np.random.default_rng([seed, cursor])``; rank ``r`` takes rows ``r*batch_size:(r+1)*batch_size``
    of each micro-batch, so ranks together see exactly the rows of a one-rank run with the global batch.
    ``get`` returns ``{"x", "y"}`` int64 tensors of shape ``[B, T]``, or ``[grad_accum, B, T]`` when
    ``grad_accum > 1``. ``pin_memory`` defaults to True for a CUDA ``device`` (copied non-blocking).
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, block_size: int, seed: int, grad_accum: int = 1,
                 rank: int = 0, world_size: int = 1, device=None, pin_memory: bool | None = None,
                 source: str | None = None, fim=None):
        for name, v in (("batch_size", batch_size), ("block_size", block_size), ("grad_accum", grad_accum),
                        ("world_size", world_size)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        _check_length(tokens, block_size, source)
        self.tokens, self.batch_size, self.block_size, self.seed = tokens, batch_size, block_size, seed
        self.grad_accum, self.rank, self.world_size = grad_accum, rank, world_size
        self.device, self.pin_memory = _placement(device, pin_memory)
        self._span = np.arange(block_size + 1)
        self.fim = fim   # core.data.fim.FIM or None: fill-in-the-middle on a fraction of the windows

    def offsets(self, cursor: int) -> np.ndarray:
        """Window starts of the global batch: ``[grad_accum, world_size * batch_size]``."""
        cursor = int(cursor)
        if cursor < 0:
            raise ValueError(f"cursor must be >= 0, got {cursor}")
        rng = np.random.default_rng([self.seed, cursor])
        high = len(self.tokens) - self.block_size  # exclusive: the last window ends at the last token
        return rng.integers(0, high, size=(self.grad_accum, self.world_size * self.batch_size))

    def get(self, cursor: int) -> dict:
        b = self.batch_size
        starts = self.offsets(cursor)
        if self.fim is None:
            starts = starts[:, self.rank * b:(self.rank + 1) * b]
        windows = np.asarray(self.tokens[starts[..., None] + self._span], dtype=np.int64)
        if self.fim is not None:   # transform the global batch, then take this rank's rows
            windows = self.fim.apply(windows, self.seed, cursor)[:, self.rank * b:(self.rank + 1) * b]
        windows = torch.from_numpy(windows)
        if self.grad_accum == 1:
            windows = windows[0]
        return {"x": _to_device(windows[..., :-1], self.device, self.pin_memory),
                "y": _to_device(windows[..., 1:], self.device, self.pin_memory)}


class EvalBatches:
    """A fixed, re-iterable sequence of validation batches: ``n * batch_size`` evenly spaced windows."""

    def __init__(self, tokens: np.ndarray, batch_size: int, block_size: int, n: int, device=None,
                 source: str | None = None):
        if batch_size < 1 or block_size < 1 or n < 1:
            raise ValueError(f"batch_size, block_size and n must be >= 1, got {batch_size}, {block_size}, {n}")
        _check_length(tokens, block_size, source)
        self.tokens = tokens
        last = len(tokens) - block_size - 1
        self.starts = np.linspace(0, last, n * batch_size).round().astype(np.int64).reshape(n, batch_size)
        self.device, self.pin_memory = _placement(device, None)
        self._span = np.arange(block_size + 1)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict:
        windows = torch.from_numpy(np.asarray(self.tokens[self.starts[i][:, None] + self._span], dtype=np.int64))
        return {"x": _to_device(windows[:, :-1], self.device, self.pin_memory),
                "y": _to_device(windows[:, 1:], self.device, self.pin_memory)}

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def eval_batches(tokens: np.ndarray, batch_size: int, block_size: int, n: int, device=None,
                 source: str | None = None) -> EvalBatches:
    """``n`` validation batches of evenly spaced windows: every evaluation sees the same tokens."""
    return EvalBatches(tokens, batch_size, block_size, n, device=device, source=source)
