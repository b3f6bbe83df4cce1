"""A weight-tied linear dimension compressor for hidden states, and the PCA reference it is judged by.

``[B, L, D] -> [B, L, D'] -> [B, L, D]``, token by token (the sequence length is untouched)::

    z     = (x - mu) @ W          encode, W: [D, D']
    x_hat = z @ W.T + mu          decode with the same W (tied, "symmetric" weights)

``mu`` is the centering: ``learned`` (a trained [D] vector), ``fixed`` (a constant, normally the training
states' mean, kept out of the trainable params by the caller: :func:`split`) or ``none`` (no ``mu``).
With D' = D and an orthogonal ``W``, ``W @ W.T = I`` and the reconstruction is exact.

Why this is the right baseline, and why PCA is its yardstick:

- Eckart & Young (1936) / Mirsky (1960): among all rank-D' approximations of the centered data matrix, the
  truncated SVD has the least squared error, i.e. projecting onto the top-D' principal directions (PCA,
  Pearson 1901; Hotelling 1933) is the optimal *linear* D' reconstruction, ``mu`` = the mean.
- Baldi & Hornik (1989), "Neural networks and principal component analysis": the squared-error landscape of
  a linear autoencoder has no local minima other than the global ones, which project onto the principal
  subspace; with tied weights the optimum is ``W`` with orthonormal columns spanning it. So a trained
  compressor should reach PCA's error, and cannot beat it (on the training states).

:func:`pca` builds the reference as compressor params (``W`` = top-D' eigenvectors of the training
covariance, ``mu`` = the training mean), so the same :func:`apply` and :class:`Metrics` evaluate both.
:class:`Moments` accumulates the statistics it needs in float64 over any number of chunks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

CENTERS = ("learned", "fixed", "none")
INITS = ("orthogonal", "normal")


@dataclass
class CompressorConfig:
    d_model: int                 # D, the width of the hidden states
    d_compressed: int            # D', the width of the code z
    center: str = "learned"      # learned | fixed | none
    init: str = "orthogonal"     # orthogonal (W.T @ W = I) | normal (N(0, 1/D) entries)

    def __post_init__(self):
        if not 1 <= self.d_compressed <= self.d_model:
            raise ValueError(f"d_compressed={self.d_compressed} must be in 1..{self.d_model} (the hidden width)")
        if self.center not in CENTERS:
            raise ValueError(f"center={self.center!r}: choose one of {', '.join(CENTERS)}")
        if self.init not in INITS:
            raise ValueError(f"init={self.init!r}: choose one of {', '.join(INITS)}")

    @property
    def ratio(self) -> float:
        """Compression ratio D / D'."""
        return self.d_model / self.d_compressed


def init(cfg: CompressorConfig, seed: int = 0, mean: Optional[torch.Tensor] = None,
         dtype: torch.dtype = torch.float32, device=None) -> dict:
    """``{"w": [D, D'], "mu": [D]}`` (no ``mu`` for ``center="none"``); ``mu`` starts at ``mean`` (or 0).

    ``orthogonal``: the Q factor of a Gaussian matrix with the signs fixed by R's diagonal (Mezzadri 2007),
    a uniformly random set of D' orthonormal columns. ``normal``: i.i.d. N(0, 1/D) entries.
    """
    g = torch.Generator().manual_seed(seed)
    gauss = torch.randn(cfg.d_model, cfg.d_compressed, generator=g, dtype=torch.float64)
    if cfg.init == "orthogonal":
        q, r = torch.linalg.qr(gauss)
        w = q * torch.sign(torch.diagonal(r)).masked_fill(torch.diagonal(r) == 0, 1.0)
    else:
        w = gauss / math.sqrt(cfg.d_model)
    params = {"w": w.to(dtype=dtype, device=device)}
    if cfg.center != "none":
        mu = torch.zeros(cfg.d_model, dtype=torch.float64) if mean is None else mean.detach().cpu().double()
        params["mu"] = mu.to(dtype=dtype, device=device)
    return params


def encode(params: dict, x: torch.Tensor) -> torch.Tensor:
    mu = params.get("mu")
    return (x if mu is None else x - mu) @ params["w"]


def decode(params: dict, z: torch.Tensor) -> torch.Tensor:
    x_hat = z @ params["w"].T
    mu = params.get("mu")
    return x_hat if mu is None else x_hat + mu


