"""Plain CP-ALS and CPD-EPC (the reference implementations; :mod:`.cp_fast` is the fast path).

Each step is the textbook formula: the MTTKRP of every mode is recomputed from the current factors
(:func:`~._tensor.mttkrp`), the Grams of all factors are formed again for every solve, the error is
evaluated afresh after each sweep and the multiplier of the EPC update is bisected one scalar at a
time. :func:`whiteformer.compress.cp` runs the fast path, which is tested against these.
"""
from __future__ import annotations

import math

import torch

from ._tensor import TensorLike, mttkrp, norm_sq, unfolding_gram

__all__ = ["cp_als", "epc_correction", "cp_sensitivity", "cp_norm_sq"]


def cp_norm_sq(factors) -> torch.Tensor:
    """||[A, B, C]||_F^2 = sum of (A^T A) * (B^T B) * (C^T C)."""
    A, B, C = factors
    return ((A.T @ A) * (B.T @ B) * (C.T @ C)).sum()


def cp_sensitivity(factors) -> float:
    """Sensitivity ss of a CP model (see :mod:`.cp`)."""
    A, B, C = factors
    na, nb, nc = (A * A).sum(0), (B * B).sum(0), (C * C).sum(0)
    return float(A.shape[0] * (nb * nc).sum() + B.shape[0] * (na * nc).sum() + C.shape[0] * (na * nb).sum())


def _error_sq(Y, factors, normY2) -> float:
    A, B, C = factors
    inner = (mttkrp(Y, (A, B, C), 2) * C).sum()
    return float(normY2 - 2 * inner + cp_norm_sq(factors))


def _gram_others(factors, mode):
    grams = [f.T @ f for f in factors]
    out = None
    for m in range(3):
        if m != mode:
            out = grams[m] if out is None else out * grams[m]
    return out


