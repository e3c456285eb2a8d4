"""CP decomposition by ALS with the error-preserving correction (CPD-EPC).

CP SlimAtt (IrrAtt paper, Sec. 2.4, Eq. 3) approximates the query-key tensor by
``Y ~= sum_r S^Q(:, r) o S^K(:, r) o S^H(:, r)``; here the factors are called A (I x R), B (J x R),
C (H x R).

ALS touches Y only through MTTKRP and its norm, which are computed from the per-head thin factors
when Y is given as :class:`HeadFactors` (Y is never formed).

CPD-EPC (Phan et al., ECCV 2020, "Stable low-rank tensor decomposition for compression of CNN"):
keep the ALS approximation error ``delta = ||Y - [A, B, C]||_F`` and minimise the sensitivity

    ss(A, B, C) = I sum_r |b_r|^2 |c_r|^2 + J sum_r |a_r|^2 |c_r|^2 + H sum_r |a_r|^2 |b_r|^2

(the expected ``||[A+dA, B+dB, C+dC] - [A, B, C]||^2 / sigma^2`` for i.i.d. factor perturbations of
variance sigma^2, to first order), subject to ``||Y - [A, B, C]||_F <= delta``. Each factor update is
a quadratically constrained least-squares problem solved exactly:
``A = Y_(1) M (M^T M + lambda W)^{-1}`` with the multiplier lambda >= 0 found by bisection so that
the error equals delta (M the Khatri-Rao product of the other two factors, W the diagonal weights).
This keeps the error and decreases ss monotonically, which gives small, balanced factors that are
stable for fine-tuning.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .._checks import check_choice, check_int
from ._tensor import TensorLike, as_float64, check_tensor_like, norm_sq
from .cp_fast import cp_als_fast, epc_correction_fast
from .cp_reference import _error_sq, cp_als, cp_norm_sq, cp_sensitivity, epc_correction
from .whitening import Whitening

__all__ = ["CPResult", "cp", "correct_cp", "cp_als", "epc_correction", "cp_als_fast", "epc_correction_fast", "cp_sensitivity",
           "cp_norm_sq"]

_IMPLS = {"fast": (cp_als_fast, epc_correction_fast), "reference": (cp_als, epc_correction)}


@dataclass
class CPResult:
    """Rank-R CP model ``Y ~= sum_r A[:, r] o B[:, r] o C[:, r]``.

    Attributes:
        A (I, R), B (J, R), C (H, R): factors (C is the head-fusion matrix S^H).
        rel_error: ||Y - Yhat|| / ||Y|| of the returned factors (whitened metric if calibrated).
        als_rel_error: the same after ALS, before the correction.
        sensitivity / als_sensitivity: ss (see module docstring) after / before the correction.
        n_iter: ALS iterations run; epc: whether the correction was applied.
    """

    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    rel_error: float
    als_rel_error: float
    sensitivity: float
    als_sensitivity: float
    n_iter: int
    epc: bool

    @property
    def rank(self) -> int:
        return self.A.shape[1]

    def to_tensor(self) -> torch.Tensor:
        """The approximation (I, J, H)."""
        return torch.einsum("ir,jr,hr->ijh", self.A, self.B, self.C)

    def factor_norm_sq(self) -> float:
        """||A||^2 + ||B||^2 + ||C||^2."""
        return float(sum((f.double() ** 2).sum() for f in (self.A, self.B, self.C)))


def cp(Y: TensorLike, rank: int, *, n_iter_max: int = 100, tol: float = 1e-8, init: str = "svd",
       epc: bool = True, epc_iter_max: int = 50, epc_tol: float = 1e-6, seed: int = 0,
       calib: Optional[Union[torch.Tensor, Whitening]] = None, impl: str = "fast") -> CPResult:
    """Rank-R CP decomposition of Y (I, J, H) by ALS, then CPD-EPC (IrrAtt paper, Sec. 2.4 / 3.2).

    Args:
        Y: dense (I, J, H) tensor or :class:`HeadFactors` (ALS then runs from the factors).
        rank: R >= 1.
        n_iter_max, tol, init, seed: ALS controls (init "svd" or "random").
        epc: apply the error-preserving correction after ALS; epc_iter_max, epc_tol: its iterations and
            its stop (relative change of the sensitivity).
        calib: optional calibration tokens (..., F) or :class:`Whitening` for the activation-aware
            variant (decompose the whitened tensor, map A and B back).
        impl: "fast" (:mod:`.cp_fast`) or "reference" (:mod:`.cp_reference`, the plain loops): the
            same iterations, the fast path in fewer operations.
    Returns:
        :class:`CPResult` with factors in the dtype of Y (computation in float64).
    """
    check_tensor_like(Y)
    check_int(rank, "rank", 1)
    check_choice(init, "init", ("svd", "random"))
    check_choice(impl, "impl", _IMPLS)
    als = _IMPLS[impl][0]
    Y64 = as_float64(Y)
    wh, Yw = _whiten(Y64, calib)
    factors, als_rel, it = als(Yw, rank, n_iter_max=n_iter_max, tol=tol, init=init, seed=seed)
    ss = cp_sensitivity(factors)
    result = _result(factors, wh, Y.dtype, als_rel, als_rel, ss, ss, it, False)
    if epc and als_rel > 0:
        result = _correct(Yw, factors, result, wh, epc_iter_max, epc_tol, impl)
    return result


def correct_cp(Y: TensorLike, als: CPResult, *, n_iter_max: int = 50, tol: float = 1e-6,
              calib: Optional[Union[torch.Tensor, Whitening]] = None, impl: str = "fast") -> CPResult:
    """The CPD-EPC correction of an ALS result ``als = cp(Y, R, epc=False, ...)`` (same ``Y`` and
    ``calib``): ``cp(Y, R, epc=True, ...)`` in two steps, for callers that use both CP models."""
    check_tensor_like(Y)
    check_choice(impl, "impl", _IMPLS)
    if not isinstance(als, CPResult) or als.epc:
        raise ValueError("als must be a CPResult of cp(..., epc=False)")
    Y64 = as_float64(Y)
    wh, Yw = _whiten(Y64, calib)
    A, B, C = (f.to(torch.float64) for f in (als.A, als.B, als.C))
    if wh is not None:
        A, B = wh.whiten_q(A), wh.whiten_k(B)
    if als.rel_error <= 0:
        return als
    return _correct(Yw, [A, B, C], als, wh, n_iter_max, tol, impl)


def _whiten(Y64, calib):
    """(Whitening or None, the tensor to decompose) for the optional calibration."""
    if calib is None:
        return None, Y64
    wh = calib if isinstance(calib, Whitening) else Whitening.from_calibration(calib, Y64.shape)
    return wh, wh.apply(Y64)


def _correct(Yw, factors, als: CPResult, wh, n_iter_max: int, tol: float, impl: str) -> CPResult:
    """Apply the EPC to the (whitened) ALS factors at the ALS error; the result in the caller's dtype."""
    normY2 = float(norm_sq(Yw))
    delta = als.als_rel_error * math.sqrt(normY2)
    factors = _IMPLS[impl][1](Yw, factors, delta, n_iter_max=n_iter_max, tol=tol)
    rel = math.sqrt(max(_error_sq(Yw, factors, normY2), 0.0) / normY2)
    return _result(factors, wh, als.A.dtype, rel, als.als_rel_error, cp_sensitivity(factors), als.als_sensitivity,
                   als.n_iter, True)


def _result(factors, wh, dtype, rel, als_rel, ss, als_ss, n_iter, epc) -> CPResult:
    A, B, C = factors
    if wh is not None:
        A, B = wh.unwhiten_q(A), wh.unwhiten_k(B)
    return CPResult(A.to(dtype), B.to(dtype), C.to(dtype), rel, als_rel, ss, als_ss, n_iter, epc)
