"""Does llama.cpp compute what purestep computes? ``purestep recipe=bench.llamacpp [init=smollm2] [data=TEXT]``.

``recipe=export format=gguf`` writes ``init`` at each of ``dtypes`` (a Llama as llama.cpp's ``llama`` or ``qwen2``,
an MLA student, arch ``mla``, as its ``deepseek2``: ``models.mla_gguf``); llama.cpp (its Python binding,
``llama_cpp`` from the ``llama-cpp-python`` package, which purestep does not depend on: build it from its sdist)
loads each file, and both run the same tokens:

- **logits** over the first ``tokens`` tokens of the data's validation split (purestep's tokenizer): the
  largest |logit difference| (next to the largest |logit|, for scale), how often both put the same token on top,
  and the mean next-token NLL of each;
- **greedy decoding**: each continues the first ``prompt_tokens`` of that window on its own for
  ``greedy_tokens`` tokens, always taking the top token (llama.cpp through its own KV cache, purestep through the
  model's ``decoder``: ``models.llama``'s, or for an MLA student ``models.mla``'s absorbed decode over the cached
  latent, as llama.cpp's ``deepseek2`` decodes it); reported is how many leading tokens the two continuations
  share. llama.cpp keeps its KV cache in f16 by default (``kv_cache=f16``, what its users get); ``kv_cache=f32``
  computes as purestep does, which isolates what the export itself changes;
- **tokenization**: llama.cpp's tokenizer (reading the GGUF's ``tokenizer.ggml.*``) and purestep's on the
  window's text: whether the ids are the same.

Without ``llama_cpp`` the benchmark says so in one line and stops (exit 0). Exports and ``results.md`` go to
``out`` (default ``runs/bench-llamacpp-<timestamp>``); the table goes to stdout.
"""
from __future__ import annotations

import importlib
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from purestep.core.config import UserError, option, same_as
from purestep.core.data.documents import prepare_text
from purestep.core.io.logging import progress
from purestep.core.cli.runs import run_folder
from purestep.models.loading import load_model
from purestep.models.sampling import generate
from purestep.recipes.export import Config as ExportConfig, run as export
from purestep.recipes.train.config import TrainConfig

DESCRIPTION = "export to GGUF, run it in llama.cpp (llama-cpp-python), compare logits, greedy tokens and NLL"
DTYPES = ("fp32", "f16", "bf16", "q8_0")
KV_CACHE = ("f16", "f32")
SKIP = ("bench.llamacpp: skipped: llama_cpp is not importable (pip install llama-cpp-python, built from its "
        "sdist; purestep does not depend on it)")


@dataclass
class Config:
    init: str = option("smollm2", "the model: a checkpoint, a run folder, an HF folder, a GGUF file or 'smollm2'")
    data: str = same_as(TrainConfig, "data")
    dtypes: tuple[str, ...] = option(("fp32",), f"GGUF exports to run in llama.cpp, among {', '.join(DTYPES)}")
    tokens: int = option(256, "tokens of the data's validation split the logits and NLL are compared on", min=2)
    prompt_tokens: int = option(32, "the first tokens of that window, continued greedily by both", min=1)
    greedy_tokens: int = option(300, "tokens each generates greedily after the prompt", min=1)
    threads: int = option(0, "llama.cpp's threads (0: as many as torch uses)", min=0)
    kv_cache: str = option("f16", "llama.cpp's KV cache type (f16: its default; f32: as purestep computes)",
                           choices=KV_CACHE)
    out: str = option("", "folder for the exports and results.md (default: runs/bench-llamacpp-<timestamp>)")


def find_llama_cpp():
    """The ``llama_cpp`` module, or None when it is not installed or does not import."""
    try:
        return importlib.import_module("llama_cpp")
    except (ImportError, OSError):      # OSError: the package is there but its shared library does not load
        return None


def run(cfg: Config) -> dict:
    bad = [d for d in cfg.dtypes if d not in DTYPES]
    if bad:
        raise UserError(f"dtypes: {', '.join(map(str, bad))} not one of {', '.join(DTYPES)}")
    if cfg.prompt_tokens >= cfg.tokens:
        raise UserError(f"prompt_tokens={cfg.prompt_tokens} must be below tokens={cfg.tokens} (the prompt is the "
                        f"start of the compared window)")
    llama_cpp = find_llama_cpp()
    if llama_cpp is None:
        print(SKIP)
        return {"skipped": SKIP}
    root = run_folder(cfg.out, "", "bench-llamacpp")
    model = load_model(cfg.init)
    if model.tokenizer is None:
        raise UserError(f"init={cfg.init} ({model.format}) has no tokenizer: its GGUF would carry none for llama.cpp")
    window = _window(cfg, model.tokenizer)
    text = model.tokenizer.decode(window.tolist())
    ours = _purestep(model, window, cfg)
    rows = []
    for dtype in cfg.dtypes:
        folder = root / f"gguf-{dtype}"
        export(ExportConfig(init=cfg.init, format="gguf", dtype=dtype, out=str(folder), overwrite=True, verify=False))
        path = next(folder.glob("*.gguf"))
        progress(f"llama.cpp: {path}")
        theirs = _llama_cpp(llama_cpp, path, window, text, cfg)
        rows.append({"export": f"{path.name}", **compare(ours, theirs, window, model.tokenizer.encode(text))})
    header = (f"{model.source} ({model.format}); {cfg.tokens} tokens of data={cfg.data}, greedy {cfg.greedy_tokens} "
              f"after {cfg.prompt_tokens}; llama.cpp's KV cache {cfg.kv_cache}; llama-cpp-python "
              f"{llama_cpp.__version__}, torch {torch.__version__}, {platform.machine()}")
    table = header + "\n\n" + _table(rows)
    (root / "results.md").write_text(table + "\n")
    print(table)
    return {"rows": rows, "out": str(root)}


