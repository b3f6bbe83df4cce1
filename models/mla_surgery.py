"""Attention surgery into DeepSeek-V2's MLA form: a Llama teacher's params -> an MLA student (``models/mla.py``'s
layout) whose per-token cache is one latent c (``kv_lora_rank`` values) shared by the layer's heads plus one
decoupled RoPE key (``qk_rope_head_dim`` values) shared across heads, as MHA2MLA (Ji et al. 2025, arXiv 2502.14837)
and TransMLA (Meng et al. 2025, arXiv 2502.07864) build it from a GQA model. Every layer at once, float64.

Notation per layer: G KV heads of width hd, n = n_heads / G query heads per group, d_r = qk_rope_head_dim,
m = hd - d_r = qk_nope_head_dim, v_head_dim = hd, r = kv_lora_rank. Student (per query head h of group g)::

    q_h = W_q,h x = [q_nope_h | q_rope_h]            c = W_dkv x  (wkv_a's first r rows), c_n = c/rms(c) * kv_norm
    k_rope = W_kr x (wkv_a's last d_r rows)          [k_nope_h | v_h] = W_kv_b,h c_n
    score_h = (q_nope_h . k_nope_h + R q_rope_h . R k_rope) / sqrt(m + d_r)

1. **Which frequencies rotate** (:func:`kept_pairs`): DeepSeek's format gives the d_r rope dims the frequencies
   rope_theta^(-2i/d_r), so the kept teacher pairs are every s-th pair, s = hd / d_r (MHA2MLA's "uniform"
   choice); teacher pair s*i has exactly student frequency i (with llama3 scaling too: it is a function of the
   frequency). MHA2MLA's 2-norm (``models.surgery.pair_scores``) is reported as a measure only
   (``rope_2norm_kept``: the kept pairs' share of the score of the best d_r/2 pairs).

2. **One RoPE key for all heads** (:func:`rope_mixing`, TransMLA's RoRoPE): for each kept pair the G heads' 2-D
   key components are mixed by a G x G orthogonal U applied to both dims of the pair (it commutes with the pair's
   2 x 2 rotation), U from the PCA of the pair's key activations across heads (calibration Gram; the weight
   metric for ``svd``); the shared k_rope is the first component k'_0 = sum_g U_g0 k_g and query head h of group
   g gets U_g0 times its rows, so q_h . k_g ~ (U_g0 q_h) . k'_0. Exact for G = 1. ``rope_kept`` reports the share
   of the kept pairs' score energy that survives, averaged over the rotation angle: for a 2-vector pair
   E_angle (q^T R e)^2 = |q|^2 |e|^2 / 2, so the error energy of head h is ||q_h||^2 ||k_g - U_g0 k'_0||^2 summed
   over calibration tokens, and different frequencies do not interfere on average.

3. **The latent** (:func:`factorize_latent`): the dropped pairs lose RoPE (MHA2MLA's NoPE approximation): q_nope_h
   = the teacher's query rows of those dims, K_nope,g = its key rows; the values are W_v,g. The stack
   Y = [K_nope,0; ..; K_nope,G-1; V_0; ..; V_G-1] (G (m + hd) x d) is factored jointly, Y ~ B A, A = W_dkv (r x d),
   B split into every head's kv_b rows (query heads of one group get their KV head's rows). ``asvd``: the error is
   measured on the calibration inputs, ||(Y - B A) X^T|| = ||(Y - B A) W|| with W = chol(X^T X) (SVD-LLM, as
   ``models.surgery``); ``svd``: in the weight metric. ``latent_weight="equal"`` is MHA2MLA's joint SVD (every row
   counts alike); ``"fed"`` weighs each block by what it feeds: the key rows of group g by sum_h Q_h X^T X Q_h^T
   (the group's no-RoPE query rows, as ``models.surgery.factorize_scores`` weighs scores), the value rows by
   sum_h W_o,h^T W_o,h; each block's metric is scaled so its total energy is unchanged (keys are in score units,
   values in output units: only the distribution inside a block changes). Minimising ||L (Y - B A) W|| with L^T L
   that block-diagonal metric is the Eckart-Young truncation of L Y W. Exact at r = rank(Y). A per-layer budget
   (``latent_total``, CARE ICLR 2026 via ``models/kv_budget.py``) draws each layer's rank from the same SVD's
   spectrum and zero-pads the latent to the widest layer (``models.mla``'s note on ``kv_ranks``).

4. **The latent norm** (``kv_norm``): the format normalises c per token, c_n = c / rms(c) * kv_norm, which is not
   linear. But the latent's basis is free (any invertible T: c' = T c, wkv_b takes T^-1), and rms(T c)^2 =
   c^T T^T T c / r is a quadratic form in c, so ``steady=True`` (:func:`steady_basis`) picks the T whose form is
   as constant as a ridge least squares can make it over the calibration latents (the teacher's own RMSNorm fixes
   |x / w|, so a latent that spans x has an exactly steady form). Then kv_norm = rho (every channel) with rho the
   least-squares scalar on the weighted reconstruction, min_rho sum_t ||L B (c_t - rho c_t / rms(c_t))||^2, so
   c_n ~ c on average. ``steady=False`` keeps unit calibration mean squares per channel (for comparison). The
   report gives both errors (``k_err_act``/``v_err_act``: relative key/value reconstruction on the calibration
   inputs without the norm, ``*_norm`` with it).

Teachers with q/k/v biases (Qwen2) are refused: the MLA format has no biases to carry them.
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from purestep.core.tree import clone
from purestep.models import kv_budget
from purestep.models.llama import LlamaConfig
from purestep.models.mla import KV_NORM_EPS
from purestep.models.surgery import METHODS, calibration_inputs, pair_scores, teacher_weights, whitening

LATENT_WEIGHTS = ("equal", "fed")
RIDGE = 1e-9   # relative ridge on the left metrics of latent_weight=fed before their Cholesky factor


ROPE_SHARE = 6   # d_r ~ budget / ROPE_SHARE: SmolLM2 at 4x (docs/upcycle.md) preferred d_r 16 of 96 to 32 and 64


def dims_for_reduction(n_kv_heads: int, head_dim: int, kv_reduction: float) -> tuple[int, int]:
    """``(qk_rope_head_dim, kv_lora_rank)`` for a cache ``kv_reduction`` times smaller than the teacher's
    2 * n_kv_heads * head_dim values per token and layer (floored): d_r the widest valid rope width (even, its
    pairs dividing the teacher's) at most budget / ``ROPE_SHARE`` (at least 2), the rest the latent (at most the
    latent's rank)."""
    if kv_reduction < 1:
        raise ValueError(f"kv_reduction={kv_reduction} must be >= 1")
    budget = int(2 * n_kv_heads * head_dim / kv_reduction + 1e-9)
    if budget < 3:
        raise ValueError(f"kv_reduction={kv_reduction} leaves {budget} cached values per token and layer; MLA needs "
                         f"at least one rotary pair and one latent value")
    d_r = max(w for w in range(2, head_dim + 1, 2) if (head_dim // 2) % (w // 2) == 0
              and (w <= budget // ROPE_SHARE or w == 2))
    return d_r, min(budget - d_r, n_kv_heads * (2 * head_dim - d_r))


def kept_pairs(head_dim: int, rope_dim: int) -> torch.Tensor:
    """The teacher pairs whose frequencies DeepSeek's format keeps: s * i for i < d_r / 2, s = head_dim / d_r."""
    if rope_dim < 2 or rope_dim % 2 or rope_dim > head_dim or (head_dim // 2) % (rope_dim // 2):
        raise ValueError(f"qk_rope_head_dim={rope_dim} must be even, at most head_dim={head_dim}, and its pairs "
                         f"must divide the teacher's {head_dim // 2} (every s-th teacher pair is kept)")
    return torch.arange(rope_dim // 2) * (head_dim // rope_dim)


def times(W: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """W M for ``W`` [L, ..., a, d] and ``M`` [L, d, e], as one batched product per layer (a broadcast M would be
    materialised for every middle index)."""
    return (W.flatten(1, -2) @ M).view(*W.shape[:-1], M.shape[-1])


# ----------------------------------------------------------------------------------------------------------
# the shared RoPE key

def pair_view(W: torch.Tensor, rope_dims: torch.Tensor) -> torch.Tensor:
    """Rows ``rope_dims`` (student order: the kept pairs' first dims, then their second) of ``W`` [..., hd, d]
    as [..., P, 2, d]: pair i's two rows."""
    rows = W[..., rope_dims, :]
    return rows.unflatten(-2, (2, rows.shape[-2] // 2)).transpose(-3, -2)


def rope_mixing(Kp: torch.Tensor, metric: torch.Tensor) -> torch.Tensor:
    """U_0 [L, P, G]: per layer and kept pair, the first principal direction across the G heads of the pair's key
    activations (``Kp`` [L, G, P, 2, d], ``metric`` [L, d, d]: X^T X, or the identity for the weight metric)."""
    K = Kp.permute(0, 2, 1, 3, 4)                                       # [L, P, G, 2, d]
    KM = times(K, metric)
    C = torch.einsum("lpgcd,lphcd->lpgh", KM, K)                        # sum over both dims of the pair
    _, vecs = torch.linalg.eigh(C)
    U0 = vecs[..., -1]
    return U0 * torch.where(U0.sum(-1, keepdim=True) < 0, -1.0, 1.0)    # a fixed sign (any works)


def rope_energy_kept(Qp: torch.Tensor, Kp: torch.Tensor, coef: torch.Tensor, shared: torch.Tensor,
                     metric: torch.Tensor) -> torch.Tensor:
    """Per layer, the share of the kept pairs' angle-averaged score energy sum_h ||q_h||^2 ||k_g||^2 left after
    k_g -> coef_g * shared (module docstring, step 2). ``Qp`` [L, G, n, P, 2, d], ``Kp`` [L, G, P, 2, d],
    ``coef`` [L, P, G], ``shared`` [L, P, 2, d]."""
    def energy(W):   # sum over the pair's two dims of w M w^T
        return (times(W, metric) * W).sum((-2, -1))
    q = energy(Qp).sum(2)                                               # [L, G, P]
    err = Kp - coef.transpose(1, 2)[..., None, None] * shared[:, None]
    total = (q * energy(Kp)).sum((1, 2))
    return 1 - (q * energy(err)).sum((1, 2)) / total.clamp_min(1e-300)


# ----------------------------------------------------------------------------------------------------------
# the latent

def left_metrics(Qn: torch.Tensor, Wo: torch.Tensor, metric: torch.Tensor, Kn: torch.Tensor,
                 V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``latent_weight="fed"``'s metrics: keys [L, G, m, m] = sum_h Q_h M Q_h^T (``Qn`` [L, G, n, m, d]), values
    [L, G, hd, hd] = sum_h W_o,h^T W_o,h (``Wo`` [L, d, G, n, hd]); each block scaled so that its energy
    tr(Y_b M Y_b^T) is the same as with the identity (``Kn`` [L, G, m, d], ``V`` [L, G, hd, d])."""
    Pk = (times(Qn, metric) @ Qn.mT).sum(2)
    Pv = torch.einsum("ldgna,ldgnb->lgab", Wo, Wo)

    def balanced(P, Y):
        YMY = times(Y, metric) @ Y.mT
        plain = YMY.diagonal(dim1=-2, dim2=-1).sum((1, 2))
        weighted = (P * YMY).sum((1, 2, 3))
        P = P * (plain / weighted.clamp_min(1e-300))[:, None, None, None]
        ridge = RIDGE * P.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-300)
        return P + ridge[..., None, None] * torch.eye(P.shape[-1], dtype=P.dtype, device=P.device)
    return balanced(Pk, Kn), balanced(Pv, V)


def fed_left(Qn: torch.Tensor, Wo: torch.Tensor, metric: torch.Tensor, Kn: torch.Tensor,
             V: torch.Tensor) -> torch.Tensor:
    """``latent_weight="fed"``'s left factor L [L, R, R]: the block-diagonal upper Cholesky factors of
    :func:`left_metrics` (the G key blocks, then the G value blocks)."""
    Pk, Pv = left_metrics(Qn, Wo, metric, Kn, V)
    return block_diagonal([torch.linalg.cholesky(P).mT for P in [*Pk.unbind(1), *Pv.unbind(1)]])


def block_diagonal(blocks: list) -> torch.Tensor:
    """[L, R, R] with the [L, a_i, a_i] ``blocks`` on its diagonal."""
    sizes = [b.shape[-1] for b in blocks]
    out = blocks[0].new_zeros(blocks[0].shape[0], sum(sizes), sum(sizes))
    start = 0
    for b, size in zip(blocks, sizes):
        out[:, start:start + size, start:start + size] = b
        start += size
    return out


def factorize_latent(Y: torch.Tensor, rank: int, white: torch.Tensor | None, left: torch.Tensor | None,
                     x: torch.Tensor, latent_total: int | None = None) -> tuple[torch.Tensor, torch.Tensor, list]:
    """(B [L, R, r], A [L, r, d], ranks) minimising ||L (Y - B A) W|| (``white`` W [L, d, d] or None for the
    identity, ``left`` L [L, R, R] upper triangular or None), A's rows scaled to unit mean square on ``x``
    [L, N, d]. r = ``rank`` in every layer, or with ``latent_total`` the per-layer ranks ``kv_budget.allocate``
    draws from this SVD's spectrum (r = their max; layer l's components >= ranks[l] zero)."""
    LY = Y if left is None else left @ Y
    Z = LY if white is None else LY @ white
    U, s, Vh = torch.linalg.svd(Z, full_matrices=False)
    ranks = [rank] * Y.shape[0] if latent_total is None else kv_budget.allocate(s.square(), latent_total)
    rank = max(ranks)
    live = (torch.arange(rank, device=s.device) < torch.tensor(ranks, device=s.device)[:, None]).to(s.dtype)
    U, s, Vh = U[..., :rank], s[..., :rank] * live, Vh[..., :rank, :] * live[..., None]
    A = Vh if white is None else torch.linalg.solve_triangular(white, Vh, upper=False, left=False)   # Vh W^-1
    ms = (x @ A.mT).square().mean(1).clamp_min(1e-300)                  # [L, rank]
    B = U * (s * ms.sqrt())[:, None, :]
    B = B if left is None else torch.linalg.solve_triangular(left, B, upper=True)
    return B, A / ms.sqrt()[..., None], ranks


def steady_basis(c: torch.Tensor, ranks: list | None = None, ridge: float = 1e-3) -> torch.Tensor:
    """T [L, r, r] (symmetric PSD) that makes |T c_t|^2 as constant over the calibration latents ``c`` [L, N, r] as
    a ridge least squares over quadratic forms can: min_S sum_t (c_t^T S c_t - 1)^2 + lambda ||S||^2, solved in its
    dual (the quadratic features' kernel is (c_t . c_u)^2, so S = C^T diag(alpha) C with alpha = (K + lambda I)^-1 1,
    lambda = ``ridge`` * mean diag K), S projected onto PSD (eigenvalues floored at 1e-3 of their mean), T = S^1/2.
    One layer at a time (K is N x N), over its live dims ``ranks[l]`` (the identity on the zero ones)."""
    out = []
    for cl, live in zip(c.unbind(0), ranks or [c.shape[-1]] * c.shape[0]):
        cl = cl[:, :live]
        cl = cl / cl.square().sum(-1).mean().sqrt()                        # mean |c|^2 = 1
        K = (cl @ cl.mT).square()
        K.diagonal().add_(ridge * K.diagonal().mean())
        alpha = torch.cholesky_solve(torch.ones_like(K[:, :1]), torch.linalg.cholesky(K))
        vals, vecs = torch.linalg.eigh(cl.mT @ (alpha * cl))
        vals = vals.clamp_min(1e-3 * vals.clamp_min(0).mean())
        T = torch.eye(c.shape[-1], dtype=c.dtype, device=c.device)
        T[:live, :live] = (vecs * vals.sqrt()) @ vecs.mT
        out.append(T)
    return torch.stack(out)


def norm_scale(LB: torch.Tensor, c: torch.Tensor, eps: float,
               live: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rho [L], 1/rms(c_t) [L, N]): the least-squares scalar of step 4 for latents ``c`` [L, N, r] (the rms over
    each layer's ``live`` [L] dims, the rest zero; None: all) and the weighted up-projection ``LB`` [L, R, r]."""
    width = torch.full(c.shape[:1], c.shape[-1], dtype=c.dtype, device=c.device) if live is None else live
    inv = torch.rsqrt(c.square().sum(-1) / width[:, None] + eps)
    w = (c @ LB.mT).square().sum(-1)                                    # ||L B c_t||^2
    return (w * inv).sum(1) / (w * inv.square()).sum(1).clamp_min(1e-300), inv


def reconstruction_error(Yx: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """Relative Frobenius error per layer of ``approx`` against ``Yx`` [L, N, rows]."""
    return ((Yx - approx).square().sum((1, 2)) / Yx.square().sum((1, 2)).clamp_min(1e-300)).sqrt()


def joint_latent(x: torch.Tensor, Y: torch.Tensor, rank: int, white, left, steady: bool, eps: float, n_keys: int,
                 latent_total: int | None = None):
    """Steps 3 and 4 for the stacked rows ``Y`` [L, R, d] (the first ``n_keys`` rows keys, the rest values) on the
    calibration inputs ``x`` [L, N, d]: (A = W_dkv [L, r, d], B [L, R, r], kv_norm [L, r], ranks, the report's
    errors); ``latent_total``: per-layer ranks (``factorize_latent``), kv_norm = rho sqrt(ranks[l] / r) on the live
    dims and zero on the rest (``models.mla``'s note on a padded latent)."""
    B, A, ranks = factorize_latent(Y, rank, white, left, x, latent_total)
    c = x @ A.mT                                                   # [L, N, r]
    if steady:
        T = steady_basis(c, ranks)
        A, B, c = T @ A, torch.linalg.solve(T, B.mT).mT, c @ T
    live = torch.tensor(ranks, dtype=x.dtype, device=x.device)
    rho, inv_rms = norm_scale(B if left is None else left @ B, c, eps, live)
    width = A.shape[1]
    mask = (torch.arange(width, device=x.device) < live[:, None]).to(x.dtype)
    kv_norm = (rho * (live / width).sqrt())[:, None] * mask
    Yx, approx = x @ Y.mT, c @ B.mT
    approx_n = approx * (rho[:, None] * inv_rms)[..., None]
    keys, vals = slice(0, n_keys), slice(n_keys, None)
    err = lambda a, b, s: reconstruction_error(a[..., s], b[..., s]).tolist()   # noqa: E731
    weigh = lambda E: (E if left is None else left @ E) @ (torch.eye(E.shape[-1], dtype=E.dtype, device=E.device)  # noqa: E731
                                                          if white is None else white)
    latent_err = (weigh(Y - B @ A).square().sum((1, 2)) / weigh(Y).square().sum((1, 2))).sqrt()
    errors = {"kv_norm": rho.tolist(), "k_err_act": err(Yx, approx, keys), "v_err_act": err(Yx, approx, vals),
              "k_err_act_norm": err(Yx, approx_n, keys), "v_err_act_norm": err(Yx, approx_n, vals),
              "latent_err": latent_err.tolist(), **({"kv_ranks": tuple(ranks)} if latent_total is not None else {})}
    return A, B, kv_norm, ranks, errors


def shared_rope(Wq: torch.Tensor, Wk: torch.Tensor, rope_dims: torch.Tensor, metric: torch.Tensor):
    """Step 2: (q_rope [L, G, n, d_r, d] = U_g0 times the query rows, k_rope [L, d_r, d] = sum_g U_g0 k_g rows in the
    student's rotate-half order, the per-layer ``rope_kept``)."""
    Qp, Kp = pair_view(Wq, rope_dims), pair_view(Wk, rope_dims)    # [L, G, n, P, 2, d], [L, G, P, 2, d]
    U0 = rope_mixing(Kp, metric)                                   # [L, P, G]
    k_rope = torch.einsum("lpg,lgpcd->lpcd", U0, Kp)               # [L, P, 2, d]
    coef = torch.cat([U0, U0], dim=1).transpose(1, 2)              # [L, G, d_r] per student rope dim
    q_rope = Wq[..., rope_dims, :] * coef[:, :, None, :, None]
    kept = rope_energy_kept(Qp, Kp, U0, k_rope, metric).tolist()
    return q_rope, k_rope.transpose(1, 2).flatten(1, 2), kept


# ----------------------------------------------------------------------------------------------------------
# the surgery

@torch.no_grad()
def surgery(params: dict, cfg: LlamaConfig, calib_tokens: torch.Tensor, *, kv_lora_rank: int | None = None,
            qk_rope_head_dim: int,
            method: Literal["svd", "asvd"] = "asvd", latent_weight: str = "fed", steady: bool = True,
            latent_total: int | None = None):
    """Teacher Llama ``params``/``cfg`` -> (student params, dims, report); ``MLAConfig.from_teacher(cfg, **dims)``
    is the student's config (dims: kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim). The report holds
    per-layer lists: ``rope_kept`` (step 2), ``rope_2norm_kept`` (step 1), ``k_err_act``/``v_err_act`` and their
    ``*_norm`` (step 4), ``latent_err`` (the weighted objective's relative error) and ``kv_norm`` (rho).
    Exactly one of ``kv_lora_rank`` (every layer) and ``latent_total`` (``models/kv_budget.py``: that many latent
    dims over all layers by CARE's greedy on step 3's spectrum; dims and report hold ``kv_ranks``, r their max)."""
    _check(params, cfg, kv_lora_rank, qk_rope_head_dim, method, latent_weight, latent_total)
    L, d, H, G, hd, d_r, r = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                              qk_rope_head_dim, kv_lora_rank)
    n, m = H // G, hd - d_r
    attn = params["layers"]["attn"]
    x = calibration_inputs(params, cfg, calib_tokens)
    scores = pair_scores(params, cfg, x)                                       # [L, G, hd/2]
    work = torch.device("cpu") if x.device.type == "mps" else x.device
    x = x.to(work, torch.float64)
    gram = x.mT @ x
    eye = torch.eye(d, dtype=torch.float64, device=work).expand(L, d, d)
    metric = gram if method == "asvd" else eye
    white = whitening(gram) if method == "asvd" else None

    keep = kept_pairs(hd, d_r).to(work)
    drop = torch.ones(hd // 2, dtype=torch.bool, device=work).scatter(0, keep, False).nonzero()[:, 0]
    rope_dims, nope_dims = torch.cat([keep, keep + hd // 2]), torch.cat([drop, drop + hd // 2])
    Wq, Wk, Wv = teacher_weights(attn, cfg, work)                  # Wq carries 1/sqrt(hd)

    q_rope, k_rope, rope_kept = shared_rope(Wq, Wk, rope_dims, metric)

    # step 3: the latent (+ step 4: its norm)
    Qn, Kn = Wq[..., nope_dims, :], Wk[..., nope_dims, :]
    Y = torch.cat([Kn.reshape(L, G * m, d), Wv.reshape(L, G * hd, d)], dim=1)
    wo = attn["wo"].to(work, torch.float64)
    left = fed_left(Qn, wo.view(L, d, G, n, hd), metric, Kn, Wv) if latent_weight == "fed" else None
    A, B, kv_norm, ranks, errors = joint_latent(x, Y, r, white, left, steady, KV_NORM_EPS, G * m, latent_total)
    r = A.shape[1]

    scale = math.sqrt(m + d_r)                                     # the student's softmax_scale is (m + d_r)^-1/2
    wq = torch.cat([Qn, q_rope], dim=3) * scale                    # [L, G, n, m + d_r, d]
    Bk, Bv = B[:, :G * m].view(L, G, 1, m, r), B[:, G * m:].view(L, G, 1, hd, r)
    wkv_b = torch.cat([Bk, Bv], dim=3).expand(L, G, n, m + hd, r)
    like = attn["wq"]
    out = lambda t: t.to(dtype=like.dtype, device=like.device)     # noqa: E731
    student = clone({k: v for k, v in params.items() if k != "layers"})
    student["layers"] = clone({k: v for k, v in params["layers"].items() if k != "attn"})
    student["layers"]["attn"] = {
        "wq": out(wq.reshape(L, H * (m + d_r), d)),
        "wkv_a": out(torch.cat([A, k_rope], dim=1)),
        "kv_norm": out(kv_norm),
        "wkv_b": out(wkv_b.reshape(L, H * (m + hd), r)),
        "wo": out(wo)}
    best = scores.topk(d_r // 2, dim=-1).values.sum(-1)
    report = {"method": method, "latent_weight": latent_weight, "kept_pairs": keep.tolist(),
              "rope_kept": rope_kept, "rope_2norm_kept": (scores[..., keep].sum(-1) / best).mean(1).tolist(),
              **errors}
    dims = {"kv_lora_rank": r, "qk_rope_head_dim": d_r, "qk_nope_head_dim": m, "v_head_dim": hd,
            **({"kv_ranks": report["kv_ranks"]} if "kv_ranks" in report else {})}
    return student, dims, report


def _check(params: dict, cfg: LlamaConfig, rank: int | None, rope_dim: int, method: str, latent_weight: str,
           latent_total: int | None = None) -> None:
    """:func:`surgery`'s arguments against the teacher: one ``ValueError`` naming the bad one."""
    if (rank is None) == (latent_total is None):
        raise ValueError(f"kv_lora_rank={rank}, latent_total={latent_total}: give exactly one")
    if method not in METHODS:
        raise ValueError(f"method={method!r}; choose one of {', '.join(METHODS)}")
    if latent_weight not in LATENT_WEIGHTS:
        raise ValueError(f"latent_weight={latent_weight!r}; choose one of {', '.join(LATENT_WEIGHTS)}")
    if any(k.endswith("_bias") for k in params["layers"]["attn"]):
        raise ValueError("the teacher has q/k/v biases (Qwen2); the MLA format has none to carry them")
    kept_pairs(cfg.head_dim, rope_dim)
    if rank is not None:
        check_rank(cfg, rank, rope_dim)


def check_rank(cfg: LlamaConfig, rank: int, rope_dim: int) -> None:
    """``kv_lora_rank`` within the latent's rank: the stacked no-RoPE keys and values, at most d_model."""
    full = cfg.n_kv_heads * (2 * cfg.head_dim - rope_dim)
    if not 1 <= rank <= min(full, cfg.d_model):
        raise ValueError(f"kv_lora_rank={rank}: need 1 <= rank <= min(n_kv_heads * (2 * head_dim - "
                         f"qk_rope_head_dim) = {full}, d_model = {cfg.d_model})")
