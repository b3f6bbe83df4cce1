"""JSONL records -> a cache of token shards, one per input file, streamed (never the whole corpus in RAM).

``data=`` names JSONL when it is a ``.jsonl`` / ``.jsonl.gz`` file, or a folder or glob with such files among
its matches (then only those are read; :func:`find_jsonl`). Every non-blank line is one JSON object, a document:

- a chat ``{"messages": [{"role", "content"}, ...]}``, rendered by the tokenizer's chat template
  (``core.data.chat``), its assistant tokens flagged;
- a text ``{"text": ...}`` (``text_field=`` picks another field).

Each document is followed by the tokenizer's end-of-text token (EOS; ``"\\n"`` for a tokenizer without one),
flagged like the document's last token (so an answer's end is trained on under ``loss_on=assistant``).

A shard is built by ``core.io.cache.build_folder`` (the one cache writer) into
``$PURESTEP_CACHE/docs/<name>-<key>/``: ``tokens.bin`` (uint16/uint32), ``roles.bin`` (uint8, 1 = an
assistant token), ``starts.bin`` (int64 document offsets, one more than documents) and ``hashes.bin``
(float64 per document: sha256 of ``<file name>:<line>`` mapped to [0, 1), which decides the validation split
at read time, so ``val_fraction=`` never re-tokenizes) and ``assistant.bin`` (int64: assistant tokens per
document). The key hashes the file's path, size and mtime, the
tokenizer, the chat template, ``text_field`` and the format version. Lines are read and written in chunks:
the memory a build needs is bounded by one line plus the per-document offsets (16 bytes a document).
"""
from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import time
import zlib
from array import array

import numpy as np

from purestep.core.io import cache
from purestep.core.data.chat import ChatTemplate, check_messages, segments, template_of
from purestep.core.io.logging import progress
from purestep.core.data.tokenizers import DataError

VERSION = 1
SUFFIXES = (".jsonl", ".jsonl.gz")
FLUSH = 1 << 20      # tokens buffered before a write


def is_jsonl(path: str) -> bool:
    return path.endswith(SUFFIXES)


def find_jsonl(data: str) -> list | None:
    """The sorted JSONL files ``data`` names, or None when it names none (raw text: ``core.data.text``)."""
    if not data or data == "stdlib":
        return None
    path = os.path.abspath(os.path.expanduser(data))
    if os.path.isfile(path):
        return [path] if is_jsonl(path) else None
    if os.path.isdir(path):
        found = [os.path.join(d, f) for d, dirs, files in os.walk(path) for f in files
                 if not f.startswith(".") and "/." not in d[len(path):]]
    elif glob.has_magic(data):
        found = [os.path.abspath(p) for p in glob.glob(os.path.expanduser(data), recursive=True) if os.path.isfile(p)]
    else:
        return None
    jsonl = sorted(p for p in found if is_jsonl(p))
    return jsonl or None    # a folder holding JSONL files: those are the data, other files are ignored


