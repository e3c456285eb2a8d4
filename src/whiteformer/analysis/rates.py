"""Coding rates of the MCR² family, for white-box analysis of token features.

Tokens are **rows**: ``Z`` has shape ``(..., N, d)`` (the papers pack tokens as columns,
``Z_paper = Z^T``).  Every function is batched over arbitrary leading dims (images, heads)
and returns one value per batch element, shape ``(...)`` (or ``(..., K)`` per group with
``reduction="none"``).

Implemented quantities (``n = N`` tokens, ``n_k = sum_i Pi_ik``):

* ``coding_rate``           R(Z)   = 1/2 logdet(I + d/(n eps²) Z^T Z)                 ToST Eq. (1)
* ``compression_rate``      R_c    = 1/2 sum_k n_k/n logdet(I + d/(n_k eps²) Z^T Diag(pi_k) Z)
                                                                                   ToST Eq. (1)
                            R_c,f  = 1/2 sum_k n_k/n F(1/n_k Z^T Diag(pi_k) Z)       ToST Eq. (2)
* ``rate_reduction``        ΔR     = R - R_c                                         ToST Eq. (1)
* ``subspace_compression_rate``
                            R_c(Z | U_[K]) = 1/2 sum_k logdet(I + p/(n eps²) (Z U_k)^T (Z U_k))
                                                                                   ECA Eq. (2)
* ``variational_compression_rate``
                            R^var_c,f = 1/2 sum_k n_k/n sum_i f((1/n_k) U_k^T Z^T Diag(pi_k) Z U_k)_ii
                                                                     ToST Eq. (4), DMSA Eq. (15)

Numerics: the log-determinants use the smaller of the two Gram matrices (``N x N`` or
``d x d``; ``logdet(I + c A^T A) = logdet(I + c A A^T)``) and a Cholesky factorisation of the
SPD matrix ``I + c G`` (``torch.linalg.slogdet`` as fallback).  Computations run in
``dtype`` (default: float32 for half inputs, else the promoted input dtype; pass
``dtype=torch.float64`` for float64 accumulation) and the result is returned in that dtype.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .._checks import check_choice, check_finite, check_int, check_nonempty, check_positive_real, check_tensor
from .._dtypes import stats_dtype

__all__ = [
    "coding_rate",
    "compression_rate",
    "rate_reduction",
    "subspace_compression_rate",
    "variational_compression_rate",
    "logdet_f",
]

_REDUCTIONS = ("sum", "none")


# ----------------------------------------------------------------------------- validation
def _check_rate_args(Z, eps, reduction: str = "sum", f=None, Pi=None, simplex: bool = True) -> float:
    """The arguments of every rate: Z (..., N, d) floating and finite with N, d >= 1, eps > 0,
    ``reduction``, the spectral function ``f`` and the memberships ``Pi`` when given
    (:func:`_check_membership`); returns eps as a float."""
    check_tensor(Z, "Z")
    if Z.dim() < 2:
        raise ValueError(f"Z must have shape (..., N, d) with at least 2 dims, got shape {tuple(Z.shape)}")
    check_nonempty(Z, "Z", -2)
    check_nonempty(Z, "Z", -1, "features")
    check_finite(Z, "Z")
    check_choice(reduction, "reduction", _REDUCTIONS)
    if f is not None and not callable(f):
        raise TypeError(f"f must be a callable applied element-wise to a tensor, got {type(f).__name__}")
    if Pi is not None:
        _check_membership(Pi, Z, simplex=simplex)
    return check_positive_real(eps, "eps")


def _compute_dtype(dtype: Optional[torch.dtype], *tensors: torch.Tensor) -> torch.dtype:
    if dtype is not None:
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype must be torch.float32 or torch.float64 (accumulation dtype), got {dtype}")
        return dtype
    out = stats_dtype(tensors[0])
    for t in tensors[1:]:
        out = torch.promote_types(out, stats_dtype(t))
    return out


def _batch_shape(name_a: str, a: torch.Size, name_b: str, b: torch.Size) -> torch.Size:
    try:
        return torch.broadcast_shapes(a, b)
    except RuntimeError:
        raise ValueError(f"batch dims of {name_a} {tuple(a)} and {name_b} {tuple(b)} are not broadcastable") from None


def _check_membership(Pi, Z: torch.Tensor, *, simplex: bool = True) -> None:
    """Pi: (..., N, K) with Z's N, K >= 1, finite and non-negative; rows on the simplex unless
    ``simplex=False``."""
    check_tensor(Pi, "Pi")
    if Pi.dim() < 2 or Pi.shape[-2] != Z.shape[-2]:
        raise ValueError(f"Pi must have shape (..., N, K), N = {Z.shape[-2]} rows (Z's tokens), got {tuple(Pi.shape)}")
    check_nonempty(Pi, "Pi", -1, "groups")
    _batch_shape("Z", Z.shape[:-2], "Pi", Pi.shape[:-2])
    check_finite(Pi, "Pi")
    if Pi.device.type == "meta":  # no values to check
        return
    tol = 1e-3 if Pi.dtype in (torch.float16, torch.bfloat16) else 1e-4
    if bool((Pi < -tol).any()):
        raise ValueError(f"Pi must be non-negative (memberships), got min {Pi.min().item():.3g}")
    err = (Pi.to(stats_dtype(Pi)).sum(-1) - 1).abs().max().item() if simplex else 0.0
    if err > tol * max(1, Pi.shape[-1]):
        raise ValueError(f"each row of Pi must lie on the simplex (sum to 1 over the K groups), max |sum - 1| = {err:.3g}")


def _split_bases(U, d: int, num_heads: Optional[int], heads_2d: Optional[int] = None) -> torch.Tensor:
    """U (d, K*p) with ``num_heads=K`` (``heads_2d`` when num_heads is None), or (..., K, d, p)
    -> (..., K, d, p)."""
    check_tensor(U, "U")
    check_finite(U, "U")
    if U.dim() == 2 and num_heads is None:
        num_heads = heads_2d
    if U.dim() == 2 and num_heads is None:
        raise ValueError(f"num_heads (K) is required when U is 2-D (d, K*p), got shape {tuple(U.shape)}")
    if num_heads is not None:
        check_int(num_heads, "num_heads", 1)
    if U.dim() == 2:
        if U.shape[1] % num_heads != 0:
            raise ValueError(f"U has {U.shape[1]} columns, which is not K*p with K = num_heads = {num_heads}")
        U = U.reshape(U.shape[0], num_heads, U.shape[1] // num_heads).transpose(0, 1)
    if U.dim() < 3 or U.shape[-2] != d or U.shape[-1] == 0 or U.shape[-3] == 0:
        raise ValueError(f"U must have shape (d, K*p) or (..., K, d, p) with d = {d}, K, p >= 1, got {tuple(U.shape)}")
    if num_heads is not None and U.shape[-3] != num_heads:
        raise ValueError(f"U has K = {U.shape[-3]} bases but num_heads = {num_heads}")
    return U


# ----------------------------------------------------------------------------- linear algebra
def _logdet_spd(M: torch.Tensor) -> torch.Tensor:
    """log det of a batch of SPD matrices (..., m, m): Cholesky, slogdet where it fails."""
    L, info = torch.linalg.cholesky_ex(M)
    out = 2 * torch.log(torch.diagonal(L, dim1=-2, dim2=-1)).sum(-1)
    if M.device.type != "meta" and bool((info != 0).any()):  # (meta: shapes only)
        out = torch.where(info == 0, out, torch.linalg.slogdet(M)[1])
    return out


def _logdet_i_plus_gram(A: torch.Tensor, c) -> torch.Tensor:
    """logdet(I + c A^T A) for A (..., m, q), using the smaller Gram matrix.

    ``c`` is a float or a tensor broadcastable to ``A.shape[:-2]``."""
    m, q = A.shape[-2], A.shape[-1]
    G = A @ A.transpose(-1, -2) if m < q else A.transpose(-1, -2) @ A
    if isinstance(c, torch.Tensor):
        c = c[..., None, None]
    eye = torch.eye(G.shape[-1], dtype=G.dtype, device=G.device)
    return _logdet_spd(eye + c * G)


def logdet_f(d: int, eps: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """The paper's default spectral function f(x) = log(1 + d/eps² x) (ToST Sec. 3.1)."""
    c = d / check_positive_real(eps, "eps") ** 2
    return lambda x: torch.log1p(c * x)


