"""SWATS: switching from Adam to SGD (Keskar & Socher 2017, "Improving Generalization Performance by
Switching from Adam to SGD", arXiv 1712.07628, Algorithm 1), as one optax-shaped transform.

Adam phase, per group: ``m, a`` are Adam's moments and ``p_k = -alpha_k * m_hat / (sqrt(a_hat) + eps)``
is the Adam step actually taken (``alpha_k`` = base lr x schedule). Whenever ``p_k . g_k != 0``:

- ``gamma_k = (p_k . p_k) / (-p_k . g_k)``: the SGD learning rate whose step projected on ``p_k`` is ``p_k``;
- ``lambda_k = beta2 * lambda_{k-1} + (1 - beta2) * gamma_k`` (``lambda_0 = 0``), ``Lambda_k = lambda_k / (1 - beta2**k)``;
- switch when ``k > 1`` and ``|Lambda_k - gamma_k| < switch_eps`` (and ``Lambda_k > 0``, the guard of the
  Mrpatekful reference: a negative SGD learning rate is meaningless). The step that triggers the switch is
  still an Adam step.

SGD phase: ``v_k = beta1 * v_{k-1} + g_k`` with ``v = 0`` at the switch, ``w_k = w_{k-1} - (1 - beta1) * lr_k * v_k``
with ``lr_k = Lambda * alpha_k / alpha_switch``: exactly ``Lambda`` at the switch, then following the run's
schedule relative to the switch step (the paper decays the SGD rate on the same schedule), and honouring
``scale_lr`` (a rollback's lr cut).

``switch_eps`` default 1e-5: the paper's 1e-9 practically never fires in float32, so 1e-5 is what
third-party reproductions use. Weight decay: the reference code adds L2 to
the gradient (``chain(add_decayed_weights(wd), swats(...))`` does that, with an L2-sized ``wd``); the
``weight_decay`` argument instead decays decoupled, AdamW's ``p <- p - alpha_k * wd * p`` at the Adam
learning rate in both phases, so the Adam phase is exactly AdamW and the switch does not change the
shrinkage. ``p_k`` in ``gamma_k`` is the Adam step without the decay, as in the paper.

Scope (``scope``): ``"global"`` (the paper and the Rethinking-SWATS README: one ``gamma`` from dot products
over all parameters, one switch for the model) or ``"per_group"`` (Mrpatekful, pytorch_optimizer: every
parameter tensor is a group with its own gamma, Lambda and switch; a stacked ``[L, ...]`` leaf is one group).
All state is tensors (phase as a bool vector, ``torch.where`` between the phases): no host sync, no recompile.
Its ``metrics`` (added to the step's metrics) are the learning rate and :func:`swats_metrics`: the switch
step and the estimated SGD learning rate reach the logs with no extra work.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from purestep.core.tree import tree_flatten, tree_map, tree_unflatten, zeros_like
from purestep.optim.adamw import ScaleByAdamState, scale_by_adam
from purestep.optim.base import GradientTransformation, counter, find_state, hparam_device, hparam_dtype, hparams
from purestep.optim.common import LearningRateState, decay_weights, scale_by_learning_rate
from purestep.optim.schedules import Schedule, constant

SCOPES = ("global", "per_group")


class SwatsState(NamedTuple):
    adam: ScaleByAdamState       # count k, m, a, (b1, b2, eps); frozen per group once it switched
    buf: dict                    # SGD momentum v (zero until a group switches)
    lr: LearningRateState        # base lr and schedule step, as in every other optimizer here
    phase: torch.Tensor          # bool [G]: the group runs SGD
    lam: torch.Tensor            # [G] lambda, the raw EMA of gamma
    gamma: torch.Tensor          # [G] last gamma
    sgd_lr: torch.Tensor         # [G] Lambda at the switch (0 until then)
    lr_at_switch: torch.Tensor   # [G] alpha_k of the switching step
    switch_step: torch.Tensor    # int64 [G]: k of the switching step (0: not switched)
    hparams: dict                # switch_eps


def swats(lr: float = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, switch_eps: float = 1e-5,
          scope: str = "global", schedule: Schedule | None = None, weight_decay: float = 0.0,
          mask=None) -> GradientTransformation:
    if scope not in SCOPES:
        raise ValueError(f"unknown SWATS scope {scope!r}; choose one of {', '.join(SCOPES)}")
    schedule = schedule or constant()

    def groups(params) -> int:
        return 1 if scope == "global" else len(tree_flatten(params)[0])

    def init(params):
        return _init(params, groups(params), dict(lr=lr, b1=b1, b2=b2, eps=eps, switch_eps=switch_eps,
                                                  weight_decay=weight_decay))

    adam_step = scale_by_adam().update                   # reads b1, b2, eps from state.adam.hparams
    lr_step = scale_by_learning_rate(lr, schedule).update  # reads the base lr from state.lr

    def update(updates, state, params=None):
        h = state.adam.hparams
        beta1, beta2 = h["b1"], h["b2"]
        g, spec = tree_flatten(updates)
        mu, nu, buf = (tree_flatten(t)[0] for t in (state.adam.mu, state.adam.nu, state.buf))
        dtype = state.lam.dtype

        # Adam phase (computed for every group; torch.where keeps the right one): p = -alpha * m_hat / (...)
        direction, adam_state = adam_step(updates, state.adam)
        p, lr_state = lr_step(direction, state.lr)
        k, alpha = adam_state.count, lr_state.current
        new_mu, new_nu, p = (tree_flatten(t)[0] for t in (adam_state.mu, adam_state.nu, p))
        pp = torch.stack([(x * x).sum().to(dtype) for x in p])
        pg = torch.stack([(x * y).sum().to(dtype) for x, y in zip(p, g)])
        if scope == "global":
            pp, pg = pp.sum().reshape(1), pg.sum().reshape(1)
        adam = ~state.phase
        seen = (pg != 0) & adam
        gamma = torch.where(seen, pp / torch.where(pg != 0, -pg, torch.ones_like(pg)), state.gamma)
        lam = torch.where(seen, beta2 * state.lam + (1 - beta2) * gamma, state.lam)
        big_lambda = lam / (1 - beta2 ** k)
        switch = seen & (k > 1) & (big_lambda > 0) & ((big_lambda - gamma).abs() < state.hparams["switch_eps"])

        # SGD phase for groups that switched at an earlier step
        ratio = torch.where(state.lr_at_switch > 0, alpha / state.lr_at_switch, torch.ones_like(alpha))
        sgd_scale = -(1 - beta1) * state.sgd_lr * ratio                     # [G]
        out, mu_o, nu_o, buf_o = _blend(scope, state.phase, sgd_scale, beta1, g, mu, nu, buf, p, new_mu, new_nu)
        new_state = SwatsState(
            adam=ScaleByAdamState(k, tree_unflatten(spec, mu_o), tree_unflatten(spec, nu_o), h),
            buf=tree_unflatten(spec, buf_o),
            lr=lr_state,
            phase=state.phase | switch, lam=lam, gamma=gamma,
            sgd_lr=torch.where(switch, big_lambda, state.sgd_lr),
            lr_at_switch=torch.where(switch, alpha.expand_as(state.lr_at_switch), state.lr_at_switch),
            switch_step=torch.where(switch, k, state.switch_step),
            hparams=state.hparams)
        # decoupled decay at the Adam rate in both phases, always applied: the rate is the state's hparam
        out = decay_weights(tree_unflatten(spec, out), params, -(alpha * state.hparams["weight_decay"]), mask)
        return tree_map(lambda u, x: u.to(x.dtype), out, updates), new_state

    return GradientTransformation(init, update, lambda state: {"lr": state.lr.current.float(),
                                                              **swats_metrics(state)})


def _init(params, n: int, h: dict) -> SwatsState:
    """SWATS's state: Adam's, the SGD momentum buffer, the learning rate's, and per group (``n``: 1 for the global
    scope, else one per leaf) the phase, the projection EMA ``lam``, the last ``gamma`` and the switch's values."""
    dtype, device = hparam_dtype(params), hparam_device(params)
    zeros = torch.zeros(n, dtype=dtype, device=device)
    lr = hparams(params, lr=h["lr"])
    return SwatsState(
        adam=ScaleByAdamState(counter(params), zeros_like(params), zeros_like(params),
                              hparams(params, b1=h["b1"], b2=h["b2"], eps=h["eps"])),
        buf=zeros_like(params),
        lr=LearningRateState(counter(params), lr["lr"], torch.zeros_like(lr["lr"])),
        phase=torch.zeros(n, dtype=torch.bool, device=device), lam=zeros, gamma=zeros.clone(),
        sgd_lr=zeros.clone(), lr_at_switch=zeros.clone(),
        switch_step=torch.zeros(n, dtype=torch.int64, device=device),
        hparams=hparams(params, switch_eps=h["switch_eps"], weight_decay=h["weight_decay"]))


