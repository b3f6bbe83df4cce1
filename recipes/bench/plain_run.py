"""The plain PyTorch loop's whole run, as nanoGPT's ``train.py`` runs it: the other side of ``recipe=bench.wall``.

``python -m purestep.recipes.bench.plain_run '<json>'`` (the keys of :class:`PlainRun`), one process from start-up to
exit: the corpus through purestep's own tokenizer cache (the same tokens ``recipe=standard`` reads), a Llama as an
``nn.Module`` (``models.llama_module.LlamaModule``, the seed's ``llama.init`` weights), ``torch.compile(module)``
called as nanoGPT's ``model(X, Y)``, so the cross entropy is compiled with the model (``loss_inside=false``: taken
eagerly on the compiled module's logits, the weaker loop), ``torch.optim.AdamW(fused=True)`` with nanoGPT's groups
(decay on the 2-D weights), nanoGPT's learning rate (linear warmup, cosine to ``min_lr``), ``loss.backward()``,
``clip_grad_norm_(1.0)``, nanoGPT's ``get_batch`` (random windows, ``torch.randint``), ``loss.item()`` every
``log_every`` steps, under ``dtype``'s autocast. Every ``eval_every`` steps and at the end: ``model.eval()`` and
``torch.no_grad()`` over the same ``eval_batches`` validation windows ``recipe=standard`` evaluates, then
``torch.save`` of the model's and the optimizer's state when the loss improved (nanoGPT's
``always_save_checkpoint=False``). Prints one line ``PLAIN_RUN {json}``: the final validation loss, the seconds spent
compiling (``core.compile.compile_seconds``), the steps' and the evaluations' seconds.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

START = time.perf_counter()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from purestep.core.compile import compile_seconds  # noqa: E402
from purestep.core.gradients import autocast  # noqa: E402
from purestep.core.data.documents import prepare_data  # noqa: E402
from purestep.models import llama  # noqa: E402
from purestep.models.llama_module import LlamaModule, load_params  # noqa: E402

MARK = "PLAIN_RUN "


@dataclass
class PlainRun:
    data: str
    tokenizer: str
    out: str
    n_layers: int = 4
    n_heads: int = 4
    d_model: int = 128
    batch_size: int = 12
    block_size: int = 64
    steps: int = 2000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    beta2: float = 0.99
    weight_decay: float = 0.1
    eval_every: int = 250
    eval_batches: int = 20
    log_every: int = 10
    compile: bool = True
    dtype: str = "fp32"   # nanoGPT's: fp32 on the CPU; bf16/fp16 autocast (its ``ctx`` on GPUs)
    loss_inside: bool = True   # the cross entropy compiled with the module (nanoGPT's forward(idx, targets))
    seed: int = 1337


def nanogpt_lr(step: int, total: int, warmup: int = 100, peak: float = 1e-3, floor: float = 1e-4) -> float:
    """nanoGPT's ``get_lr``: linear warmup to ``peak``, cosine to ``floor`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    ratio = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - floor)


def nanogpt_adamw(module: torch.nn.Module, lr: float, beta2: float, weight_decay: float = 0.1,
                  fused: bool = True) -> tuple[list, torch.optim.AdamW]:
    """``(params, optimizer)``: nanoGPT's ``configure_optimizers`` for ``module``, AdamW with weight decay on the
    2-D weights only, fused (or foreach)."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    kind = {"fused": True} if fused else {"foreach": True}
    return params, torch.optim.AdamW(groups, lr=lr, betas=(0.9, beta2), **kind)


def loss_of(model, x: torch.Tensor, y: torch.Tensor, inside: bool = True) -> torch.Tensor:
    """The mean cross entropy of ``model`` on ``x`` against ``y``: ``inside``, the module's own (nanoGPT's
    ``model(X, Y)``, compiled with it under ``torch.compile``), else taken eagerly on the logits it returns."""
    if inside:
        return model(x, y)
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def run(cfg: PlainRun) -> dict:
    torch.manual_seed(cfg.seed)
    corpus = prepare_data(cfg.data, cfg.tokenizer)
    train = torch.from_numpy(corpus.train.astype("int64"))
    val = corpus.eval_batches(cfg.batch_size, cfg.block_size, cfg.eval_batches)
    model_cfg = llama.LlamaConfig(vocab_size=corpus.tokenizer.vocab_size, d_model=cfg.d_model,
                                  n_layers=cfg.n_layers, n_heads=cfg.n_heads)
    module = load_params(LlamaModule(model_cfg), llama.init(model_cfg, seed=cfg.seed))
    model = torch.compile(module) if cfg.compile else module
    params, opt = nanogpt_adamw(module, cfg.lr, cfg.beta2, cfg.weight_decay)
    out, best, seconds = Path(cfg.out), float("inf"), {"steps": 0.0, "evals": 0.0, "saves": 0.0}
    out.mkdir(parents=True, exist_ok=True)

    def get_batch():
        ix = torch.randint(len(train) - cfg.block_size - 1, (cfg.batch_size,))
        span = ix[:, None] + torch.arange(cfg.block_size + 1)
        windows = train[span]
        return windows[:, :-1], windows[:, 1:]

    ctx = autocast(cfg.dtype, "cpu")   # nanoGPT's ctx: nullcontext on the CPU, autocast on GPUs

    def evaluate() -> float:
        model.eval()
        with torch.no_grad(), ctx:
            losses = [loss_of(model, b["x"], b["y"], cfg.loss_inside).item() for b in val]
        model.train()
        return sum(losses) / len(losses)

    setup_s = time.perf_counter() - START
    loss_value = float("nan")
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = nanogpt_lr(step - 1, cfg.steps, cfg.warmup_steps, cfg.lr, cfg.min_lr)
        x, y = get_batch()
        with ctx:
            loss = loss_of(model, x, y, cfg.loss_inside)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % cfg.log_every == 0:
            loss_value = loss.item()
        seconds["steps"] += time.perf_counter() - t0
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
            t0 = time.perf_counter()
            val_loss = evaluate()
            seconds["evals"] += time.perf_counter() - t0
            if val_loss < best:
                t0 = time.perf_counter()
                best = val_loss
                torch.save({"model": module.state_dict(), "optimizer": opt.state_dict(), "step": step},
                           out / "ckpt.pt")
                seconds["saves"] += time.perf_counter() - t0
    return {"val_loss": val_loss, "best": best, "train_loss": loss_value, "setup_s": setup_s,
            "compile_s": compile_seconds(), **{f"{k}_s": v for k, v in seconds.items()},
            "process_s": time.perf_counter() - START}


def main(argv: list[str]) -> int:
    cfg = PlainRun(**json.loads(argv[0]))
    print(MARK + json.dumps({"config": asdict(cfg), **run(cfg)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
