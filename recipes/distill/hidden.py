"""Hidden-state targets for distillation: ``recipe=distill hidden=2:4,4:8 hidden_weight=1 hidden_loss=mse``.

Each pair ``s:t`` asks the student's residual stream after ``s`` blocks to match the teacher's after ``t`` blocks
(0 is the embeddings; ``n_layers`` the last block's output, before the final norm): the states
``llama.apply(return_hidden=True)`` returns, the same ones the upcycle's blockwise phase reads its targets from
(``models.blockwise.teacher_io``). FitNets (Romero et al. 2015) matches a student layer to a teacher layer through a
learned regressor where the widths differ; TinyBERT (Jiao et al. 2020) uses MSE of ``h_s W`` against ``h_t`` per
layer pair; DistilBERT (Sanh et al. 2019) a cosine loss on same-width states. Here:

- ``hidden_loss=mse``: the mean over positions and features of ``(h_s W - h_t)^2``; ``cosine``: the mean over
  positions of ``1 - cos(h_s W, h_t)``;
- ``W`` [d_student, d_teacher] is trained with the student (``params["hidden_proj"]["s:t"]``, initialised
  N(0, 1/d_student)) when the widths differ, and is the identity (no parameter) when they agree; it is no part of
  the student model, and is dropped wherever the student is read as a model, like the learnable temperature;
- the term is ``hidden_weight`` times the mean over the pairs, added to the KD objective, over the positions the
  CE or KL counts; its value is logged as ``hidden``.

The teacher's states come from its forward in the train step, so hidden targets need the online teacher (not a
cache).
"""
from __future__ import annotations

import torch

from purestep.core.config import ConfigError
from purestep.models import llama

PROJ = "hidden_proj"          # the projections' subtree of the params pytree (never the student's)
LOSSES = ("mse", "cosine")


def pairs(spec: str, student: llama.LlamaConfig, teacher: llama.LlamaConfig) -> list[tuple[int, int]]:
    """The ``(student, teacher)`` layer pairs of ``hidden=``; a ConfigError naming the key for a bad one."""
    found = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            s, t = (int(v) for v in item.split(":"))
        except ValueError:
            raise ConfigError(f"bad value for 'hidden': {item!r}; give student:teacher layer pairs such as "
                              f"2:4,4:8") from None
        if not (0 <= s <= student.n_layers and 0 <= t <= teacher.n_layers):
            raise ConfigError(f"bad value for 'hidden': {item!r}; the student has states 0 to {student.n_layers}, "
                              f"the teacher 0 to {teacher.n_layers}")
        found.append((s, t))
    if len(set(found)) != len(found):
        raise ConfigError(f"bad value for 'hidden': {spec!r} names a pair twice")
    return found


def init_projections(layer_pairs, student: llama.LlamaConfig, teacher: llama.LlamaConfig, seed: int,
                     device=None) -> dict:
    """``{"s:t": W [d_student, d_teacher]}`` where the widths differ, else ``{}``."""
    if student.d_model == teacher.d_model:
        return {}
    g = torch.Generator().manual_seed(seed)
    return {f"{s}:{t}": (torch.randn(student.d_model, teacher.d_model, generator=g) / student.d_model ** 0.5).to(device)
            for s, t in layer_pairs}


def distance(student: torch.Tensor, teacher: torch.Tensor, kind: str, mask: torch.Tensor) -> torch.Tensor:
    """The mean over ``mask``'s positions of ``kind`` between states ``[.., T, d]`` (module docstring), float32."""
    s, t = student.float(), teacher.float()
    per = (s - t).square().mean(-1) if kind == "mse" else 1 - torch.nn.functional.cosine_similarity(s, t, dim=-1)
    weight = mask.float()
    return (per * weight).sum() / weight.sum().clamp(min=1)


def hidden_term(params: dict, student_states: list, teacher_states: list, layer_pairs, kind: str,
                mask: torch.Tensor) -> torch.Tensor:
    """The mean over ``layer_pairs`` of :func:`distance` between the (projected) student and teacher states."""
    proj = params.get(PROJ, {})
    terms = []
    for s, t in layer_pairs:
        h = student_states[s]
        w = proj.get(f"{s}:{t}")
        terms.append(distance(h if w is None else h @ w.to(h.dtype), teacher_states[t].detach(), kind, mask))
    return torch.stack(terms).mean()