def _blend(scope: str, phase, sgd_scale, beta1, g, mu, nu, buf, p, new_mu, new_nu):
    """Per leaf: the SGD-with-momentum step where its group switched, else Adam's step ``p`` (``torch.where``);
    the moments kept as they were in the SGD phase, the momentum buffer kept in the Adam phase."""
    leaf_group = (lambda i: 0) if scope == "global" else (lambda i: i)  # noqa: E731
    out, mu_o, nu_o, buf_o = [], [], [], []
    for i, (x, m, v, b, step, m1, v1) in enumerate(zip(g, mu, nu, buf, p, new_mu, new_nu)):
        sgd = phase[leaf_group(i)]
        b1_new = beta1 * b + x
        out.append(torch.where(sgd, sgd_scale[leaf_group(i)] * b1_new, step))
        mu_o.append(torch.where(sgd, m, m1))
        nu_o.append(torch.where(sgd, v, v1))
        buf_o.append(torch.where(sgd, b1_new, b))
    return out, mu_o, nu_o, buf_o


def swats_metrics(opt_state, prefix: str = "swats/") -> dict[str, torch.Tensor]:
    """0-d tensors for logging (no host sync): the fraction of groups that switched, the first switch
    step (0: none yet), Lambda (the estimated SGD lr; mean over switched groups, or the running estimate
    before any switch) and the current SGD lr. Empty if ``opt_state`` holds no SWATS."""
    s = find_state(opt_state, SwatsState)
    if s is None:
        return {}
    switched = s.phase.to(s.lam.dtype)
    n = switched.sum()
    running = (s.lam / (1 - s.adam.hparams["b2"] ** s.adam.count.clamp(min=1))).mean()
    lam = torch.where(n > 0, (s.sgd_lr * switched).sum() / n.clamp(min=1), running)
    first = torch.where(s.phase, s.switch_step, torch.full_like(s.switch_step, 2 ** 62)).min()
    ratio = torch.where(s.lr_at_switch > 0, s.lr.current / s.lr_at_switch, torch.zeros_like(s.lr_at_switch))
    return {f"{prefix}switched": switched.mean().float(), f"{prefix}switch_step": torch.where(n > 0, first, 0).float(),
            f"{prefix}Lambda": lam.float(), f"{prefix}sgd_lr": ((s.sgd_lr * ratio * switched).sum() / n.clamp(min=1)).float()}
