"""Attention surgery: a Llama teacher's params -> a DBA student (``models/dba.py``) that starts out as close to
the teacher as its cache budget allows, every layer at once with batched linear algebra ([L, n_kv_heads, ...]).

Steps (per layer l and KV head g; query heads h of g's group, n = n_heads / n_kv_heads of them):

1. **Which RoPE pairs stay geometric** (``pair_scores``, ``select_pairs``): MHA2MLA's 2-norm criterion (Ji et al.
   2025, arXiv 2502.14837, ``2_norm.py``) on calibration activations x (the block inputs after the attention
   RMSNorm): score_f = sum_h mean_t ||q_h[f]|| * mean_t ||k_g[f]||, with q[f] the 2-vector of rotary pair f
   (dims f, f + head_dim/2; its norm does not depend on the rotation); keep the top geo_dim/2 pairs. They are
   copied exactly into W_qg, W_kg (query rows carry 1/sqrt(head_dim)) and rotate at their own frequencies.
   ``shared_pairs``: one set for every layer and KV head, the top pairs of score_f summed over layers and KV
   heads (what a standard-format student needs: ``models.dba_llama``).

2. **The rest of the score, jointly and GQA-aware** (``factorize_scores``). On the dropped pairs' m = head_dim -
   geo_dim dims let Q_h = W_q,h[D] / sqrt(head_dim) and K = W_k,g[D] (m x d each). With RoPE removed there, head
   h's score is x_i^T M_h x_j with M_h = Q_h^T K (d x d, rank <= m). The student scores x_i^T A_h^T B x_j with a
   per-query-head A_h (sem_dim x d) and a key factor B (sem_dim x d) **shared by the group**, because k_s is
   cached per KV head. Minimising sum_h ||M_h - A_h^T B||_F^2 is a rank-r approximation of the stacked matrix
   S = [M_1; ...; M_n] (n*d x d), since [A_1^T; ...; A_n^T] B ranges over all rank-r matrices of that shape: by
   Eckart-Young the optimum is B spanning the top-r right singular vectors P of S and A_h^T B = M_h P^T P, i.e.
   A_h = P K^T Q_h. S is never formed: S = G K with G = [Q_1^T; ...; Q_n^T], and S^T S = K^T (sum_h Q_h Q_h^T) K,
   so with the thin SVD [Q_1 ... Q_n] = U_c diag(s_c) V_c^T (m x n*d), Z = diag(s_c) U_c^T K (m x d) has the
   same right singular vectors and singular values as S. At r = rank(S) (<= m) the fold is exact:
   M_h P^T P = M_h because every row of M_h lies in the row space of S. This is a factorisation of W_q^T W_k
   jointly, per head and per group (the scores' bilinear form is what is approximated), not of Q and K
   separately, and GQA is kept (one key factor per KV group).
   ``method="asvd"`` (activation-aware, SVD-LLM: Wang et al. 2024; ASVD: Yuan et al. 2023) minimises the error
   on the calibration scores instead, sum_h ||X (M_h - A_h^T B) X^T||_F = sum_h ||W^T (M_h - A_h^T B) W|| with
   W = chol(X^T X): the same algorithm on Q_h W and K W, mapped back by B = P W^{-1}, A_h = P W^T K^T Q_h
   (still exact at full rank). The shared scale is balanced: row i of B and of every A_h scaled by
   (s_i / sqrt(n))^{+-1/2} (singular value s_i), which leaves A_h^T B unchanged.

3. **V to v_dim** (``compress_values``): per KV head, W_v ~ U_r U_r^T W_v with U_r the top-r left singular
   vectors of W_v (``asvd``: of W_v W, the whitened SVD-LLM form); the student's W_v = U_r^T W_v and the
   up-projection U_r is folded into the W_o columns of **every** query head of the group, W_o,h <- W_o,h U_r.
   Exact at r = head_dim (U_r U_r^T = I), optimal in Frobenius norm below it (Eckart-Young).

   **A per-layer budget** (``dims_total``, :func:`bottlenecks`): steps 2 and 3 run at full rank, their squared
   singular values summed over each layer's KV heads go to ``models.kv_budget.allocate_pair`` (CARE's greedy, ICLR
   2026, over both spectra; geo_dim stays uniform), and layer l keeps its leading sem_dims[l] / v_dims[l]
   components, zero past them (the stacked shape of ``models.dba``'s note). Both truncations take a prefix of the
   full-rank factors (the balance is per component), so each layer is exactly what a surgery at its widths builds.

4. Embeddings, norms, MLPs and the head are copied. All linear algebra runs in float64; the result takes the
   teacher's dtype and device. DeepSeek-V2 (MLA with decoupled RoPE) is the architecture this mirrors.

**Biases (Qwen2)** enter by the affine (augmented-input) trick, the homogeneous coordinates of an affine map: a
bias is a weight column on a constant input 1, W x + b = [W | b] [x; 1]. A teacher with q/k/v biases runs steps 1-3
on the augmented weights [W | b] (d + 1 columns; the query bias carries 1/sqrt(head_dim) as its rows do) and the
augmented inputs [x; 1] (``asvd``: the Gram matrix of [X | 1] and a (d+1) x (d+1) whitening), so the pair scores,
the factorization and its errors include the biases; the last column of each student matrix (A_h, B, the kept rows,
U_r^T [W_v | b_v]) is the student's bias (``q_s_bias``, ``k_s_bias``, ``q_g_bias``, ``k_g_bias``, ``v_bias``) and
the rest its weight. Nothing else changes (W_o has no bias), and what is exact at full rank stays exact (the kept
pairs, the no-RoPE score, the values). A bias-free teacher keeps d columns: augmenting with a zero bias would let
``asvd`` give its student biases it does not have.
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from purestep.core.tree import clone
from purestep.models import kv_budget, llama
from purestep.models.dba import DBAConfig
from purestep.models.llama import LlamaConfig

METHODS = ("svd", "asvd")
RIDGE = 1e-6   # X^T X + RIDGE * mean(diag) * I before the Cholesky factor (few calibration tokens: rank-deficient)


# ----------------------------------------------------------------------------------------------------------
# calibration

@torch.no_grad()
def calibration_inputs(params: dict, cfg: LlamaConfig, tokens: torch.Tensor) -> torch.Tensor:
    """The teacher's attention inputs [L, N, d] (block inputs after ``attn_norm``) for ``tokens`` [B, T]."""
    hidden = llama.apply(params, tokens.to(params["embed"].device), cfg, return_hidden="only")   # no logits
    x = torch.stack(hidden[:-1]).flatten(1, 2)                    # [L, B*T, d]
    return llama.rms_norm(x, params["layers"]["attn_norm"][:, None, :], cfg.norm_eps)