def _window(cfg: Config, tokenizer) -> torch.Tensor:
    corpus = prepare_text(cfg.data, tokenizer)
    if len(corpus.val) < cfg.tokens:
        raise UserError(f"data={cfg.data}: its validation split has {len(corpus.val)} tokens, tokens={cfg.tokens} "
                        f"are needed")
    return torch.from_numpy(corpus.val[:cfg.tokens].astype("int64"))


@torch.no_grad()
def _purestep(model, window: torch.Tensor, cfg: Config) -> dict:
    """purestep's fp32 logits over ``window`` and its greedy continuation of the window's prompt."""
    logits = model.module.apply(model.params, window[None], model.config)[0]
    prompt = window[None, :cfg.prompt_tokens]
    decode = model.module.decoder(model.params, model.config, 1, cfg.prompt_tokens + cfg.greedy_tokens)   # mla: latent
    greedy = generate(decode, prompt, cfg.greedy_tokens, temperature=0)[0]
    return {"logits": logits.float(), "greedy": greedy.tolist()}


def _llama_cpp(llama_cpp, path: Path, window: torch.Tensor, text: str, cfg: Config) -> dict:
    """llama.cpp's logits over ``window``, its greedy continuation of the prompt, and its ids for ``text``."""
    n_ctx = max(cfg.tokens, cfg.prompt_tokens + cfg.greedy_tokens)
    threads = cfg.threads or torch.get_num_threads()
    kv = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}[cfg.kv_cache]
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                          n_threads=threads, n_threads_batch=threads, type_k=kv, type_v=kv, verbose=False)
    # special=True: the window may hold the document separator, which purestep's tokenizer (as HF's) reads back as
    # the special token; llama.cpp would spell it out as text otherwise
    ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    llm.eval(window.tolist())
    logits = np.array(llm.scores[:llm.n_tokens], dtype=np.float32)
    llm.reset()
    llm.eval(window[:cfg.prompt_tokens].tolist())
    greedy = []
    for _ in range(cfg.greedy_tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(token)
        llm.eval([token])
    llm.close()
    return {"logits": torch.from_numpy(logits), "greedy": greedy, "ids": ids}


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def nll(logits: torch.Tensor, window: torch.Tensor) -> float:
    """Mean next-token negative log-likelihood of ``window`` under ``logits`` [T, V] (position t predicts t+1)."""
    return torch.nn.functional.cross_entropy(logits[:-1].double(), window[1:]).item()


def compare(ours: dict, theirs: dict, window: torch.Tensor, our_ids: list[int]) -> dict:
    """The table's numbers for one export: purestep's measurements (``_purestep``) against llama.cpp's."""
    a, b = ours["logits"], theirs["logits"]
    if a.shape != b.shape:
        raise UserError(f"llama.cpp returned logits of shape {tuple(b.shape)}, purestep {tuple(a.shape)}")
    return {"max_abs_logit": a.abs().max().item(), "max_logit_diff": (a - b).abs().max().item(),
            "top1_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "greedy_shared": shared_prefix(ours["greedy"], theirs["greedy"]), "greedy_of": len(ours["greedy"]),
            "nll_purestep": nll(a, window), "nll_llama_cpp": nll(b, window),
            "same_ids": theirs["ids"] == our_ids}


def _table(rows: list[dict]) -> str:
    lines = ["| export | max abs logit | max abs logit diff | top-1 agree | greedy shared | NLL purestep | "
             "NLL llama.cpp | tokenizer |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['export']} | {r['max_abs_logit']:.2f} | {r['max_logit_diff']:.3g} | "
                     f"{100 * r['top1_agree']:.1f}% | {r['greedy_shared']}/{r['greedy_of']} | "
                     f"{r['nll_purestep']:.5f} | {r['nll_llama_cpp']:.5f} | "
                     f"{'same ids' if r['same_ids'] else 'ids differ'} |")
    return "\n".join(lines)
