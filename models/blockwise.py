"""Block-wise distillation math: the teacher's per-block inputs and outputs, the student's blocks run on them,
per-block losses, and the attention sublayer outputs that verification compares.

The procedure is the attention-transfer stage of LoLCATs (Zhang et al., ICLR 2025, arXiv
2410.10254: per-layer MSE between the teacher's softmax-attention outputs and the new attention's, on the teacher's
hidden states) and MOHAWK's hidden-state alignment (Bick et al. 2024, arXiv 2408.10189: per layer
min ||Block_T(u) - Block_S(u)|| on teacher inputs u, blocks independent), with MHA2MLA's partial-RoPE student
(Ji et al. 2025) as the block being trained. Only the attention differs between a teacher block and its student
block, so matching block outputs trains the attention through the (copied) MLP.

What is matched (``target``):

- ``block`` (default): the block's output, through the copied (frozen or trained) MLP, so an attention error counts
  as much as it changes what the next block sees (MOHAWK stage 2);
- ``attention``: the attention sublayer's output on the same normalized input, LoLCATs' stage-1 attention transfer.
  No MLP forward or backward: a cheaper step on a Llama whose MLP is most of the block.

Shapes: ``inputs`` and ``targets`` are [L, B, T, d]: the residual stream entering block l and, for ``block``, the
block's contribution (output - input), for ``attention`` the attention output. Storing the contribution rather
than the output keeps a low-precision cache exact where it matters (the large residual stream cancels out of the
loss before rounding, not after).

Two ways to feed the student:

- teacher-forced (default): block l of the student gets the teacher's input to block l. Every block's loss then
  depends only on that block's parameters, so the sum of the per-block losses has, for each block, exactly the
  gradient of its own loss: one backward trains every block.
- sequential: block l gets the student's own stream after blocks 0..l-1, **detached**, so the losses stay
  independent in the same way while the inputs are the ones the student will see at inference.

Either way the target of block l is the teacher's output of block l; the error of block l is
``(x_in + f_s(x_in)) - (x_t + d_t)`` (target ``block``) or ``attn_s(x_in) - attn_t(x_t)`` (target ``attention``).
"""
from __future__ import annotations

import torch

from purestep.core.tree import unstack
from purestep.models import dba, llama, mla
from purestep.models.loading import module_of
from purestep.models.llama import rms_norm

LOSSES = ("l1", "mse")
MODES = ("teacher_forced", "sequential")
TARGETS = ("block", "attention")