# ----------------------------------------------------------------------------- rates
def coding_rate(Z: torch.Tensor, eps: float = 0.5, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Coding rate R(Z) = 1/2 logdet(I + d/(N eps²) Z^T Z) (ToST Eq. 1, expansion term).

    Args:
        Z: (..., N, d) token features (tokens as rows).
        eps: quantisation error eps > 0.
        dtype: accumulation dtype (float32/float64); default float32 for half inputs, else Z.dtype.
    Returns:
        (...) coding rate in nats, in the accumulation dtype.
    """
    eps = _check_rate_args(Z, eps)
    return _coding_rate(Z, eps, _compute_dtype(dtype, Z))


def _coding_rate(Z, eps, cd):
    N, d = Z.shape[-2], Z.shape[-1]
    return 0.5 * _logdet_i_plus_gram(Z.to(cd), d / (N * eps**2))


def compression_rate(
    Z: torch.Tensor,
    Pi: torch.Tensor,
    eps: float = 0.5,
    *,
    f: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    reduction: str = "sum",
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Compression term with soft memberships (ToST Eq. 1; Eq. 2 with a spectral ``f``).

    R_c(Z, Pi) = 1/2 sum_k (n_k/N) logdet(I + d/(n_k eps²) Z^T Diag(pi_k) Z),  n_k = sum_i Pi_ik.
    With ``f`` given: R_c,f = 1/2 sum_k (n_k/N) sum_{i=1}^d f(lambda_i(Z^T Diag(pi_k) Z / n_k))
    (eigenvalues; ``f(0)`` is counted for the zero eigenvalues of the d x d matrix). The
    default ``f = None`` is ``f(x) = log(1 + d/eps² x)``, i.e. Eq. 1. Groups with n_k = 0
    contribute 0. With one-hot ``Pi`` this is the classical MCR² compression term.

    Args:
        Z: (..., N, d); Pi: (..., N, K), rows on the simplex (batch dims broadcast with Z's).
        reduction: "sum" -> (...); "none" -> per-group terms (..., K).
    """
    eps = _check_rate_args(Z, eps, reduction, f, Pi)
    return _compression_rate(Z, Pi, eps, f, reduction, _compute_dtype(dtype, Z, Pi))


def _group_grams(Z: torch.Tensor, Pi: torch.Tensor) -> torch.Tensor:
    """Per-group Gram matrices with the same non-zero spectrum as Z^T Diag(pi_k) Z: (..., K, m, m).

    m = min(N, d). The N x N form Diag(sqrt pi_k) Z Z^T Diag(sqrt pi_k) is used only when N < d
    and Pi needs no gradient (sqrt has an infinite derivative at Pi_ik = 0)."""
    N, d = Z.shape[-2], Z.shape[-1]
    if N < d and not Pi.requires_grad:
        s = Pi.sqrt().transpose(-1, -2)  # (..., K, N)
        G = Z @ Z.transpose(-1, -2)
        return s[..., :, None] * G[..., None, :, :] * s[..., None, :]
    return torch.einsum("...nk,...nd,...ne->...kde", Pi, Z, Z)


def _compression_rate(Z, Pi, eps, f, reduction, cd):
    Z, Pi = Z.to(cd), Pi.to(cd).clamp_min(0)
    N, d = Z.shape[-2], Z.shape[-1]
    nk = Pi.sum(-2)  # (..., K)
    nk_safe = torch.where(nk > 0, nk, torch.ones_like(nk))
    G = _group_grams(Z, Pi) / nk_safe[..., None, None]  # spectrum of Z^T Diag(pi_k) Z / n_k
    if f is None:
        eye = torch.eye(G.shape[-1], dtype=cd, device=Z.device)
        terms = _logdet_spd(eye + (d / eps**2) * G)
    else:
        ev = torch.linalg.eigvalsh(G).clamp_min(0)
        terms = f(ev).sum(-1)
        if G.shape[-1] < d:  # zero eigenvalues of the d x d matrix not seen by the N x N Gram
            terms = terms + (d - G.shape[-1]) * f(torch.zeros((), dtype=cd, device=Z.device))
    terms = torch.where(nk > 0, 0.5 * nk / N * terms, torch.zeros_like(terms))
    return terms.sum(-1) if reduction == "sum" else terms


def rate_reduction(
    Z: torch.Tensor, Pi: torch.Tensor, eps: float = 0.5, *, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """Rate reduction ΔR(Z, Pi) = R(Z) - R_c(Z, Pi) (ToST Eq. 1, MCR²). Shapes as in
    :func:`compression_rate`; returns (broadcast batch dims of Z and Pi)."""
    eps = _check_rate_args(Z, eps, Pi=Pi)
    cd = _compute_dtype(dtype, Z, Pi)
    return _coding_rate(Z, eps, cd) - _compression_rate(Z, Pi, eps, None, "sum", cd)


def subspace_compression_rate(
    Z: torch.Tensor,
    U: torch.Tensor,
    eps: float = 0.5,
    *,
    num_heads: Optional[int] = None,
    reduction: str = "sum",
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """CRATE/ECA compression term R_c(Z | U_[K]) (ECA Eq. 2).

    R_c(Z | U_[K]) = 1/2 sum_k logdet(I + p/(N eps²) (Z U_k)^T (Z U_k)).

    Args:
        Z: (..., N, d).
        U: (d, K*p) with ``num_heads=K`` (the concatenation [U_1, ..., U_K]), or bases
            (..., K, d, p) whose batch dims broadcast with Z's.
        reduction: "sum" -> (...); "none" -> per-head terms (..., K).
    """
    eps = _check_rate_args(Z, eps, reduction)
    Ub = _split_bases(U, Z.shape[-1], num_heads)
    _batch_shape("Z", Z.shape[:-2], "U", Ub.shape[:-3])
    cd = _compute_dtype(dtype, Z, U)
    N, p = Z.shape[-2], Ub.shape[-1]
    A = Z.to(cd)[..., None, :, :] @ Ub.to(cd)  # (..., K, N, p) codes U_k^T z_i as rows
    terms = 0.5 * _logdet_i_plus_gram(A, p / (N * eps**2))
    return terms.sum(-1) if reduction == "sum" else terms


def variational_compression_rate(
    Z: torch.Tensor,
    Pi: torch.Tensor,
    U: torch.Tensor,
    eps: float = 0.5,
    *,
    f: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    num_heads: Optional[int] = None,
    decoupled: bool = False,
    reduction: str = "sum",
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Variational compression term R^var_c,f(Z, Pi | {U_k}) (ToST Eq. 4; DMSA Eq. 15).

    R^var = 1/2 sum_k (n_k/N) sum_{i=1}^p f( (1/n_k) (U_k^T Z^T Diag(pi_k) Z U_k)_ii ),
    n_k = sum_j Pi_jk, default f(x) = log(1 + d/eps² x) with d = Z.shape[-1]. Groups with
    n_k = 0 contribute 0. For orthonormal U_k this upper-bounds R_c,f (ToST Theorem 1 /
    Corollary 1), with equality when U_k diagonalises each group covariance.

    DMSA's decoupled form (Eq. 15): pass ``decoupled=True`` so that ``Pi`` only needs to be
    non-negative (e.g. sigmoid memberships, rows not on the simplex) and pass the sparsified
    bases U_k^S = S ⊙ ST(.) as a per-sample ``U`` of shape (B, K, d, p).

    Args:
        Z: (..., N, d); Pi: (..., N, K).
        U: (d, K*p) (``num_heads`` defaults to K = Pi.shape[-1]) or (..., K, d, p).
        f: element-wise concave non-decreasing function with f(0) = 0 (callable on tensors).
        reduction: "sum" -> (...); "none" -> per-group terms (..., K).
    """
    eps = _check_rate_args(Z, eps, reduction, f, Pi, simplex=not decoupled)
    K = Pi.shape[-1]
    Ub = _split_bases(U, Z.shape[-1], num_heads, heads_2d=K)
    if Ub.shape[-3] != K:
        raise ValueError(f"U has K = {Ub.shape[-3]} bases but Pi has K = {K} groups")
    _batch_shape("Z", Z.shape[:-2], "U", Ub.shape[:-3])
    _batch_shape("Pi", Pi.shape[:-2], "U", Ub.shape[:-3])
    cd = _compute_dtype(dtype, Z, Pi, U)
    Z, Pi, Ub = Z.to(cd), Pi.to(cd).clamp_min(0), Ub.to(cd)
    N, d = Z.shape[-2], Z.shape[-1]
    if f is None:
        f = logdet_f(d, eps)
    nk = Pi.sum(-2)  # (..., K)
    nk_safe = torch.where(nk > 0, nk, torch.ones_like(nk))
    A2 = (Z[..., None, :, :] @ Ub).square()  # (..., K, N, p)
    # diag of U_k^T Z^T Diag(pi_k) Z U_k / n_k: second moment of the codes under pi_k / n_k
    diag = (Pi.transpose(-1, -2)[..., :, None, :] @ A2).squeeze(-2) / nk_safe[..., None]  # (..., K, p)
    terms = f(diag).sum(-1)
    terms = torch.where(nk > 0, 0.5 * nk / N * terms, torch.zeros_like(terms))
    return terms.sum(-1) if reduction == "sum" else terms