@torch.no_grad()
def pair_scores(params: dict, cfg: LlamaConfig, x: torch.Tensor) -> torch.Tensor:
    """MHA2MLA's 2-norm scores [L, n_kv_heads, head_dim/2]: sum over the group's query heads of
    mean_t ||q[f]||, times mean_t ||k[f]||, for rotary pair f = dims (f, f + head_dim/2); q and k include the
    teacher's biases (Qwen2)."""
    G, hd = cfg.n_kv_heads, cfg.head_dim
    attn = params["layers"]["attn"]
    wide = llama.upcast(attn["wq"].dtype)                                       # bf16 teachers: score in fp32
    x = x.to(wide)

    def project(name):   # x W^T (+ b) [L, N, out]
        bias = attn.get(f"{name}_bias")
        y = x @ attn[f"w{name}"].to(wide).mT
        return y if bias is None else y + bias.to(wide)[:, None, :]
    q = project("q").unflatten(-1, (G, cfg.n_heads // G, 2, hd // 2))   # [L, N, G, n, 2, hd/2]
    k = project("k").unflatten(-1, (G, 2, hd // 2))                     # [L, N, G, 2, hd/2]
    norm = lambda t: (t[..., 0, :].square() + t[..., 1, :].square()).sqrt()   # noqa: E731  per pair
    q_score = norm(q).mean(1).sum(2)                                           # [L, G, hd/2]
    k_score = norm(k).mean(1)
    return (q_score * k_score).double()


def select_pairs(scores: torch.Tensor, n_keep: int, shared: bool = False) -> torch.Tensor:
    """Indices [L, G, n_keep] of the top-scoring pairs per layer and KV head, in ascending pair order; ``shared``:
    one set for every layer and KV head, the top pairs of the scores summed over them."""
    if shared:
        return select_pairs(scores.sum((0, 1)), n_keep).expand(*scores.shape[:2], n_keep)
    return scores.topk(n_keep, dim=-1).indices.sort(dim=-1).values


def whitening(gram: torch.Tensor) -> torch.Tensor:
    """W [L, d, d], lower triangular, with W W^T = X^T X + ridge (SVD-LLM's whitening), from ``gram`` = X^T X."""
    ridge = RIDGE * gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    return torch.linalg.cholesky(gram + ridge[:, None, None] * eye)


def augmented(w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[W | b] (``w`` [..., out, d], ``bias`` [..., out] or None): the affine map as one matrix on [x; 1]."""
    return w if bias is None else torch.cat([w, bias[..., None].to(w)], dim=-1)


def teacher_weights(attn: dict, cfg: LlamaConfig, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's float64 [W | b] per head on ``device``: W_q [L, G, n, hd, d'] (1/sqrt(hd) folded in),
    W_k and W_v [L, G, hd, d']; d' = d + 1 with q/k/v biases (the last column), d without."""
    L, G, hd = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim

    def weight(name):
        bias = attn.get(f"{name}_bias")
        return augmented(attn[f"w{name}"].to(device, torch.float64),
                         None if bias is None else bias.to(device, torch.float64))
    Wq = weight("q").unflatten(1, (G, cfg.n_heads // G, hd)) / math.sqrt(hd)
    return Wq, weight("k").unflatten(1, (G, hd)), weight("v").unflatten(1, (G, hd))


# ----------------------------------------------------------------------------------------------------------
# factorizations (batched over [L, G])

def factorize_scores(Q: torch.Tensor, K: torch.Tensor, rank: int, white: torch.Tensor | None = None):
    """Shared-key rank-``rank`` factorization of the group's no-RoPE scores M_h = Q_h^T K (module docstring).

    ``Q`` [L, G, n, m, d] (scale folded in), ``K`` [L, G, m, d], ``white`` [L, d, d] (``asvd``) or None.
    Returns A [L, G, n, rank, d] (queries), B [L, G, rank, d] (keys) with A_h^T B ~ M_h, and the squared singular
    values [L, G, min(m, d)] of the whitened scores (their tail sum is the truncation's error; empty at rank 0).
    """
    L, G, n, m, d = Q.shape
    if rank == 0:
        return Q.new_zeros(L, G, n, 0, d), K.new_zeros(L, G, 0, d), Q.new_zeros(L, G, 0)
    Kw = K if white is None else K @ white[:, None]
    Qw = Q if white is None else Q @ white[:, None, None]
    U_c, s_c, _ = torch.linalg.svd(Qw.transpose(2, 3).reshape(L, G, m, n * d), full_matrices=False)
    Z = (s_c[..., :, None] * U_c.mT) @ Kw                        # same right singular vectors as S
    _, s_all, Vh = torch.linalg.svd(Z, full_matrices=False)
    P, s = _pad_rows(Vh[..., :rank, :], rank), _pad_rows(s_all[..., :rank, None], rank)[..., 0]
    A = (P @ Kw.mT)[:, :, None] @ Q                              # A_h = P W^T K^T Q_h
    B = P if white is None else torch.linalg.solve_triangular(white[:, None], P, upper=False, left=False)
    floor = 1e-12 * s.amax(-1, keepdim=True).clamp_min(1e-300)   # zero directions: any finite balance
    balance = (s / math.sqrt(n)).clamp_min(floor).sqrt()
    return A / balance[:, :, None, :, None], B * balance[..., None], s_all.square()


def compress_values(Wv: torch.Tensor, rank: int, white: torch.Tensor | None = None) -> tuple:
    """(U_r [L, G, hd, rank], squared singular values [L, G, min(hd, d)]): the value subspace of ``Wv``
    [L, G, hd, d] (of W_v W for ``asvd``); the student's value weights are U_r^T W_v and its output weights
    W_o,h U_r."""
    U, s, _ = torch.linalg.svd(Wv if white is None else Wv @ white[:, None], full_matrices=False)
    return _pad_rows(U[..., :rank].mT, rank).mT, s.square()


def bottlenecks(Q: torch.Tensor, K: torch.Tensor, Wv: torch.Tensor, white: torch.Tensor | None, sem_dim: int | None,
                v_dim: int | None, dims_total: int | None, geo_dim: int) -> tuple:
    """(A, B, U, sem_dims, v_dims): steps 2 and 3 at ``sem_dim`` / ``v_dim`` in every layer (sem_dims, v_dims
    empty), or with ``dims_total`` at the per-layer widths ``kv_budget.allocate_pair`` draws from both spectra
    (summed over each layer's KV heads), stacked at their max with each layer's components past its width zero."""
    if dims_total is None:
        A, B, _ = factorize_scores(Q, K, sem_dim, white)
        return A, B, compress_values(Wv, v_dim, white)[0], (), ()
    A, B, key_sq = factorize_scores(Q, K, Q.shape[-2], white)
    U, value_sq = compress_values(Wv, Wv.shape[-2], white)
    sem_dims, v_dims = kv_budget.allocate_pair(key_sq.sum(1), value_sq.sum(1), dims_total,
                                               key_minimum=0 if geo_dim else 1)
    sem, v = live_mask(sem_dims, A.dtype, A.device), live_mask(v_dims, U.dtype, U.device)
    A, B = A[..., :sem.shape[1], :] * sem[:, None, None, :, None], B[..., :sem.shape[1], :] * sem[:, None, :, None]
    return A, B, U[..., :v.shape[1]] * v[:, None, None, :], tuple(sem_dims), tuple(v_dims)


def live_mask(widths: list, dtype, device) -> torch.Tensor:
    """[L, max(widths)]: 1 on layer l's first widths[l] components, 0 past them."""
    return (torch.arange(max(widths), device=device) < torch.tensor(widths, device=device)[:, None]).to(dtype)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows up to ``rows`` when the matrix has fewer directions than the rank asked for."""
    return torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[-2])) if t.shape[-2] < rows else t


# ----------------------------------------------------------------------------------------------------------
# errors (float64, per layer, relative Frobenius)

def score_error(Q, K, A, B, gram: torch.Tensor | None = None) -> torch.Tensor:
    """||M - A^T B|| / ||M|| over the layer's heads (M_h = Q_h^T K), in the weight metric (``gram`` None) or on
    the calibration scores (``gram`` = X^T X: ||X (M - A^T B) X^T||). Only small Gram matrices are formed:
    <Q1^T K1, Q2^T K2> = tr((Q1 X^T X Q2^T)(K2 X^T X K1^T))."""
    QG, AG = (Q, A) if gram is None else (Q @ gram[:, None, None], A @ gram[:, None, None])
    KG, BG = (K, B) if gram is None else (K @ gram[:, None], B @ gram[:, None])

    def inner(Q1G, K1, Q2, K2G):
        left = Q1G @ Q2.mT                                      # [L, G, n, a1, a2]
        right = K2G @ K1.mT                                     # [L, G, a2, a1]
        return (left * right[:, :, None].mT).sum((1, 2, 3, 4))
    total = inner(QG, K, Q, KG)
    err = (total - 2 * inner(QG, K, A, BG) + inner(AG, B, A, BG)).clamp_min(0)
    return (err / total.clamp_min(1e-300)).sqrt()


def value_error(Wv: torch.Tensor, U: torch.Tensor, gram: torch.Tensor | None = None) -> torch.Tensor:
    """||W_v - U U^T W_v|| / ||W_v|| per layer, in the weight metric or on the calibration values (X W_v^T)."""
    E = Wv - U @ (U.mT @ Wv)
    if gram is None:
        return (E.square().sum((1, 2, 3)) / Wv.square().sum((1, 2, 3)).clamp_min(1e-300)).sqrt()
    energy = lambda W: ((W @ gram[:, None]) * W).sum((1, 2, 3))   # noqa: E731  tr(W X^T X W^T)
    return (energy(E).clamp_min(0) / energy(Wv).clamp_min(1e-300)).sqrt()


# ----------------------------------------------------------------------------------------------------------
# the surgery

def student_attention(parts: dict, wo: torch.Tensor, d: int, like: torch.Tensor) -> dict:
    """The DBA attention leaves from the float64 [W | b] matrices ``parts`` (q_s, q_g, k_s, k_g, v: [L, out, d']):
    ``w{part}`` is the first ``d`` columns, ``{part}_bias`` the last one when d' = d + 1; dtype/device of ``like``."""
    out = lambda t: t.to(dtype=like.dtype, device=like.device)   # noqa: E731
    attn = {f"w{k}": out(t[..., :d]) for k, t in parts.items()}
    attn["wo"] = out(wo)
    attn.update({f"{k}_bias": out(t[..., d]) for k, t in parts.items() if t.shape[-1] > d})
    return attn


@torch.no_grad()
def surgery(params: dict, cfg: LlamaConfig, calib_tokens: torch.Tensor, *, sem_dim: int | None = None, geo_dim: int,
            v_dim: int | None = None, method: Literal["svd", "asvd"] = "asvd", shared_pairs: bool = False,
            dims_total: int | None = None):
    """Teacher Llama ``params``/``cfg`` -> (student params, ``DBAConfig``, report).

    ``calib_tokens`` [B, T] feed the pair selection (and the whitening for ``asvd``, the default: on SmolLM2-135M
    at sem 16 + geo 16 + v 32 it leaves the student at 4.9 nats against 10.8 for weight-space ``svd``, teacher
    2.54, on held-out text after 1,024 calibration tokens). The report holds per-layer
    relative Frobenius errors (lists of L floats): ``score_err`` / ``score_err_act`` of the semantic factorization
    against the dropped pairs' no-RoPE score (weight metric / on the calibration activations), ``v_err`` /
    ``v_err_act`` of the value bottleneck (for a teacher with q/k/v biases: of the augmented [W | b] matrices,
    on the augmented inputs [x; 1]); and the kept pairs (also in the config). ``shared_pairs``: one set of pairs for
    all layers and KV heads; with sem_dim=0, v_dim=geo_dim the student is a plain Llama (``models.dba_llama``).
    Either ``sem_dim`` and ``v_dim`` (every layer) or ``dims_total`` (``models/kv_budget.py``: that many no-RoPE key +
    value dims per KV head over all layers, CARE's greedy on steps 2 and 3's spectra; the config and the report hold
    ``sem_dims`` / ``v_dims``, sem_dim and v_dim their max).
    """
    _check(cfg, sem_dim, geo_dim, v_dim, method, dims_total)
    L, d, H, G, hd = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    n = H // G
    attn = params["layers"]["attn"]
    x = calibration_inputs(params, cfg, calib_tokens)
    keep = select_pairs(pair_scores(params, cfg, x), geo_dim // 2, shared_pairs)   # [L, G, geo/2]
    work = torch.device("cpu") if x.device.type == "mps" else x.device       # float64 linear algebra (not on MPS)
    x, keep = x.to(work), keep.to(work)
    keep_dims, drop_dims = pair_dims(keep, hd)
    Wq, Wk, Wv = teacher_weights(attn, cfg, work)                   # [W | b] when biased: d1 = d + 1 columns
    d1 = Wq.shape[-1]

    def rows_q(dims):
        return Wq.gather(3, dims[:, :, None, :, None].expand(-1, -1, n, -1, d1))

    def rows_k(dims):
        return Wk.gather(2, dims[..., None].expand(-1, -1, -1, d1))

    x = x.to(torch.float64)
    x = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1) if d1 > d else x   # [x; 1] meets [W | b]
    gram = x.mT @ x
    white = whitening(gram) if method == "asvd" else None
    Q, K = rows_q(drop_dims), rows_k(drop_dims)
    A, B, U, sem_dims, v_dims = bottlenecks(Q, K, Wv, white, sem_dim, v_dim, dims_total, geo_dim)
    sem_dim, v_dim = A.shape[-2], U.shape[-1]
    student_cfg = DBAConfig.from_teacher(cfg, sem_dim=sem_dim, geo_dim=geo_dim, v_dim=v_dim, rope_pairs=keep.tolist(),
                                         sem_dims=sem_dims, v_dims=v_dims)
    Wo = torch.einsum("ldgnh,lghr->ldgnr", attn["wo"].to(work, torch.float64).view(L, d, G, n, hd), U)  # W_o,h U_r

    student = clone({k: v for k, v in params.items() if k != "layers"})
    student["layers"] = clone({k: v for k, v in params["layers"].items() if k != "attn"})
    student["layers"]["attn"] = student_attention(
        {"q_s": A.reshape(L, H * sem_dim, d1), "q_g": rows_q(keep_dims).reshape(L, H * geo_dim, d1),
         "k_s": B.reshape(L, G * sem_dim, d1), "k_g": rows_k(keep_dims).reshape(L, G * geo_dim, d1),
         "v": (U.mT @ Wv).reshape(L, G * v_dim, d1)}, Wo.reshape(L, d, H * v_dim), d, attn["wq"])
    report = {"method": method, "shared_pairs": shared_pairs, "score_err": score_error(Q, K, A, B).tolist(),
              "score_err_act": score_error(Q, K, A, B, gram).tolist(), "v_err": value_error(Wv, U).tolist(),
              "v_err_act": value_error(Wv, U, gram).tolist(), "rope_pairs": student_cfg.rope_pairs,
              **({"sem_dims": sem_dims, "v_dims": v_dims} if dims_total is not None else {})}
    return student, student_cfg, report


def pair_dims(keep: torch.Tensor, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept dims, dropped dims) [L, G, ...] of the kept pairs ``keep`` [L, G, P], each pair's two dims f, f + hd/2
    (the student's rotate-half layout)."""
    pairs = torch.arange(hd // 2, device=keep.device).expand(*keep.shape[:2], -1)
    drop = pairs[torch.ones_like(pairs, dtype=torch.bool).scatter(-1, keep, False)].view(*keep.shape[:2], -1)
    return torch.cat([keep, keep + hd // 2], dim=-1), torch.cat([drop, drop + hd // 2], dim=-1)


def _check(cfg: LlamaConfig, sem_dim: int | None, geo_dim: int, v_dim: int | None, method: str,
           dims_total: int | None = None) -> None:
    """:func:`surgery`'s arguments against the teacher's head: one ``ValueError`` naming the bad one."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}; choose one of {', '.join(METHODS)}")
    widths = (sem_dim is not None, v_dim is not None)
    if widths != ((False, False) if dims_total is not None else (True, True)):
        raise ValueError(f"sem_dim={sem_dim}, v_dim={v_dim}, dims_total={dims_total}: give sem_dim and v_dim, or "
                         f"dims_total alone")
    if dims_total is not None:
        return
    m = cfg.head_dim - geo_dim
    if sem_dim > m:
        raise ValueError(f"sem_dim={sem_dim} > head_dim - geo_dim = {m}: the no-RoPE score has rank <= {m}")
    if v_dim > cfg.head_dim:
        raise ValueError(f"v_dim={v_dim} > head_dim={cfg.head_dim}: a value head has rank <= {cfg.head_dim}")
