"""Knowledge-distillation losses on logits: pure functions, computed in float32 with ``log_softmax``.

Every KL here is **summed over the vocabulary and averaged over (non-masked) tokens**, the per-token LM
reduction of DistiLLM and DistillKit (``F.kl_div(..., reduction="sum") / n_tokens``); never PyTorch's
``reduction="mean"``, which would also divide by the vocabulary size. A masked position (target < 0) is left
out by ``torch.where`` on its inputs and its per-token value, never by a product with the mask, so whatever its
logits or cached targets hold (inf, NaN) neither its value nor its gradient reaches the loss.

- :func:`kd_loss`: KL at temperature T between softened distributions (Hinton, Vinyals & Dean 2015,
  "Distilling the Knowledge in a Neural Network"), forward KL(p||q) (mode-covering, = CE with soft targets
  up to the teacher's entropy), reverse KL(q||p) (mode-seeking; MiniLLM, Gu et al. ICLR 2024), or
  DistiLLM's symmetric mix (1 - lambda) * FKL + lambda * RKL with lambda = 0.9 (Ko et al. ICML 2024,
  ``jongwooko/distillm distillm/losses.py``), or GKD's generalized Jensen-Shannon divergence ``jsd``
  (Agarwal et al. ICLR 2024, "On-Policy Distillation of Language Models", eq. 1; TRL's
  ``GKDTrainer.generalized_jsd_loss``): with the mixture m = beta * p + (1 - beta) * q (TRL's convention:
  ``log m = logsumexp(log q + log(1 - beta), log p + log beta)``), JSD_beta = beta * KL(p||m) + (1 - beta) *
  KL(q||m), p the teacher, q the student. At beta = 0 and 1 the mixture degenerates (JSD -> 0), so there,
  as TRL does, it is the forward KL(p||q) and the reverse KL(q||p) exactly.
- :func:`distill_objective` / :func:`blend`: Hinton's ``alpha * T**2 * KL + (1 - alpha) * CE``; the T**2
  keeps the soft-target gradient scale independent of T.
- :func:`topk_kd_loss`: forward KL against a cached top-k teacher distribution. The missing mass
  M = 1 - sum(top-k p) is an **"other" bucket** (one of the three options in DistillKit's
  ``distillkit/lossfuncs/kl.py`` and the MaxText-KD notes): teacher and student are compared as
  distributions over k + 1 outcomes, the k ids plus "everything else", where the student's bucket is
  the log-sum-exp of its log-probs outside the k ids. With k = V the bucket is empty and this is exact KL.
  The generalized JSD over the same k + 1 outcomes too (``direction="jsd"``).
- :func:`sample_teacher` / :func:`sampled_kd_loss`: Random-Sampling KD (Anshumann et al., "Sparse Logit
  Sampling: Accelerating Knowledge Distillation in LLMs", ACL 2025): n ids drawn from the teacher with
  replacement, stored as unique ids and counts; ``weights = counts / n`` is an unbiased estimate of p,
  so CE with these sparse soft targets has the full forward-KL gradient in expectation (the proposal
  here is the teacher itself, so no importance ratio is needed). Top-k, by contrast, is biased.
- :func:`learnable_temperature`: CTKD (Li et al., "Curriculum Temperature for Knowledge Distillation",
  AAAI 2023, ``zhengli97/CTKD``): ``T = t_min + (t_max - t_min) * sigmoid(theta)`` (CTKD: 1 + 20 *
  sigmoid), with theta behind a gradient-reversal layer whose scale ramps 0 -> 1 by a cosine schedule,
  so the student minimizes the KD loss while the temperature maximizes it (adversarially) and a plain
  minimizing T cannot run away to an extreme. :func:`scheduled_temperature` is the non-learned option.

Temperatures may be Python floats or 0-d tensors (learned or scheduled inside a compiled step).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DIRECTIONS = ("forward", "reverse", "symmetric", "jsd")
IGNORE_INDEX = -100
"""The target id of a masked position (Hugging Face's and ``F.cross_entropy``'s convention); every negative
target is treated the same, so data that marks masked positions with -1 works too."""


def _keep(x: torch.Tensor, mask) -> torch.Tensor:
    """``x`` at the positions where ``mask`` (``[...]`` bool, broadcast over ``x``'s trailing axes) is true, 0
    elsewhere: a masked position's logits never enter the math, so inf or NaN there gives neither a NaN value nor a
    NaN gradient (``torch.where`` routes a zero gradient to the dropped side; a product by the mask would not:
    inf * 0 is NaN, and so is the backward of ``log_softmax`` over a NaN row)."""
    if mask is None:
        return x
    m = mask.reshape(*mask.shape, *(1,) * (x.dim() - mask.dim()))
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _masked_mean(per_token: torch.Tensor, mask) -> torch.Tensor:
    """Mean over the positions where ``mask`` is true, by ``torch.where`` (never a product by the mask)."""
    if mask is None:
        return per_token.mean()
    return _keep(per_token, mask).sum() / mask.sum().clamp(min=1).to(per_token.dtype)


def tempered_log_probs(logits: torch.Tensor, temperature) -> torch.Tensor:
    """``log_softmax(logits / T)`` in float32; ``-inf`` logits (a masked vocabulary) stay ``-inf`` without
    sending ``-inf / T`` through the graph (its gradient into a learnable T would be NaN)."""
    z = logits.float()
    masked = torch.isneginf(z)
    scaled = torch.where(masked, torch.zeros_like(z), z) / temperature
    return F.log_softmax(torch.where(masked, torch.full_like(z, float("-inf")), scaled), dim=-1)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position, summed over the last (vocabulary) axis.

    Terms with p = 0 are 0 (``0 log 0 = 0``, as ``torch.xlogy`` has it), so a masked vocabulary (logits of
    ``-inf``) gives a finite KL; written with ``where`` on both logs, not ``xlogy``, so that the gradient
    (into a learnable temperature too) stays finite where p = 0.
    """
    p = log_p.exp()
    support = p > 0
    zero = torch.zeros_like(log_p)
    return (p * (torch.where(support, log_p, zero) - torch.where(support, log_q, zero))).sum(-1)


def _log_mixture(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(beta * p + (1 - beta) * q)`` for 0 < beta < 1, a two-term log-sum-exp written with ``where`` so that
    an outcome neither puts mass on (both logs ``-inf``: a masked vocabulary) gives ``-inf`` with a zero, not NaN,
    gradient (``torch.logsumexp``'s backward is ``exp(-inf - -inf)`` = NaN there)."""
    a, b = log_p + math.log(beta), log_q + math.log1p(-beta)
    top = torch.maximum(a, b)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = (a - top).exp() + (b - top).exp()
    some = total > 0
    return torch.where(some, top + torch.where(some, total, torch.ones_like(total)).log(),
                       torch.full_like(total, float("-inf")))


def jsd(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD's generalized JSD per position (summed over the last axis): ``beta * KL(p||m) + (1 - beta) * KL(q||m)``,
    ``m = beta * p + (1 - beta) * q``; ``p`` the teacher, ``q`` the student (Agarwal et al. 2024, eq. 1, with
    TRL's ``generalized_jsd_loss`` conventions). ``beta`` 0 is the forward KL(p||q), 1 the reverse KL(q||p), as
    TRL has them (the mixture degenerates there)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"the generalized JSD's beta must be in [0, 1], not {beta}")
    if beta == 0.0:
        return _kl(log_p, log_q)
    if beta == 1.0:
        return _kl(log_q, log_p)
    log_m = _log_mixture(log_p, log_q, beta)
    return beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, temperature=1.0,
            direction: str = "forward", symmetric_lambda: float = 0.9, beta: float = 0.5, mask=None) -> torch.Tensor:
    """KL between teacher p = softmax(z_t / T) and student q = softmax(z_s / T), at temperature T.

    ``direction``: ``forward`` KL(p||q), ``reverse`` KL(q||p), ``symmetric`` (1 - lambda) * FKL + lambda * RKL,
    ``jsd`` the generalized JSD with ``beta`` (:func:`jsd`: 0 forward, 1 reverse KL).
    Summed over the vocabulary, averaged over the positions where ``mask`` (``[...]`` bool) is true.
    The caller multiplies by T**2 (see :func:`blend`).
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown KL direction {direction!r}; choose one of {', '.join(DIRECTIONS)}")
    log_q = tempered_log_probs(_keep(student_logits, mask), temperature)
    log_p = tempered_log_probs(_keep(teacher_logits, mask), temperature)
    if direction == "forward":
        per_token = _kl(log_p, log_q)
    elif direction == "reverse":
        per_token = _kl(log_q, log_p)
    elif direction == "jsd":
        per_token = jsd(log_p, log_q, beta)
    else:
        per_token = (1 - symmetric_lambda) * _kl(log_p, log_q) + symmetric_lambda * _kl(log_q, log_p)
    return _masked_mean(per_token, mask)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, in float32 at least (half types upcast, float64 kept); targets < 0
    are ignored (``IGNORE_INDEX``, -100, or any other negative id). The loss of every model here
    (``llama.loss``, ``dba.loss``)."""
    wide = torch.promote_types(logits.dtype, torch.float32)
    keep = targets >= 0
    logits = _keep(logits.to(wide), keep)      # an ignored row's inf/NaN would make its gradient NaN
    targets = torch.where(keep, targets, IGNORE_INDEX).flatten()
    return F.cross_entropy(logits.flatten(0, -2), targets, ignore_index=IGNORE_INDEX)


def blend(kl: torch.Tensor, ce: torch.Tensor, *, alpha: float, temperature) -> tuple[torch.Tensor, dict]:
    """Hinton's objective ``alpha * T**2 * kl + (1 - alpha) * ce`` and its parts as 0-d metrics."""
    t = torch.as_tensor(temperature, dtype=torch.float32, device=ce.device)
    loss = alpha * t * t * kl + (1 - alpha) * ce
    return loss, {"kl": kl.detach(), "ce": ce.detach(), "temperature": t.detach()}


def distill_objective(student_logits: torch.Tensor, targets: torch.Tensor, teacher_logits: torch.Tensor, *,
                      alpha: float, temperature=1.0, direction: str = "forward",
                      symmetric_lambda: float = 0.9, beta: float = 0.5, kd_mask=None) -> tuple[torch.Tensor, dict]:
    """``alpha * T**2 * KL_T(teacher, student) + (1 - alpha) * CE(student, targets)``, aux {kl, ce, temperature}.

    Positions whose target is negative are left out of both terms; ``kd_mask`` (``[...]`` bool), when given, says
    instead which positions the KL counts (on-policy distillation: the student's own tokens have a teacher
    distribution but no CE target).
    """
    kl = kd_loss(student_logits, teacher_logits, temperature=temperature, direction=direction,
                 symmetric_lambda=symmetric_lambda, beta=beta, mask=targets >= 0 if kd_mask is None else kd_mask)
    return blend(kl, cross_entropy(student_logits, targets), alpha=alpha, temperature=temperature)


# ---------------------------------------------------------------------------------------- cached targets

def teacher_topk(teacher_logits: torch.Tensor, k: int, temperature=1.0):
    """``(ids [.., k], log-probs [.., k], missing mass [..])`` of the teacher at temperature T (for a cache)."""
    return topk_targets(tempered_log_probs(teacher_logits, temperature), k)


def topk_targets(log_p: torch.Tensor, k: int):
    """:func:`teacher_topk` of log-probs ``log_p`` [.., V] already at their temperature."""
    logprobs, ids = log_p.topk(k, dim=-1)
    missing = (1.0 - logprobs.exp().sum(-1)).clamp(min=0.0)
    return ids, logprobs, missing


def cache_kl(log_p: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor,
             missing_mass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rounding, truncation)`` per position ``[..]``, in nats: what a top-k cache loses of the teacher's full
    distribution p (its log-probs ``log_p`` [.., V] at the cache's temperature), in two parts that sum to
    ``KL(p || p_hat)``, where ``p_hat`` is the cache's log-probs ``logprobs`` on ``ids`` [.., k] and its missing mass
    spread evenly over the other V - k ids::

        rounding   = sum_{i in ids} p_i (log p_i - log p_hat_i) + M (log M - log M_hat) + (S_hat - 1)
        truncation = sum_{j not in ids} p_j log p_j - M log(M / (V - k))

    with ``M`` the teacher's mass outside ``ids``, ``M_hat`` the cached one and ``S_hat`` the sum of the cached
    probabilities and ``M_hat``. ``rounding`` is the KL over the k + 1 outcomes :func:`topk_kd_loss` sees (the k ids
    and the "other" bucket), exact targets against stored ones: what a storage format adds (0 for exact values). Where
    rounded values do not sum to one it is the generalized KL (I-divergence, with ``S_hat - 1``), never negative.
    ``truncation`` is M times the KL of the teacher's tail from even: what keeping k ids loses, whatever the format.
    Each sum is formed apart (no difference of two entropies), so float32 keeps a small KL's digits."""
    p = log_p.exp()
    ids = ids.long()
    log_p_k = log_p.gather(-1, ids)
    p_k = log_p_k.exp()
    rounding = torch.where(p_k > 0, p_k * (log_p_k - logprobs.float()), torch.zeros_like(p_k)).sum(-1)
    rest = log_p.shape[-1] - ids.shape[-1]
    if rest == 0:
        return rounding, torch.zeros_like(rounding)
    m = p.scatter(-1, ids, 0.0).sum(-1)
    tiny = torch.finfo(torch.float32).tiny
    log_m, log_m_hat = m.clamp(min=tiny).log(), missing_mass.float().clamp(min=tiny).log()
    rounding = rounding + torch.where(m > 0, m * (log_m - log_m_hat), torch.zeros_like(m))
    rounding = rounding + (logprobs.float().exp().sum(-1) + missing_mass.float() - 1)
    plogp = torch.where(p > 0, p * log_p, torch.zeros_like(p)).scatter(-1, ids, 0.0).sum(-1)
    truncation = plogp - torch.where(m > 0, m * (log_m - math.log(rest)), torch.zeros_like(m))
    return rounding, truncation


def topk_kd_loss(student_logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor,
                 missing_mass: torch.Tensor, temperature=1.0, mask=None, *, direction: str = "forward",
                 beta: float = 0.5) -> torch.Tensor:
    """Forward KL (or ``direction="jsd"``: the generalized JSD with ``beta``) against a cached top-k teacher, the
    missing mass as an "other" bucket.

    ``ids``/``logprobs`` ``[.., k]`` are the teacher's top-k at the temperature the cache was captured at
    (which must be ``temperature``); ``missing_mass`` ``[..]`` is 1 - sum(top-k p). Per position::

        sum_i p_i (log p_i - log q_i) + M_t (log M_t - log M_s),   log M_s = logsumexp(log q outside ids)

    i.e. KL over k + 1 outcomes. With k = V the bucket is empty and this equals :func:`kd_loss` (forward):
    the float32 rounding that leaves a tiny M_t > 0 is then ignored (it would multiply an empty bucket's
    log-mass, about -3.4e38). ``jsd`` is :func:`jsd` over the same k + 1 outcomes (the bucket counts even where
    M_t = 0: the student's mass there is in the mixture); its ``beta = 1`` end, the reverse KL, is infinite
    where M_t = 0 and the student has mass outside the k ids.
    """
    if direction not in ("forward", "jsd"):
        raise ValueError(f"a top-k cache gives direction forward or jsd, not {direction!r}")
    log_q = tempered_log_probs(_keep(student_logits, mask), temperature)
    ids = _keep(ids.long(), mask)
    log_q_k = log_q.gather(-1, ids)
    log_p_k = _keep(logprobs.float(), mask)
    # the student's mass outside the k ids; finfo.min (not -inf) keeps an empty bucket's gradient finite
    outside = log_q.scatter(-1, ids, torch.finfo(log_q.dtype).min)
    log_m_s = torch.logsumexp(outside, dim=-1)
    m_t = _keep(missing_mass.float(), mask)
    bucket = ids.shape[-1] < log_q.shape[-1]
    if direction == "jsd":
        if bucket:   # k + 1 outcomes: the k ids and "everything else"
            log_m_t = torch.where(m_t > 0, torch.where(m_t > 0, m_t, torch.ones_like(m_t)).log(),
                                  torch.full_like(m_t, float("-inf")))
            log_p_k = torch.cat([log_p_k, log_m_t[..., None]], -1)
            log_q_k = torch.cat([log_q_k, log_m_s[..., None]], -1)
        return _masked_mean(jsd(log_p_k, log_q_k, beta), mask)
    has_rest = m_t > 0 if bucket else torch.zeros_like(m_t, dtype=torch.bool)
    safe_m_t = torch.where(has_rest, m_t, torch.ones_like(m_t))
    rest = torch.where(has_rest, m_t * (safe_m_t.log() - log_m_s), torch.zeros_like(m_t))
    return _masked_mean(_kl(log_p_k, log_q_k) + rest, mask)


def sample_teacher(teacher_logits: torch.Tensor, n: int, temperature=1.0, generator=None):
    """Random-Sampling KD targets: ``(ids [.., n], counts [.., n])`` from ``n`` draws of softmax(z_t / T).

    Draws are with replacement; each row holds its distinct ids first (sorted) with their counts, then
    padding with count 0. ``counts / n`` is an unbiased estimate of the teacher's distribution.
    """
    probs = tempered_log_probs(teacher_logits, temperature).exp()
    flat = probs.reshape(-1, probs.shape[-1])
    draws, _ = torch.multinomial(flat, n, replacement=True, generator=generator).sort(-1)
    new = torch.ones_like(draws, dtype=torch.bool)
    new[:, 1:] = draws[:, 1:] != draws[:, :-1]
    group = new.long().cumsum(-1) - 1                 # slot of each draw's distinct id
    counts = torch.zeros_like(draws).scatter_add_(-1, group, torch.ones_like(draws))
    ids = torch.zeros_like(draws).scatter_(-1, group, draws)
    shape = (*probs.shape[:-1], n)
    return ids.reshape(shape), counts.reshape(shape)


def sampled_kd_loss(student_logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    temperature=1.0, mask=None) -> torch.Tensor:
    """Cross entropy with sparse soft targets: ``-sum_j w_j log q(ids_j)`` per position (Random-Sampling KD).

    With ``weights = counts / n`` from :func:`sample_teacher`, its expectation is H(p, q) = KL(p||q) + H(p),
    so its gradient is the forward-KL gradient in expectation (the value is the soft-target CE, not the KL).
    Zero-weight slots are padding.
    """
    log_q = tempered_log_probs(_keep(student_logits, mask), temperature)
    per_token = -(_keep(weights.float(), mask) * log_q.gather(-1, _keep(ids.long(), mask))).sum(-1)
    return _masked_mean(per_token, mask)


# ---------------------------------------------------------------------------------------- temperature

def grad_reverse(x: torch.Tensor, scale) -> torch.Tensor:
    """Identity forward; the gradient is multiplied by ``-scale`` (Ganin & Lempitsky 2015, used by CTKD).

    Written with tensors only (``-s x + detach((1 + s) x)``), so it works under ``torch.func`` transforms
    and ``torch.compile``: a custom ``autograd.Function`` inside ``func.grad_and_value`` is silently
    compiled with its natural, un-reversed gradient on torch 2.13.
    """
    return x * (-scale) + (x * (1 + scale)).detach()


def cosine_ramp(step: torch.Tensor, ramp_steps: int) -> torch.Tensor:
    """CTKD's gradient-reversal scale, cosine from 0 to 1 over ``ramp_steps`` steps (0: 1 throughout).

    Step ``s`` (0-based) gets ``(1 - cos(pi * (s + 1) / ramp_steps)) / 2``: small but not zero on the first
    step (a zero gradient would look like a dead parameter), exactly 1 from step ``ramp_steps - 1`` on.
    """
    if ramp_steps <= 0:
        return torch.ones((), dtype=torch.float32, device=step.device)
    progress = torch.clamp((step.to(torch.float32) + 1) / ramp_steps, 0.0, 1.0)
    return 0.5 * (1.0 - torch.cos(math.pi * progress))


def learnable_temperature(theta: torch.Tensor, step: torch.Tensor, *, t_min: float = 1.0, t_max: float = 21.0,
                          ramp_steps: int = 0) -> torch.Tensor:
    """CTKD's ``T = t_min + (t_max - t_min) * sigmoid(GRL(theta))``, the reversal scale ramped by ``step``."""
    return t_min + (t_max - t_min) * torch.sigmoid(grad_reverse(theta.float(), cosine_ramp(step, ramp_steps)))


def temperature_logit(temperature: float, t_min: float = 1.0, t_max: float = 21.0) -> float:
    """The theta at which :func:`learnable_temperature` equals ``temperature`` (strictly inside the bounds)."""
    if not t_min < temperature < t_max:
        raise ValueError(f"a learnable temperature starts strictly between {t_min} and {t_max}, "
                         f"not at {temperature}")
    u = (temperature - t_min) / (t_max - t_min)
    return math.log(u / (1 - u))


def scheduled_temperature(step: torch.Tensor, total_steps: int, start: float, end: float) -> torch.Tensor:
    """Linear from ``start`` (step 0) to ``end`` (step ``total_steps - 1`` and after), as a 0-d tensor."""
    progress = torch.clamp(step.to(torch.float32) / max(total_steps - 1, 1), 0.0, 1.0)
    return start + (end - start) * progress
