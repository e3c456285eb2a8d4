"""ECAttention operators: feature expansion and compression by null-space projections
("ECAttention: Adaptive and Principled Feature Expansion-Compression with Linear Efficiency",
OpenReview Z6GFLePzmp; Eqs. (4)-(8), Algorithms 1, 2 and 4).

With Z = [z_1 ... z_n] (C x N) the tokens of one sequence:

    expansion   (Eq. 5, Alg. 1):  e_n = (I - Q Q^T) z_n,        Q = basis(range(Z Omega))
    compression (Eqs. 6-8, Alg. 2):
        a_kn = U_k^T z_n,   Q_k = basis(range(A_k Omega)),   A_k = U_k^T Z  (p x N)
        pi_n = softmax_k( ||Q_k Q_k^T a_kn||^2 / (2 * temperature) )            (Eq. 7)
        c_n  = sum_k pi_kn U_k (I - Q_k Q_k^T) a_kn                             (Eq. 8)

``Omega`` (N x R) is a Gaussian sketch (randomized range finder, Halko et al. 2011, paper
Sec. 3.3) and ``basis`` is the regularised Cholesky orthonormalisation of Algorithm 4
(:func:`orthonormal_basis`). The layer :class:`whiteformer.attention.ECAttention` combines them as
``x + alpha * e - beta * c`` (Eq. 4). Cost is linear in N: O(N C R) and O(N p r) per head.

Padding (``attn_mask`` (B, N) bool, True = real token): padded tokens take no part in the range
finding (their columns of Z are zero) nor in memberships, and their outputs (and pi) are 0. The
j-th *real* token of a sequence uses row j of ``omega`` (real tokens are compacted onto the first
rows, whatever the padding layout), so a padded sequence with n real tokens gives on them exactly
what the same sequence alone gives with ``omega[:n]``. :func:`eca_omega` draws sketches with
that prefix property (``eca_omega(n, ...) == eca_omega(N, ...)[:n]``), so the layer is
padding-invariant too.

Under float16/bfloat16 inputs (or autocast) everything is computed in float32 (Cholesky has no
half kernels); results are returned in the input dtype. float64 is computed in float64.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from einops import rearrange

from .._checks import (
    check_eps,
    check_int,
    check_mask,
    check_nonempty,
    check_positive_real,
    check_same_device,
    check_sketch_rank,
    check_tensor,
    check_tokens_input,
    is_real,
)
from .._dtypes import autocast_off, stats_dtype
from ._kernels.registry import exporting, onnx_exporting
from .scaling import head_scale

__all__ = [
    "orthonormal_basis",
    "eca_expand",
    "eca_compress",
    "eca_omega",
    "cholesky_fallback_count",
    "reset_cholesky_fallback_count",
    "cholesky_stats",
]

DEFAULT_EPS = 1e-2  # paper Sec. C.5 / Table 10: Cholesky never fails at 1e-2


# --------------------------------------------------------------------------------------------
# Cholesky fallback statistics (paper Table 10 "fail rate")
# --------------------------------------------------------------------------------------------
class _FallbackStats:
    """Counts of :func:`orthonormal_basis` calls (eager mode only, see below)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls = 0  # calls of the basis routine (one batched Cholesky each)
        self.fallback_calls = 0  # calls in which >= 1 matrix fell back to QR (paper's fail rate)
        self.matrices = 0  # matrices factorised
        self.fallback_matrices = 0  # matrices that fell back to QR

    def record(self, matrices: int, failed: int) -> None:
        self.calls += 1
        self.matrices += matrices
        self.fallback_matrices += failed
        self.fallback_calls += int(failed > 0)


_STATS = _FallbackStats()


def cholesky_fallback_count() -> int:
    """Number of basis computations (calls) in which the Cholesky factorisation failed for at
    least one matrix and the QR fallback was used, since the last reset. This is the numerator
    of the paper's "fail rate" (Table 10); see :func:`cholesky_stats` for the denominator.

    Counted in eager mode only: under ``torch.compile`` counting would need a host sync / graph
    break, so compiled calls are not counted (the fallback itself still happens)."""
    return _STATS.fallback_calls