def apply(params: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_hat, z)`` for hidden states ``x`` [..., D]: the reconstruction [..., D] and the code [..., D']."""
    z = encode(params, x)
    return decode(params, z), z


def loss(params: dict, x: torch.Tensor, scale: float) -> torch.Tensor:
    """Mean squared reconstruction error per token, ``mean ||x_hat - x||^2``, divided by ``scale``.

    With ``scale`` = the training states' total variance (``Moments.total_variance``) this is the fraction of
    variance left unexplained: about 1 for a useless map, 0 for a perfect one, whatever the states' scale.
    """
    x_hat, _ = apply(params, x)
    return (x_hat - x).pow(2).sum(-1).mean() / scale


def split(params: dict, cfg: CompressorConfig) -> tuple[dict, dict]:
    """``(trainable, frozen)``: a ``fixed`` centering's ``mu`` is an input of the step, not a trained leaf."""
    if cfg.center == "fixed":
        return {"w": params["w"]}, {"mu": params["mu"]}
    return dict(params), {}


def count_params(cfg: CompressorConfig) -> int:
    """Stored numbers: D * D' for W plus D for ``mu`` (learned or fixed)."""
    return cfg.d_model * cfg.d_compressed + (0 if cfg.center == "none" else cfg.d_model)


# ----------------------------------------------------------------------------------------------------------
# PCA, the optimal linear reference

class Moments:
    """Count, sum and sum of outer products of states [..., D], accumulated in float64."""

    def __init__(self, d: int):
        self.n = 0
        self.sum = torch.zeros(d, dtype=torch.float64)
        self.outer = torch.zeros(d, d, dtype=torch.float64)

    def add(self, x: torch.Tensor) -> "Moments":
        x = x.reshape(-1, x.shape[-1]).detach().to("cpu", torch.float64)
        self.n += x.shape[0]
        self.sum += x.sum(0)
        self.outer += x.T @ x
        return self

    @property
    def mean(self) -> torch.Tensor:
        return self.sum / self.n

    def scatter(self, center: bool = True) -> torch.Tensor:
        """Covariance (``center``) or second-moment matrix, both divided by n."""
        second = self.outer / self.n
        return second - torch.outer(self.mean, self.mean) if center else second

    def total_variance(self, center: bool = True) -> float:
        """``mean ||x - mean||^2`` (or ``mean ||x||^2`` without centering): the trace of :meth:`scatter`."""
        return float(torch.trace(self.scatter(center)))


class PCA:
    """Principal directions of the states :class:`Moments` describes (eigenvectors of the scatter matrix)."""

    def __init__(self, moments: Moments, center: bool = True):
        values, vectors = torch.linalg.eigh(moments.scatter(center))
        order = torch.argsort(values, descending=True)
        self.values, self.vectors = values[order].clamp_min(0), vectors[:, order]
        self.mean = moments.mean if center else None

    def params(self, k: int, dtype: torch.dtype = torch.float32, device=None) -> dict:
        """The best rank-k linear reconstruction as compressor params: ``W`` = the top-k directions."""
        params = {"w": self.vectors[:, :k].to(dtype=dtype, device=device)}
        if self.mean is not None:
            params["mu"] = self.mean.to(dtype=dtype, device=device)
        return params

    def explained(self, k: int) -> float:
        """Fraction of the training variance the top-k directions keep."""
        return float(self.values[:k].sum() / self.values.sum())


# ----------------------------------------------------------------------------------------------------------
# reconstruction metrics

class Metrics:
    """Reconstruction quality over any number of chunks of held-out states (sums in float64).

    - ``mse``: mean over tokens and dimensions of ``(x_hat - x)^2``;
    - ``cosine``: mean over tokens of ``cos(x, x_hat)``;
    - ``rel_error``: ``||X_hat - X||_F / ||X||_F`` over all held-out states;
    - ``explained_variance``: ``1 - sum ||x_hat - x||^2 / sum ||x - mean||^2`` (R^2, the held-out mean);
    - ``unexplained``: ``mean ||x_hat - x||^2 / scale`` (the training loss's measure; ``scale`` from the
      training states, so this is the validation loss the loop early-stops on).
    """

    def __init__(self, scale: float = 1.0):
        self.scale, self.n, self.d = scale, 0, 0
        self.sq_err = self.sq_norm = self.cos = 0.0
        self.sum: Optional[torch.Tensor] = None

    def add(self, x: torch.Tensor, x_hat: torch.Tensor) -> "Metrics":
        x = x.reshape(-1, x.shape[-1]).detach().double()
        x_hat = x_hat.reshape(-1, x.shape[-1]).detach().double()
        self.n, self.d = self.n + x.shape[0], x.shape[-1]
        self.sq_err += float((x_hat - x).pow(2).sum())
        self.sq_norm += float(x.pow(2).sum())
        self.cos += float(torch.nn.functional.cosine_similarity(x, x_hat, dim=-1, eps=1e-12).sum())
        s = x.sum(0).cpu()
        self.sum = s if self.sum is None else self.sum + s
        return self

    def result(self) -> dict:
        if self.n == 0:
            raise ValueError("no states were added")
        spread = self.sq_norm - float(self.sum.pow(2).sum()) / self.n
        return {"mse": self.sq_err / (self.n * self.d), "cosine": self.cos / self.n,
                "rel_error": math.sqrt(self.sq_err / self.sq_norm) if self.sq_norm > 0 else 0.0,
                "explained_variance": 1.0 - self.sq_err / spread if spread > 0 else float("nan"),
                "unexplained": self.sq_err / self.n / self.scale}


def evaluate(params: dict, chunks, scale: float = 1.0) -> dict:
    """:class:`Metrics` of ``params`` over an iterable of state tensors [..., D] (no gradients)."""
    metrics = Metrics(scale)
    with torch.no_grad():
        for x in chunks:
            metrics.add(x, apply(params, x)[0])
    return metrics.result()