def lines(path: str):
    """``(line number, bytes)`` of the non-blank lines of a (gzipped) JSONL file, streamed; a ``.gz`` that is not
    gzip, or is cut short, is a DataError naming the file."""
    opener = gzip.open if path.endswith(".gz") else open
    n = 0
    try:
        with opener(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield n, line
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(f"{path}: not a readable gzip file after line {n} ({e or type(e).__name__}); "
                        f"recompress it, or drop the .gz suffix for plain text") from None


def parse(line: bytes, where: str) -> dict:
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:    # the decoder's depth limit is Python's recursion limit (about 1000)
        raise DataError(f"{where}: JSON nested deeper than the decoder's limit (a record is an object of "
                        f"messages or text)") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSONL line must be a JSON object, got {type(record).__name__}")
    return record


def encode_record(record: dict, where: str, tok, template: str | ChatTemplate, text_field: str = "text"):
    """``(ids, roles)`` int64 / uint8 arrays of one document (separator included, see the module docstring);
    ``template`` renders its chat (a ``core.data.chat.ChatTemplate`` compiles once for every record)."""
    if "messages" in record:
        pieces = segments(template, check_messages(record["messages"], where), tok, where)
    elif isinstance(record.get(text_field), str):
        pieces = [(record[text_field], False)]
    else:
        raise DataError(f"{where}: a record needs a 'messages' list or a string '{text_field}' field "
                        f"(text_field= picks another), got keys {sorted(record)[:8]}")
    ids, roles = [], []
    for text, assistant in pieces:
        piece = tok.encode(text)
        ids += piece
        roles += [assistant] * len(piece)
    sep = [tok.eos_id] if tok.eos_id is not None else tok.encode("\n")
    ids += sep
    roles += [roles[-1] if roles else False] * len(sep)
    return np.asarray(ids, dtype=np.int64), np.asarray(roles, dtype=np.uint8)


def line_hash(name: str, line: int) -> float:
    digest = hashlib.sha256(f"{name}:{line}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _layout(meta: dict) -> dict:
    if meta.get("version") != VERSION:
        raise ValueError(f"version {meta.get('version')}")
    n, d = meta["tokens"], meta["documents"]
    return {"tokens": (meta["dtype"], [n]), "roles": ("uint8", [n]), "starts": ("int64", [d + 1]),
            "hashes": ("float64", [d]), "assistant": ("int64", [d])}


def _build(path: str, tok, template: str, text_field: str, folder) -> dict:
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    starts, hashes, assistant = array("q", [0]), array("d"), array("q")
    buf_ids, buf_roles, total, chats = [], [], 0, 0
    t0 = last = time.monotonic()
    name = os.path.basename(path)
    with open(os.path.join(folder, "tokens.bin"), "wb") as ft, open(os.path.join(folder, "roles.bin"), "wb") as fr:
        def flush():
            if buf_ids:
                ft.write(np.concatenate(buf_ids).astype(dtype).tobytes())
                fr.write(np.concatenate(buf_roles).tobytes())
                buf_ids.clear(), buf_roles.clear()

        chat = ChatTemplate(template)   # compiled at the first chat record, kept for the others
        for n, line in lines(path):
            where = f"{path}:{n}"
            record = parse(line, where)
            ids, roles = encode_record(record, where, tok, chat, text_field)
            chats += "messages" in record
            buf_ids.append(ids), buf_roles.append(roles)
            total += len(ids)
            starts.append(total), hashes.append(line_hash(name, n)), assistant.append(int(roles.sum()))
            if sum(len(b) for b in buf_ids) >= FLUSH:
                flush()
            if time.monotonic() - last > 5:
                last = time.monotonic()
                progress(f"purestep:   {name}: {len(hashes):,} records, {total:,} tokens, {last - t0:.0f}s")
        flush()
    if not hashes:
        raise DataError(f"{path}: no records (every line is blank)")
    np.asarray(starts, dtype=np.int64).tofile(os.path.join(folder, "starts.bin"))
    np.asarray(hashes, dtype=np.float64).tofile(os.path.join(folder, "hashes.bin"))
    np.asarray(assistant, dtype=np.int64).tofile(os.path.join(folder, "assistant.bin"))
    seconds = time.monotonic() - t0
    progress(f"purestep: tokenized {path}: {len(hashes):,} records ({chats:,} chats), {total:,} tokens in "
             f"{seconds:.1f}s ({total / max(seconds, 1e-9):,.0f} tokens/s)")
    return {"version": VERSION, "dtype": np.dtype(dtype).name, "tokens": total, "documents": len(hashes),
            "chats": chats, "source": path, "tokenizer": tok.to_dict(), "text_field": text_field,
            "template": template, "seconds": seconds}


def shard(path: str, tok, root: str, text_field: str = "text") -> tuple[str, dict]:
    """``(folder, arrays)`` of the token shard of one JSONL file (built first when missing, see the docstring)."""
    template = template_of(tok)
    st = os.stat(path)
    blob = json.dumps({"v": VERSION, "file": [path, st.st_size, st.st_mtime_ns], "tok": tok.to_dict(),
                       "template": template, "text_field": text_field}, sort_keys=True)
    key = hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]
    slug = "".join(c if c.isalnum() or c in "._-" else "_" for c in os.path.basename(path))[:50]
    folder = os.path.join(root, f"{slug}-{tok.name}-{key}")
    try:
        _, arrays = cache.open_or_build(folder, _layout, lambda b: _build(path, tok, template, text_field, b.path))
        return folder, arrays
    except cache.CacheError as e:
        raise DataError(f"token shard {folder} of {path} is unreadable ({e}); delete it") from None
