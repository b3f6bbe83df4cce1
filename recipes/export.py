"""Take a model elsewhere: ``purestep recipe=export init=RUN_OR_CKPT format=hf|gguf out=DIR [dtype=...]``.

``init`` is anything ``models.loading.load_model`` reads (a purestep checkpoint or run folder from any recipe, a
Hugging Face folder, a GGUF file, ``smollm2``). What is written:

- ``format=hf``: a Hugging Face folder (``config.json`` of the family that computes the model: Llama, Qwen2 for
  q/k/v biases, Mistral for a sliding window; ``model.safetensors``; ``generation_config.json``; tokenizer files
  with the special tokens and chat template) that ``transformers.AutoModelForCausalLM.from_pretrained`` opens
  (``models.hf.export_hf``). The upcycle recipe's DBA student, when it is a plain Llama (``rope_pairs_shared=true``:
  no semantic keys, one set of RoPE pairs; ``models.dba_llama``), is written as that Llama (``head_dim`` = geo_dim,
  the kept pairs' frequencies as per-pair factors: transformers' ``longrope``, GGUF's ``rope_freqs``); any other
  DBA student with its own self-contained modeling file, opened with ``trust_remote_code=True`` the way DeepSeek
  ships its MLA models (``models.dba_hf``), and refused by ``format=gguf`` with the reason.
- ``format=gguf``: one llama.cpp file ``model-<DTYPE>.gguf`` written with the ``gguf`` package's writer
  (``models.gguf_export``); ``dtype=q8_0`` quantizes the matrices.
- The upcycle recipe's MLA student (arch ``mla``) in DeepSeek-V2's own formats: ``format=hf`` a
  ``DeepseekV2ForCausalLM`` folder that transformers opens without remote code (``models.mla_hf``), ``format=gguf``
  llama.cpp's ``deepseek2`` (``models.mla_gguf``).

Byte and char tokenizers are converted to a Hugging Face ``tokenizer.json`` with the same ids
(``models.tokenizer_export``) or refused with the reason. The folder ``out`` is built in a temporary folder next
to it and renamed into place (``core.io.cache.build_folder``): a failed export leaves nothing, and an existing
``out`` is replaced only with ``overwrite=true``, and only when it is an earlier export: every entry one of the
names an export writes (``EXPORT_FILES``). A folder holding anything else (a run's checkpoints, ``metrics.jsonl``,
its ``.lock``, a user's file) is refused with the name of that entry, a folder a live run holds (``core.cli.runs``'
lock) with that run's pid, and an ``init`` inside ``out`` as such: overwrite never deletes what export did not write.
The check runs again when the build is done, just before the old folder is replaced. ``verify=true`` reads the
export back (transformers for HF folders when it is installed, else purestep's own loader) and prints the largest
logit difference against the model that was exported, on one fixed random sequence.
"""
from __future__ import annotations

import fnmatch
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from purestep.core.cli.runs import LOCK, holder
from purestep.core.io.cache import build_folder
from purestep.core.config import UserError, option
from purestep.core.io.logging import progress
from purestep.core.tree import cast
from purestep.models.loading import LoadedModel, load_model

DESCRIPTION = "a model out to a Hugging Face folder (transformers) or a GGUF file (llama.cpp)"
FORMATS = ("hf", "gguf")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "q8_0": None}
CHECK_TOKENS = 32
# What an export writes (models.hf, models.dba_hf, models.gguf_export): the only entries overwrite=true replaces.
EXPORT_FILES = ("*.json", "*.safetensors", "*.gguf", "modeling_*.py", "configuration_*.py", "*.jinja")


@dataclass
class Config:
    init: str = option("", "the model: a checkpoint, a run folder, an HF folder, a GGUF file or 'smollm2'")
    format: str = option("hf", "hf: a Hugging Face folder; gguf: one llama.cpp file in the out folder",
                         choices=FORMATS)
    out: str = option("", "the folder to write (built aside, then renamed into place)")
    dtype: str = option("fp32", "weights' dtype in the export (q8_0: GGUF only, matrices quantized)",
                        choices=tuple(DTYPES))
    overwrite: bool = option(False, "replace an earlier export in out (never a run's folder, nor files no export "
                                    "writes)")
    verify: bool = option(True, "read the export back and print its largest logit difference from the model")


def run(cfg: Config) -> dict:
    out = _check(cfg)
    model = load_model(cfg.init, device="cpu", dtype=None)
    progress(f"[{model.format}: {model.source}]")
    params, config = exported_form(model)
    write = _writer(model, params, config, cfg)
    progress(f"writing {cfg.format} ({cfg.dtype}) to {out} ...")
    # None: no meta.json in the export; keep= checks again, at the last moment, what the replace would delete
    build_folder(out, lambda builder: write(builder.path) and None, keep=lambda old: _replaceable(old, cfg) and False)
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    for name, size in files.items():
        progress(f"  {name}  {size / 2**20:,.1f} MiB")
    result = {"out": str(out), "files": files}
    if cfg.verify:
        result["max_logit_diff"] = _verify(model, _remote(config), out, cfg)
    return result


def _check(cfg: Config) -> Path:
    if not cfg.init:
        raise UserError("recipe=export needs init=PATH (a checkpoint, run folder, HF folder, GGUF file or smollm2)")
    if not cfg.out:
        raise UserError("recipe=export needs out=DIR (the folder to write)")
    if cfg.dtype == "q8_0" and cfg.format != "gguf":
        raise UserError("dtype=q8_0 is a GGUF quantization: use format=gguf, or dtype=fp32|bf16|f16 for format=hf")
    out = Path(cfg.out).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"out={cfg.out} is a file; out names the folder to write")
    if out.is_dir() and any(out.iterdir()) and not cfg.overwrite:
        raise UserError(f"out={cfg.out} exists and is not empty: choose another folder or pass overwrite=true")
    init = Path(cfg.init).expanduser()
    if init.exists() and out.exists() and (init.resolve() == out.resolve() or out.resolve() in init.resolve().parents):
        raise UserError(f"init={cfg.init} is inside out={cfg.out}: the export would replace its own source; "
                        f"choose another out=")
    if out.is_dir():
        _replaceable(out, cfg)
    return out


