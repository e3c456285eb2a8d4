"""Activation-aware decomposition by whitening with calibration statistics.

For calibration tokens X (n x F) the attention logits of head h are ``X~ Y_h X^T`` (``X~ = [X, 1]``
when Y carries the query-bias row, see :func:`whiteformer.compress.qk_factors`). With the
second-moment matrices ``S_q = X~^T X~ / n = L_q L_q^T`` and ``S_k = X^T X / n = L_k L_k^T``
(Cholesky factors),

    ||X~ (Y_h - Yhat_h) X^T||_F = n ||L_q^T (Y_h - Yhat_h) L_k||_F,

so a decomposition of the whitened tensor ``L_q^T Y_h L_k`` minimises the error on the logits over the
calibration batch (rather than on Y itself); its factors are mapped back by ``A = L_q^{-T} A_w``,
``B = L_k^{-T} B_w``. Same idea as SVD-LLM / activation-aware SVD; for VO and linear layers only the
input side is whitened (``L_k = I``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .._checks import check_finite, check_tensor
from ._tensor import HeadFactors, TensorLike

__all__ = ["Whitening", "second_moment", "whitening_factor"]


def second_moment(x: torch.Tensor, augment: bool = False) -> torch.Tensor:
    """Uncentred second moment ``X^T X / n`` (float64) of the tokens ``x`` (..., F); with
    ``augment`` the tokens get a trailing constant 1 (the result is (F+1) x (F+1))."""
    check_tensor(x, "calib")
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"calib must be a non-empty tensor of tokens (..., F), got shape {tuple(x.shape)}")
    check_finite(x, "calib")  # a NaN would only surface as a Cholesky failure
    flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
    if augment:
        flat = torch.cat([flat, flat.new_ones(flat.shape[0], 1)], dim=1)
    return flat.T @ flat / flat.shape[0]


def whitening_factor(sigma: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Lower Cholesky factor L of ``sigma + eps * mean(diag(sigma)) * I`` (the ridge keeps L
    invertible when the calibration batch is rank deficient)."""
    d = sigma.shape[0]
    ridge = eps * float(sigma.diagonal().mean().clamp_min(1e-30))
    eye = torch.eye(d, dtype=sigma.dtype, device=sigma.device)
    return torch.linalg.cholesky(sigma + ridge * eye)


@dataclass
class Whitening:
    """Whitening of the two feature modes of a tensor (I x J x H): ``Y_h -> Lq^T Y_h Lk``.

    ``Lq`` (I x I) and ``Lk`` (J x J) are lower triangular; ``None`` means identity.
    """

    Lq: Optional[torch.Tensor]
    Lk: Optional[torch.Tensor]

    @classmethod
    def from_calibration(cls, calib: torch.Tensor, shape, *, eps: float = 1e-6, query: bool = True,
                         key: bool = True) -> "Whitening":
        """Build from calibration tokens ``calib`` (..., F) for a tensor of ``shape`` (I, J, H).

        I must be F or F + 1 (query side with the constant-1 bias row); J must be F.
        ``query``/``key`` select which modes are whitened.
        """
        # one pass over the tokens (which second_moment checks): [[X^T X, X^T 1], [1^T X, n]] / n
        sigma = second_moment(calib, augment=True)
        f = calib.shape[-1]
        i, j = shape[0], shape[1]
        if i not in (f, f + 1) or (key and j != f):
            raise ValueError(f"calib has feature size {f}, which does not fit a tensor of shape {tuple(shape)} "
                             "(expected I in {F, F+1} and J = F)")
        lq = whitening_factor(sigma if i == f + 1 else sigma[:f, :f], eps) if query else None
        lk = whitening_factor(sigma[:f, :f], eps) if key else None
        return cls(lq, lk)

    def apply(self, Y: TensorLike) -> TensorLike:
        """The whitened tensor ``Lq^T Y_h Lk`` (factors stay factors)."""
        if isinstance(Y, HeadFactors):
            P = Y.P if self.Lq is None else self.Lq.T.to(Y.P) @ Y.P
            K = Y.K if self.Lk is None else self.Lk.T.to(Y.K) @ Y.K
            return HeadFactors(P, K)
        out = Y
        if self.Lq is not None:
            out = torch.einsum("ai,ajh->ijh", self.Lq.to(Y), out)
        if self.Lk is not None:
            out = torch.einsum("iah,aj->ijh", out, self.Lk.to(Y))
        return out

    def unwhiten_q(self, A: torch.Tensor) -> torch.Tensor:
        """Map a whitened query-side factor back: ``Lq^{-T} A`` (A is I x r)."""
        if self.Lq is None:
            return A
        return torch.linalg.solve_triangular(self.Lq.T.to(A), A, upper=True)

    def unwhiten_k(self, B: torch.Tensor) -> torch.Tensor:
        """Map a whitened key-side factor back: ``Lk^{-T} B`` (B is J x r)."""
        if self.Lk is None:
            return B
        return torch.linalg.solve_triangular(self.Lk.T.to(B), B, upper=True)

    def whiten_q(self, A: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`unwhiten_q`: ``Lq^T A``."""
        return A if self.Lq is None else self.Lq.T.to(A) @ A

    def whiten_k(self, B: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`unwhiten_k`: ``Lk^T B``."""
        return B if self.Lk is None else self.Lk.T.to(B) @ B