def _solve_ls(mtt: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """mtt @ gram^{-1} with a tiny ridge for rank-deficient Grams."""
    r = gram.shape[0]
    ridge = 1e-12 * float(gram.diagonal().mean().clamp_min(1e-300))
    g = gram + ridge * torch.eye(r, dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve(g, mtt.T).T


def _balance(factors):
    """Rescale each rank-1 term so that its three vectors have equal norms (same tensor)."""
    norms = [f.norm(dim=0) for f in factors]
    prod = (norms[0] * norms[1] * norms[2]).clamp_min(1e-300)
    target = prod ** (1.0 / 3.0)
    return [f * (target / n.clamp_min(1e-300)) for f, n in zip(factors, norms)]


def _init_factors(Y, rank: int, init: str, generator: torch.Generator):
    I, J, H = Y.shape
    dt, dev = torch.float64, (Y.P.device if hasattr(Y, "P") else Y.device)
    factors = []
    for mode, dim in enumerate((I, J, H)):
        rnd = torch.randn(dim, rank, generator=generator, dtype=dt).to(dev)
        if init == "random":
            factors.append(rnd)
            continue
        evals, evecs = torch.linalg.eigh(unfolding_gram(Y, mode))
        k = min(rank, dim)
        lead = evecs[:, torch.argsort(evals, descending=True)[:k]]
        if k < rank:
            lead = torch.cat([lead, rnd[:, k:] / math.sqrt(dim)], dim=1)
        factors.append(lead)
    return factors


def cp_als(Y: TensorLike, rank: int, *, n_iter_max: int = 100, tol: float = 1e-8, init: str = "svd",
           seed: int = 0, factors=None):
    """Plain CP-ALS (float64). Returns (factors [A, B, C], relative error, iterations).

    ``init``: "svd" (leading eigenvectors of the mode Grams, random columns when R exceeds a
    dimension) or "random" (seeded normal); or pass ``factors`` to warm-start.
    """
    normY2 = float(norm_sq(Y))
    if factors is None:
        g = torch.Generator().manual_seed(seed)
        factors = _init_factors(Y, rank, init, g)
    factors = [f.clone() for f in factors]
    prev, it = None, 0
    err2 = _error_sq(Y, factors, normY2)
    for it in range(1, n_iter_max + 1):
        for mode in range(3):
            mtt = mttkrp(Y, factors, mode)
            factors[mode] = _solve_ls(mtt, _gram_others(factors, mode))
        factors = _balance(factors)
        err2 = _error_sq(Y, factors, normY2)
        rel = math.sqrt(max(err2, 0.0) / normY2) if normY2 > 0 else 0.0
        if prev is not None and abs(prev - rel) <= tol * max(prev, 1e-30):
            break
        prev = rel
    rel = math.sqrt(max(err2, 0.0) / normY2) if normY2 > 0 else 0.0
    return factors, rel, it


def _epc_error(s: torch.Tensor, z2: torch.Tensor, floor: float, normY2: float, lam: float) -> float:
    """Error^2 of the EPC update at multiplier ``lam`` (see :func:`_epc_update`)."""
    d = s + lam
    keep = d > floor
    return normY2 - float((z2[keep] * (s[keep] + 2 * lam) / d[keep] ** 2).sum())


def bisect_lambda(s: torch.Tensor, z2: torch.Tensor, floor: float, normY2: float, delta2: float) -> float:
    """The largest multiplier lam >= 0 whose EPC error^2 stays below ``delta2``, by scalar bisection
    (geometric when possible) to a relative width of 1e-12; 0 when least squares only just meets it."""
    def err(lam: float) -> float:
        return _epc_error(s, z2, floor, normY2, lam)

    if err(0.0) >= delta2:
        return 0.0  # even least squares only just meets the bound
    hi = max(float(s.max()), 1e-30)
    while err(hi) < delta2 and hi < 1e300:
        hi *= 4.0
    lo = hi
    while err(lo) >= delta2 and lo > 1e-300:
        lo /= 4.0
    if err(lo) >= delta2:
        lo = 0.0
    for _ in range(200):  # bisection (geometric when possible); lo stays feasible
        mid = math.sqrt(lo * hi) if lo > 0 else 0.5 * hi
        if err(mid) < delta2:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return lo


def _epc_update(mtt: torch.Tensor, gram: torch.Tensor, w: torch.Tensor, normY2: float, delta2: float,
                search=bisect_lambda):
    """min_X sum_r w_r |x_r|^2  s.t.  ||Y_(n) - X M^T||^2 <= delta2, with Y_(n) M = mtt, M^T M = gram.

    With X' = X W^{1/2}, G' = W^{-1/2} G W^{-1/2} = V diag(s) V^T and Z = mtt W^{-1/2} V, the solution
    is X' V = Z diag(1/(s + lam)) and its error is ``normY2 - sum_r |z_r|^2 (s_r + 2 lam)/(s_r + lam)^2``,
    increasing in lam; lam is found by ``search(s, z2, floor, normY2, delta2)`` (lam = 0 is the
    least-squares solution).
    """
    w = w.clamp_min(1e-300)
    wis = w.rsqrt()
    gp = gram * wis[:, None] * wis[None, :]
    s, V = torch.linalg.eigh(gp)
    s = s.clamp_min(0.0)
    Z = (mtt * wis) @ V
    z2 = (Z * Z).sum(0)
    floor = 1e-12 * float(s.max().clamp_min(1e-300))
    lam = search(s, z2, floor, normY2, delta2)
    d = s + lam
    inv = torch.where(d > floor, 1.0 / d.clamp_min(floor), torch.zeros_like(d))
    Xp = (Z * inv) @ V.T
    return Xp * wis


def epc_correction(Y: TensorLike, factors, delta: float, *, n_iter_max: int = 50, tol: float = 1e-6):
    """Error-preserving correction (CPD-EPC, see :mod:`.cp`): minimise ss s.t. ||Y - [A,B,C]|| <= delta.

    ``delta`` is the absolute error to keep (usually the ALS error). Returns the corrected factors.
    """
    normY2 = float(norm_sq(Y))
    delta2 = float(delta) ** 2
    factors = [f.clone() for f in factors]
    dims = [f.shape[0] for f in factors]
    ss_prev = cp_sensitivity(factors)
    for _ in range(n_iter_max):
        for mode in range(3):
            others = [m for m in range(3) if m != mode]
            n = [(factors[m] * factors[m]).sum(0) for m in range(3)]
            # terms of ss that depend on factor `mode`: dims[o1] * |u_o2|^2 + dims[o2] * |u_o1|^2
            w = dims[others[0]] * n[others[1]] + dims[others[1]] * n[others[0]]
            mtt = mttkrp(Y, factors, mode)
            factors[mode] = _epc_update(mtt, _gram_others(factors, mode), w, normY2, delta2)
        ss = cp_sensitivity(factors)
        if abs(ss_prev - ss) <= tol * ss_prev:
            break
        ss_prev = ss
    return factors