def _replaceable(out: Path, cfg: Config) -> bool:
    """True when ``out`` holds only what an export writes (``EXPORT_FILES``), else a UserError naming the live run
    that holds it or the first entry export did not write."""
    who = holder(out)
    if who is not None:
        raise UserError(f"out={cfg.out} is in use by a run ({who}): export never writes into a run's folder; "
                        f"choose another out=")
    for entry in sorted(out.iterdir()):
        if entry.is_symlink() or not entry.is_file() or not any(fnmatch.fnmatch(entry.name, p) for p in EXPORT_FILES):
            what = "a run's lock" if entry.name == LOCK else "not written by an export"
            raise UserError(f"out={cfg.out} holds {entry.name} ({what}): overwrite=true replaces only an earlier "
                            f"export; choose another out=")
    return True


def exported_form(model: LoadedModel) -> tuple[dict, object]:
    """``(params, config)`` as written: a DBA student that is a plain Llama (``models.dba_llama``) as that Llama,
    anything else as loaded."""
    if model.arch != "dba":
        return model.params, model.config
    from purestep.models.dba_llama import as_llama, why_not_llama
    if why_not_llama(model.config):
        return model.params, model.config
    progress("the DBA student is a plain Llama (shared RoPE pairs, no semantic keys): written as one")
    return as_llama(model.params, model.config)


def _writer(model: LoadedModel, params: dict, config, cfg: Config):
    """``write(folder)`` for this model (``params``, ``config``: its exported form), format and dtype; what
    cannot be exported is refused here, first."""
    tok = model.tokenizer
    if cfg.format == "gguf" and model.arch == "mla":
        from purestep.models.mla_gguf import check_gguf, export_mla_gguf
        check_gguf(params, config)    # refuses what llama.cpp's deepseek2 cannot run before the weights are converted
        name = f"model-{cfg.dtype.upper().replace('FP32', 'F32')}.gguf"
        return lambda folder: export_mla_gguf(params, config, folder / name, tokenizer=tok,
                                              dtype=_gguf_dtype(cfg.dtype))
    if cfg.format == "gguf":
        from purestep.models.gguf_export import export_gguf, gguf_arch
        gguf_arch(config)             # refuses a model llama.cpp cannot run before the weights are converted
        name = f"model-{cfg.dtype.upper().replace('FP32', 'F32')}.gguf"
        return lambda folder: export_gguf(params, config, folder / name, tokenizer=tok, dtype=_gguf_dtype(cfg.dtype))
    from purestep.models.tokenizer_export import as_bpe
    bpe = as_bpe(tok) if tok is not None else None
    if tok is None:
        progress(f"note: {model.source} has no tokenizer; the folder gets none")
    dtype = DTYPES[cfg.dtype]
    if model.arch == "mla":
        from purestep.models.mla_hf import check_exportable, export_mla_hf
        check_exportable(params, config)
        return lambda folder: export_mla_hf(params, config, folder, tokenizer=bpe, dtype=dtype)
    if _remote(config):
        from purestep.models.dba_hf import export_dba_hf
        return lambda folder: export_dba_hf(params, config, folder, tokenizer=bpe, dtype=dtype)
    from purestep.models.hf import export_hf
    return lambda folder: export_hf(params, config, folder, tokenizer=bpe, dtype=dtype)


def _remote(config) -> bool:
    """Whether this (exported-form) config is written with remote code: a DBA student no format holds."""
    from purestep.models.dba import DBAConfig
    return isinstance(config, DBAConfig)


def _gguf_dtype(dtype: str) -> str:
    return {"fp32": "f32"}.get(dtype, dtype)


@torch.no_grad()
def _verify(model: LoadedModel, remote: bool, out: Path, cfg: Config) -> float | None:
    """Largest |logit difference| between the exported model and ``model`` (in fp32) on one fixed random
    sequence, or None when nothing here can read the export."""
    tokens = torch.randint(0, model.config.vocab_size, (1, CHECK_TOKENS), generator=torch.Generator().manual_seed(0))
    read = _read_back(remote, out, cfg)
    if read is None:
        progress("note: not verified (the DBA folder's remote code needs transformers: pip install transformers)")
        return None
    reader, logits = read
    diff = (logits(tokens).float() - model.module.apply(cast(model.params, torch.float32), tokens, model.config))
    diff = diff.abs().max().item()
    progress(f"verified with {reader}: max |logit diff| {diff:.3g} on {CHECK_TOKENS} tokens (exported in {cfg.dtype})")
    return diff


def _read_back(remote: bool, out: Path, cfg: Config):
    """``(reader name, tokens -> logits)`` of the export: transformers for an HF folder when installed (remote
    code for a DBA student written as one), else purestep's loader; None for a remote-code folder without
    transformers."""
    if cfg.format == "hf" and importlib.util.find_spec("transformers") is not None:
        import transformers
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=remote).float().eval()
        return "transformers" + (" (remote code)" if remote else ""), lambda tokens: hf_model(tokens).logits
    if remote:
        return None
    back = load_model(str(out if cfg.format == "hf" else next(out.glob("*.gguf"))))
    return "purestep's loader", lambda tokens: back.module.apply(back.params, tokens, back.config)