def reset_cholesky_fallback_count() -> None:
    """Reset all Cholesky fallback counters to 0."""
    _STATS.reset()


def cholesky_stats() -> Dict[str, float]:
    """Counters since the last reset: ``calls``, ``fallback_calls``, ``matrices``,
    ``fallback_matrices`` and ``fail_rate`` = fallback_calls / calls (0 when no calls)."""
    rate = _STATS.fallback_calls / _STATS.calls if _STATS.calls else 0.0
    return {
        "calls": _STATS.calls,
        "fallback_calls": _STATS.fallback_calls,
        "matrices": _STATS.matrices,
        "fallback_matrices": _STATS.fallback_matrices,
        "fail_rate": rate,
    }


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------


def _check_x(x) -> None:
    check_tokens_input(x)
    check_nonempty(x, "x", 2, "features")


def _check_sketch(x, omega, eps, attn_mask, features: int, features_name: str, **operands):
    """The arguments that :func:`eca_expand` and :func:`eca_compress` share, after ``x`` (B, N, C)
    (:func:`_check_x`): ``omega`` (N, R) with a rank R that a basis of ``features`` dimensions can
    hold (:func:`~whiteformer._checks.check_sketch_rank`), ``eps``, the (B, N) keep-mask, and the
    devices of omega, the mask and ``operands`` (name=value). Returns ``(eps, attn_mask)``."""
    check_tensor(omega, "omega", 2)
    if omega.shape[0] != x.shape[1]:
        raise ValueError(f"omega must have shape (N, R) with N = {x.shape[1]} (the tokens of x), got {tuple(omega.shape)}")
    eps = check_eps(eps)
    check_sketch_rank(omega.shape[1], x.shape[1], features, features_name, eps=eps)
    attn_mask = check_mask(attn_mask, x.shape[0], x.shape[1])
    check_same_device(x, "x", omega=omega, attn_mask=attn_mask, **operands)
    return eps, attn_mask