@torch.no_grad()
def teacher_io(params: dict, cfg: llama.LlamaConfig, tokens: torch.Tensor,
               target: str = "block") -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's block inputs and targets (block contributions or attention outputs), each [L, B, T, d],
    in at least float32 (a bf16-held teacher runs in bf16; its states are widened before the differences)."""
    hidden = torch.stack(llama.apply(params, tokens, cfg, return_hidden="only"))     # [L + 1, B, T, d]
    wide = llama.upcast(hidden.dtype)
    if target == "attention":
        return hidden[:-1].to(wide), attention_outputs(params, cfg, hidden[:-1]).to(wide)
    hidden = hidden.to(wide)
    inputs = hidden[:-1]
    return inputs, hidden[1:] - inputs


def _student_tables(cfg, T: int, device, dtype):
    """Per-layer (cos, sin) of a student: DBA's per layer and KV head, or MLA's one table for every layer."""
    positions = torch.arange(T, device=device)
    if isinstance(cfg, mla.MLAConfig):
        cos, sin = llama.rope_tables(mla.rope_frequencies(cfg, device), positions, dtype)     # [T, d_r]
        return [cos] * cfg.n_layers, [sin] * cfg.n_layers
    cos, sin = dba.rope_tables(cfg, positions, dtype)          # [L, G, T, geo]
    return cos.unbind(0), sin.unbind(0)


def student_deltas(params: dict, cfg, inputs: torch.Tensor) -> torch.Tensor:
    """Teacher-forced: each student block (DBA or MLA) on its own input, ``inputs`` [L, B, T, d] -> contributions [L, B, T, d]."""
    cos, sin = _student_tables(cfg, inputs.shape[2], inputs.device, inputs.dtype)
    out = [module_of(cfg).block(lp, x, c, s, cfg) - x
           for lp, x, c, s in zip(unstack(params["layers"]), inputs.unbind(0), cos, sin)]
    return torch.stack(out)


def student_outputs(params: dict, cfg, inputs: torch.Tensor, target: str = "block") -> torch.Tensor:
    """Teacher-forced student outputs for ``target`` (block contributions or attention outputs) [L, B, T, d]."""
    return attention_outputs(params, cfg, inputs) if target == "attention" else student_deltas(params, cfg, inputs)


def student_stream(params: dict, cfg, tokens: torch.Tensor,
                   target: str = "block") -> tuple[torch.Tensor, torch.Tensor]:
    """Sequential: the student's own stream, each block's input detached. Returns (inputs, outputs for
    ``target``: block contributions or attention outputs)."""
    x = torch.nn.functional.embedding(tokens, params["embed"])
    cos, sin = _student_tables(cfg, tokens.shape[1], tokens.device, x.dtype)
    inputs, outputs = [], []
    for lp, c, s in zip(unstack(params["layers"]), cos, sin):
        x = x.detach()
        if target == "attention":
            h = module_of(cfg).attention(lp["attn"], rms_norm(x, lp["attn_norm"], cfg.norm_eps), c, s, cfg)
            outputs.append(h)
            y = x + h
            y = y + llama.mlp(lp["mlp"], rms_norm(y, lp["mlp_norm"], cfg.norm_eps))
        else:
            y = module_of(cfg).block(lp, x, c, s, cfg)
            outputs.append(y - x)
        inputs.append(x)
        x = y
    return torch.stack(inputs), torch.stack(outputs)


def block_losses(inputs: torch.Tensor, outputs: torch.Tensor, teacher_inputs: torch.Tensor,
                 teacher_outputs: torch.Tensor, kind: str = "l1", target: str = "block") -> torch.Tensor:
    """Per-block mean L1 or MSE [L] between the student's block (or attention) outputs and the teacher's, in
    float32. For ``block`` the inputs count too (they differ in sequential mode: the block output is x + f(x))."""
    if kind not in LOSSES:
        raise ValueError(f"unknown blockwise loss {kind!r}; choose one of {', '.join(LOSSES)}")
    err = outputs.float() - teacher_outputs.float()
    if target == "block" and inputs is not teacher_inputs:
        err = err + (inputs.float() - teacher_inputs.float())
    per = err.abs() if kind == "l1" else err.square()
    return per.flatten(1).mean(1)


def attention_outputs(params: dict, cfg: llama.LlamaConfig, inputs: torch.Tensor) -> torch.Tensor:
    """The attention sublayer's output of every block, attn(rms_norm(x_l)), for block inputs [L, B, T, d]:
    a Llama (teacher) or DBA/MLA (student) model, chosen by the config's type."""
    T, device, dtype = inputs.shape[2], inputs.device, inputs.dtype
    layers = unstack(params["layers"])
    if isinstance(cfg, (dba.DBAConfig, mla.MLAConfig)):
        cos, sin = _student_tables(cfg, T, device, dtype)
        out = [module_of(cfg).attention(lp["attn"], rms_norm(x, lp["attn_norm"], cfg.norm_eps), c, s, cfg)
               for lp, x, c, s in zip(layers, inputs.unbind(0), cos, sin)]
    else:
        cos, sin = llama.rope_tables(llama.rope_frequencies(cfg), torch.arange(T, device=device), dtype)
        out = [llama.attention(lp["attn"], rms_norm(x, lp["attn_norm"], cfg.norm_eps), cos, sin, cfg)
               for lp, x in zip(layers, inputs.unbind(0))]
    return torch.stack(out)