# --------------------------------------------------------------------------------------------
# orthonormal basis (Algorithm 4)
# --------------------------------------------------------------------------------------------
def orthonormal_basis(Y: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Basis of range(Y) by regularised Cholesky orthonormalisation (paper Algorithm 4, App. A.3).

    Y (..., m, r) with r <= m -> Q (..., m, r)::

        Yn = Y / ||Y||_col          (columns normalised, F.normalize semantics)
        L  = chol(Yn^T Yn + eps I)  (Eqs. 17-22)
        Q  = Yn L^{-T}              (Eq. 23; one triangular solve)

    Q is orthonormal only up to the regularisation: exactly ``Q^T Q = I - eps (L^T L)^{-1}``, so
    ``||Q^T Q - I||_2 = eps / (lambda_min(Yn^T Yn) + eps) <= 1``, and Q Q^T is the ridge-regularised
    projector Yn (Yn^T Yn + eps I)^{-1} Yn^T onto range(Y) (paper App. B.1). For eps -> 0 and
    full-rank Y it is the orthonormal basis.

    When the factorisation fails for a matrix (only possible for eps small relative to the
    conditioning, e.g. eps = 0 with a zero or repeated column), that matrix falls back to the
    Q of ``torch.linalg.qr(Yn)`` (as the paper's try/except, but decided per matrix with
    ``torch.linalg.cholesky_ex``, so other matrices of the batch are unaffected). The fallback is
    counted in eager mode (:func:`cholesky_fallback_count`, :func:`cholesky_stats`). Under
    ``torch.compile`` there is no Python branch: both results are computed and selected with
    ``torch.where``. Gradients through the QR fallback are those of ``torch.linalg.qr`` (not
    finite for rank-deficient Y).

    Half-precision inputs are computed in float32 and returned in their dtype.
    """
    check_tensor(Y, "Y")
    if Y.dim() < 2 or not 1 <= Y.shape[-1] <= Y.shape[-2]:
        raise ValueError(f"Y must have at least 2 dimensions (..., m, r) with 1 <= rank r (its columns) <= m, the "
                         f"rows of an orthonormal basis; got shape {tuple(Y.shape)}")
    eps = check_eps(eps)
    with autocast_off(Y):
        return _basis(Y.to(stats_dtype(Y)), eps).to(Y.dtype)


def _solve_q(yn: torch.Tensor, chol: torch.Tensor) -> torch.Tensor:
    # Q = Yn L^{-T}: solve X L^T = Yn
    return torch.linalg.solve_triangular(chol.transpose(-2, -1), yn, upper=True, left=False)


def _basis(y: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`orthonormal_basis` without validation, in ``y``'s (float32/float64) dtype."""
    r = y.shape[-1]
    yn = F.normalize(y, p=2.0, dim=-2)
    eye = torch.eye(r, dtype=y.dtype, device=y.device)
    gram = yn.transpose(-2, -1) @ yn + eps * eye
    if torch.compiler.is_compiling():
        failed = torch.linalg.cholesky_ex(gram.detach()).info != 0
        return _basis_with_fallback(yn, gram, eye, failed)
    chol, info = torch.linalg.cholesky_ex(gram)
    if chol.is_meta:  # shape inference only: no values to check
        return _solve_q(yn, chol)
    failed = info != 0
    n_failed = int(failed.sum())  # eager only: one host sync per call
    _STATS.record(failed.numel(), n_failed)
    if n_failed == 0:
        return _solve_q(yn, chol)
    return _basis_with_fallback(yn, gram, eye, failed)


def _projector(y: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Factors (A, B) of the projector ``Q Q^T = A B^T`` onto range(y) of :func:`orthonormal_basis`
    (``z - (z @ A) @ B^T`` is the null-space part of z): (Q, Q) with Q from :func:`_basis`; while a
    graph is exported with eps > 0, :func:`_ridge_projector` (ONNX has no Cholesky).

    With eps = 0 the Gram matrix may be singular: only the Cholesky factorisation with its QR
    fallback gives the basis, and ONNX has neither, so an ONNX export stops here with a ValueError
    (``torch.export`` keeps both as standard ATen operators).

    The basis depends on the directions of y's columns only: each column whose largest |entry|
    exceeds 2^32 is first divided by a power of two (:mod:`whiteformer.ops.scaling`, exact), so that
    its norm stays finite (float32 squares overflow from ~1.8e19)."""
    y = y / head_scale(y.transpose(-2, -1), 1).transpose(-2, -1)  # (..., 1, R): per column
    if eps > 0 and exporting():
        return _ridge_projector(y, eps)
    if onnx_exporting():
        raise ValueError(
            "ECA with eps=0 cannot be exported to ONNX: its orthonormal basis needs a Cholesky "
            "factorisation (with a QR fallback for singular Gram matrices), which ONNX has no operator "
            "for. Export a model built with eps > 0 (the paper's default is 1e-2), or use torch.export.")
    q = _basis(y, eps)
    return q, q


def _ridge_projector(y: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(Yn G^{-1}, Yn) with ``G = Yn^T Yn + eps I``: the same projector as the Cholesky basis
    (``Q Q^T = Yn G^{-1} Yn^T``, App. B.1), from matrix products only, so an exported graph holds
    standard operators. G^{-1} by the Newton-Schulz iteration ``X <- X (2 I - G X)`` from
    ``X = I / tr(G)``: the residual ``I - G X`` squares at each step, and its eigenvalues start in
    [0, 1 - eps / tr(G)] (G's eigenvalues lie in [eps, tr(G)], ``tr(G) = r (1 + eps)`` for unit
    columns), so a fixed number of steps, set by r and eps, reaches the dtype's rounding level
    (about 20 for r = 80, eps = 1e-2; each two (r, r) products)."""
    r = y.shape[-1]
    yn = F.normalize(y, p=2.0, dim=-2)
    eye = torch.eye(r, dtype=y.dtype, device=y.device)
    gram = yn.transpose(-1, -2) @ yn + eps * eye
    trace = r * (1.0 + eps)
    steps = math.ceil(math.log2(-math.log(torch.finfo(y.dtype).eps) * trace / eps)) + 2
    inv = eye / trace
    for _ in range(steps):
        inv = inv @ (2.0 * eye - gram @ inv)
    return yn @ inv, yn


def _basis_with_fallback(yn, gram, eye, failed) -> torch.Tensor:
    """Per matrix: Cholesky basis where it succeeded, QR where it failed. The inputs of the
    unselected branch are replaced by well-conditioned ones (I) so that no NaN/inf can reach the
    gradients through ``torch.where``."""
    sel = failed[..., None, None]
    chol = torch.linalg.cholesky_ex(torch.where(sel, eye, gram)).L
    q_chol = _solve_q(yn, chol)
    m, r = yn.shape[-2], yn.shape[-1]
    eye_mr = torch.eye(m, r, dtype=yn.dtype, device=yn.device)
    q_qr = torch.linalg.qr(torch.where(sel, yn, eye_mr), mode="reduced").Q
    return torch.where(sel, q_qr, q_chol)


# --------------------------------------------------------------------------------------------
# Gaussian sketches
# --------------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF
_HASH_MUL = 0x45D9F3B  # < 2**27: products of 32-bit values stay below 2**59 (no int64 overflow)


def _mix32(h):
    """32-bit integer hash (xor-shift-multiply), on Python ints or int64 tensors in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * _HASH_MUL) & _M32
    h = h ^ (h >> 16)
    h = (h * _HASH_MUL) & _M32
    return h ^ (h >> 16)


def eca_omega(
    num_tokens: int,
    rank: int,
    seed: int,
    stream: int = 0,
    *,
    device: Optional[Union[torch.device, str]] = None,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Deterministic standard-Gaussian sketch Omega (num_tokens, rank) for ``seed`` and ``stream``.

    Entry (i, j) depends only on (seed, stream, i, j) (counter-based: 32-bit integer hash +
    Box-Muller, computed in float32 with tensor ops on ``device``), so

    * the same arguments give the same Omega on every device and in every dtype (up to rounding),
    * ``eca_omega(n, ...) == eca_omega(N, ...)[:n]`` (prefix property used for padding),
    * it is traceable by ``torch.compile`` (no ``torch.Generator``).

    ``dtype`` defaults to float32.
    """
    for name, v, least in (("num_tokens", num_tokens, 1), ("rank", rank, 1), ("seed", seed, 0), ("stream", stream, 0)):
        check_int(v, name, least)
    key = _mix32(_mix32(seed & _M32) ^ ((seed >> 32) & _M32))
    key = _mix32((key + _mix32(stream & _M32) + 0x9E3779B9) & _M32)
    rows = torch.arange(num_tokens, device=device, dtype=torch.int64)
    cols = torch.arange(rank, device=device, dtype=torch.int64)
    h_row = _mix32((rows + key) & _M32).unsqueeze(-1)  # (N, 1)
    h0 = _mix32((h_row + 2 * cols) & _M32)
    h1 = _mix32((h_row + 2 * cols + 1) & _M32)
    # 24-bit uniforms in (0, 1), exact in float32
    u1 = ((h0 >> 8).to(torch.float32) + 0.5) * 2.0**-24
    u2 = ((h1 >> 8).to(torch.float32) + 0.5) * 2.0**-24
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
    return z.to(torch.float32 if dtype is None else dtype)


def _token_omega(omega: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows of omega per token: (N, R) without a mask; with a mask (B, N, R) where the j-th real
    token of each sequence gets row j (padded tokens get some row; their features are zero)."""
    if attn_mask is None:
        return omega
    idx = (torch.cumsum(attn_mask.to(torch.int64), dim=1) - 1).clamp_min(0)  # (B, N)
    return omega[idx]


def _sketch(z: torch.Tensor, omega_t: torch.Tensor) -> torch.Tensor:
    """Y = Z Omega for tokens-last features: z (B, [H,] N, F) -> (B, [H,] F, R)."""
    if omega_t.dim() == 3 and z.dim() == 4:
        omega_t = omega_t.unsqueeze(1)  # per-sequence rows, shared by the heads
    return z.transpose(-1, -2) @ omega_t


# --------------------------------------------------------------------------------------------
# expansion (Eq. 5, Algorithm 1)
# --------------------------------------------------------------------------------------------
def eca_expand(
    x: torch.Tensor,
    omega: torch.Tensor,
    eps: float = DEFAULT_EPS,
    attn_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Expansion module of ECAttention: the null-space part of every token (Eq. 5, Algorithm 1).

    Args:
        x: (B, N, C) tokens; per sequence Z = x^T (C x N).
        omega: (N, R) sketch, 1 <= R <= C (R > N only with eps > 0) (the layer uses R = K * r, paper Eq. 5).
        eps: Cholesky regulariser of :func:`orthonormal_basis`.
        attn_mask: optional (B, N) bool keep-mask (True = real token); see the module docstring.

    Returns:
        (B, N, C): ``(I - Q Q^T) z_n`` with Q = basis(range(Z Omega)); 0 at padded tokens.
    """
    _check_x(x)
    eps, attn_mask = _check_sketch(x, omega, eps, attn_mask, x.shape[2], "the feature dimension C")
    cd = stats_dtype(x)
    with autocast_off(x):
        out = _expand(x.to(cd), omega.to(cd), eps, attn_mask)
    return out.to(x.dtype)


def _expand(x: torch.Tensor, omega: torch.Tensor, eps: float, attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Validated, same-dtype version of :func:`eca_expand` (B, N, C) -> (B, N, C)."""
    if attn_mask is not None:
        x = x.masked_fill(~attn_mask.unsqueeze(-1), 0.0)
    qa, qb = _projector(_sketch(x, _token_omega(omega, attn_mask)), eps)  # (B, C, R) each
    return x - (x @ qa) @ qb.transpose(-1, -2)


# --------------------------------------------------------------------------------------------
# compression (Eqs. 6-8, Algorithm 2)
# --------------------------------------------------------------------------------------------
def _check_temperature(temperature, heads: int) -> None:
    if is_real(temperature):
        check_positive_real(temperature, "temperature")
        return
    check_tensor(temperature, "temperature", (0, 1))
    if temperature.dim() == 1 and temperature.shape[0] not in (1, heads):
        raise ValueError(f"temperature must have shape (), (1,) or (H,) = ({heads},), got {tuple(temperature.shape)}")


def eca_compress(
    x: torch.Tensor,
    U: torch.Tensor,
    omega: torch.Tensor,
    temperature: Union[torch.Tensor, float],
    num_heads: int,
    eps: float = DEFAULT_EPS,
    attn_mask: Optional[torch.Tensor] = None,
    return_pi: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Compression module of ECAttention (Eqs. 6-8; Algorithm 2 with the memberships of Eq. 7).

    Args:
        x: (B, N, C) tokens z_n.
        U: (C, H*p) subspace bases [U_1 ... U_H]; codes a_kn = U_k^T z_n (p-dimensional).
        omega: (N, r) sketch shared by the heads, 1 <= r <= min(N, p).
        temperature: eta of Eq. 7: a number > 0 or a tensor of shape (), (1,) or (H,) (per head).
        num_heads: H.
        eps: Cholesky regulariser of :func:`orthonormal_basis`.
        attn_mask: optional (B, N) bool keep-mask (True = real token).
        return_pi: also return the memberships.

    Returns:
        out (B, N, C) = ``sum_k pi_kn U_k (I - Q_k Q_k^T) a_kn`` (Eq. 8 without the minus sign and
        the residual), with Q_k = basis(range(A_k Omega)) and
        ``pi_n = softmax_k(||Q_k Q_k^T a_kn||^2 / (2 temperature))``: Eq. 7 (squared norm,
        1 / (2 eta), softmax over the heads), not Alg. 2's printed form (the norm / eta, softmax over
        tokens, which contradicts Eq. 7's shapes).
        With ``return_pi``: ``(out, pi)`` with pi (B, H, N), 0 at padded tokens.
    """
    _check_x(x)
    check_int(num_heads, "num_heads", 1)
    check_tensor(U, "U", 2)
    if U.shape[0] != x.shape[2] or U.shape[1] == 0 or U.shape[1] % num_heads != 0:
        raise ValueError(f"U must have shape (C, H*p) with C = {x.shape[2]} and H*p a positive multiple of "
                         f"num_heads = {num_heads}, got {tuple(U.shape)}")
    _check_temperature(temperature, num_heads)
    eps, attn_mask = _check_sketch(x, omega, eps, attn_mask, U.shape[1] // num_heads, "the head dimension p",
                                   U=U, temperature=temperature)
    cd = torch.promote_types(stats_dtype(x), stats_dtype(U))
    if isinstance(temperature, torch.Tensor):
        cd = torch.promote_types(cd, stats_dtype(temperature))
        temp = temperature.to(cd)
    else:
        temp = torch.tensor(float(temperature), dtype=cd, device=x.device)
    with autocast_off(x):
        out, pi = _compress(x.to(cd), U.to(cd), omega.to(cd), temp, num_heads, eps, attn_mask)
    out = out.to(x.dtype)
    return (out, pi.to(x.dtype)) if return_pi else out


def _compress(
    x: torch.Tensor,
    U: torch.Tensor,
    omega: torch.Tensor,
    temperature: torch.Tensor,
    num_heads: int,
    eps: float,
    attn_mask: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Validated, same-dtype version of :func:`eca_compress`: returns (out (B, N, C), pi (B, H, N))."""
    if attn_mask is not None:
        x = x.masked_fill(~attn_mask.unsqueeze(-1), 0.0)
    codes = rearrange(x @ U, "b n (h p) -> b h n p", h=num_heads)  # a_kn, tokens as rows
    qa, qb = _projector(_sketch(codes, _token_omega(omega, attn_mask)), eps)  # (B, H, p, r) each
    col = (codes @ qa) @ qb.transpose(-1, -2)  # Q_k Q_k^T a_kn
    null = codes - col  # (I - Q_k Q_k^T) a_kn
    temp = temperature.reshape(-1, 1) if temperature.dim() == 1 else temperature  # (H or 1, 1)
    # Eq. 7 scale-safe: with col = c col' per token (c (B, 1, N, 1) a power of two, 1 unless the
    # token's largest |entry| exceeds 2^32), logits = c^2 logits'; the softmax over heads is taken
    # of (logits' - max) c c, finite up to -inf (no c^2, which overflows, and no inf - inf)
    c = head_scale(col.transpose(1, 2), 2).transpose(1, 2)  # (B, 1, N, 1)
    logits = (col / c).square().sum(dim=-1) / (2.0 * temp)  # (B, H, N), Eq. 7 in units of c^2
    c = c[..., 0]
    logits = (logits - logits.detach().amax(dim=1, keepdim=True)) * c * c
    pi = torch.softmax(logits, dim=1)
    if attn_mask is not None:
        pi = pi.masked_fill(~attn_mask.unsqueeze(1), 0.0)
    out = rearrange(null * pi.unsqueeze(-1), "b h n p -> b n (h p)") @ U.t()
    return out, pi
