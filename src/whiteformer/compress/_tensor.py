"""Third-order weight tensors Y (I x J x H), dense or given by per-head thin factors.

The decompositions only touch Y through a few contractions (norm, MTTKRP, mode Grams, per-head
slices), which are computed here either from a dense tensor or from the thin factors
``Y[:, :, h] = P[h] @ K[h].T`` without forming Y (for DeiT-B, F = 768, H = 12, p = 64, the factors
hold 1.2M numbers, the dense tensor 7.1M).

All routines work in float64 (the callers convert with :func:`as_float64`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple, Union

import torch

from .._checks import check_instance

__all__ = ["HeadFactors", "TensorLike", "check_tensor_like", "as_float64", "tensor_shape", "to_dense",
           "norm_sq", "mttkrp", "unfolding_gram", "head_slice", "StackedSlices"]


@dataclass
class HeadFactors:
    """A tensor ``Y`` of shape (I, J, H) given by thin per-head factors.

    ``Y[:, :, h] = P[h] @ K[h].T`` with ``P`` of shape (H, I, p) and ``K`` of shape (H, J, p).
    For attention, ``P[h] = W_h^Q`` (F x p, the query map x -> x @ W_h^Q) and ``K[h] = W_h^K``,
    so that ``Y[:, :, h] = W_h^Q (W_h^K)^T`` is the query-key form of the IrrAtt paper, Sec. 2.3.
    A plain container: the decompositions that take it check it (:func:`check_tensor_like`).
    """

    P: torch.Tensor
    K: torch.Tensor

    @property
    def shape(self) -> Tuple[int, int, int]:
        return (self.P.shape[1], self.K.shape[1], self.P.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.P.dtype

    @property
    def device(self) -> torch.device:
        return self.P.device

    def to_tensor(self) -> torch.Tensor:
        """The dense tensor (I, J, H)."""
        return torch.einsum("hip,hjp->ijh", self.P, self.K)

    def to(self, *args, **kwargs) -> "HeadFactors":
        return HeadFactors(self.P.to(*args, **kwargs), self.K.to(*args, **kwargs))


TensorLike = Union[torch.Tensor, HeadFactors]


def check_tensor_like(Y, name: str = "Y") -> None:
    """Raise unless ``Y`` is a floating 3-D tensor (I, J, H) or a :class:`HeadFactors` of floating
    3-D tensors P (H, I, p) and K (H, J, p), non-empty and finite (the input check of the
    decompositions, which are the doors for user-built tensors and factors)."""
    factors = isinstance(Y, HeadFactors)
    if not factors:
        check_instance(Y, name, torch.Tensor, "a torch.Tensor (I, J, H) or HeadFactors")
    parts = ((("HeadFactors.P", Y.P, "(H, I, p)"), ("HeadFactors.K", Y.K, "(H, J, p)")) if factors
             else ((name, Y, "(I, J, H)"),))
    for part, t, layout in parts:
        got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{part} must be a 3-D tensor {layout}, got {got}")
        if not t.is_floating_point():
            raise TypeError(f"{part} must be a floating tensor, got {t.dtype}")
    if factors and (Y.P.shape[0] != Y.K.shape[0] or Y.P.shape[2] != Y.K.shape[2]):
        raise ValueError(f"HeadFactors: P {tuple(Y.P.shape)} and K {tuple(Y.K.shape)} must agree "
                         "in the number of heads (dim 0) and the head dim p (dim 2)")
    if min(Y.shape) == 0:
        raise ValueError(f"{name} must be non-empty, got shape {tuple(Y.shape)}")
    if not all(bool(torch.isfinite(t).all()) for _, t, _ in parts):
        raise ValueError(f"{name} contains NaN or inf")


def as_float64(Y: TensorLike) -> TensorLike:
    return Y.to(torch.float64)


def tensor_shape(Y: TensorLike) -> Tuple[int, int, int]:
    return tuple(Y.shape)  # type: ignore[return-value]


def to_dense(Y: TensorLike) -> torch.Tensor:
    return Y.to_tensor() if isinstance(Y, HeadFactors) else Y


def norm_sq(Y: TensorLike) -> torch.Tensor:
    """||Y||_F^2; from factors: sum_h <P_h^T P_h, K_h^T K_h>."""
    if isinstance(Y, HeadFactors):
        gp = Y.P.transpose(1, 2) @ Y.P
        gk = Y.K.transpose(1, 2) @ Y.K
        return (gp * gk).sum()
    return (Y * Y).sum()


def mttkrp(Y: TensorLike, factors: Sequence[torch.Tensor], mode: int) -> torch.Tensor:
    """Matricised tensor times Khatri-Rao product for mode ``mode`` of a CP model [A, B, C].

    mode 0: M[i, r] = sum_jh Y[i,j,h] B[j,r] C[h,r]; mode 1: M[j, r] = sum_ih Y A C;
    mode 2: M[h, r] = sum_ij Y[i,j,h] A[i,r] B[j,r]. From factors the cost is O(H (I + J) p R).
    """
    A, B, C = factors
    if isinstance(Y, HeadFactors):
        if mode == 0:
            kb = Y.K.transpose(1, 2) @ B  # (H, p, R)
            return torch.einsum("hip,hpr,hr->ir", Y.P, kb, C)
        if mode == 1:
            pa = Y.P.transpose(1, 2) @ A
            return torch.einsum("hjp,hpr,hr->jr", Y.K, pa, C)
        pa = Y.P.transpose(1, 2) @ A
        kb = Y.K.transpose(1, 2) @ B
        return (pa * kb).sum(1)
    if mode == 0:
        return torch.einsum("ijh,jr,hr->ir", Y, B, C)
    if mode == 1:
        return torch.einsum("ijh,ir,hr->jr", Y, A, C)
    return torch.einsum("ijh,ir,jr->hr", Y, A, B)


def unfolding_gram(Y: TensorLike, mode: int) -> torch.Tensor:
    """Y_(n) Y_(n)^T for mode n: (I x I), (J x J) or (H x H), computed from factors when given."""
    if isinstance(Y, HeadFactors):
        if mode == 0:
            return torch.einsum("hip,hpq,hkq->ik", Y.P, Y.K.transpose(1, 2) @ Y.K, Y.P)
        if mode == 1:
            return torch.einsum("hjp,hpq,hkq->jk", Y.K, Y.P.transpose(1, 2) @ Y.P, Y.K)
        gp = torch.einsum("hip,giq->hgpq", Y.P, Y.P)
        gk = torch.einsum("hjp,gjq->hgpq", Y.K, Y.K)
        return (gp * gk).sum((2, 3))
    if mode == 0:
        return torch.einsum("ijh,kjh->ik", Y, Y)
    if mode == 1:
        return torch.einsum("ijh,ikh->jk", Y, Y)
    return torch.einsum("ijh,ijg->hg", Y, Y)


def head_slice(Y: TensorLike, h: int) -> torch.Tensor:
    """The dense slice Y[:, :, h] (I x J)."""
    if isinstance(Y, HeadFactors):
        return Y.P[h] @ Y.K[h].T
    return Y[:, :, h]


class StackedSlices:
    """The contractions of one ALS sweep with all heads stacked, so that each is one GEMM.

    Every slice is written ``Y[:, :, h] = P_h K_h^T``: thin factors (P_h (I x p), K_h (J x p)) for
    :class:`HeadFactors`, ``P_h = Y[:, :, h]`` and ``K_h = I_J`` for a dense tensor. For CP factors
    A (I x R), B (J x R), C (H x R) the three MTTKRPs of :func:`mttkrp` are then

        mode 0: sum_h P_h ((K_h^T B) * c_h),  mode 1: sum_h K_h ((P_h^T A) * c_h),
        mode 2: [h, r] -> sum_p (P_h^T A)[p, r] (K_h^T B)[p, r],

    and the projections ``P^T A``, ``K^T B`` (H, p, R) are shared between the modes of a sweep.
    """

    def __init__(self, Y: TensorLike):
        if isinstance(Y, HeadFactors):
            H, I, p = Y.P.shape
            J = Y.K.shape[1]
            self.dense = None
            self.Pf = Y.P.permute(1, 0, 2).reshape(I, H * p)  # (I, H p): [P_1, ..., P_H]
            self.Kf = Y.K.permute(1, 0, 2).reshape(J, H * p)
        else:
            H = Y.shape[2]
            self.dense = Y.permute(2, 0, 1).contiguous()  # (H, I, J)
        self.H = H

    def project_p(self, A: torch.Tensor) -> torch.Tensor:
        """P_h^T A for every head: (H, p, R)."""
        if self.dense is not None:
            return self.dense.transpose(1, 2) @ A
        return (self.Pf.T @ A).reshape(self.H, -1, A.shape[1])

    def project_k(self, B: torch.Tensor) -> torch.Tensor:
        """K_h^T B for every head: (H, p, R) (B itself, broadcast, for a dense tensor)."""
        if self.dense is not None:
            return B.expand(self.H, *B.shape)
        return (self.Kf.T @ B).reshape(self.H, -1, B.shape[1])

    def mttkrp0(self, KB: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
        """sum_h P_h ((K_h^T B) * c_h): (I, R)."""
        W = KB * C[:, None, :]
        if self.dense is not None:
            return (self.dense @ W).sum(0)
        return self.Pf @ W.reshape(-1, W.shape[2])

    def mttkrp1(self, PA: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
        """sum_h K_h ((P_h^T A) * c_h): (J, R)."""
        W = PA * C[:, None, :]
        if self.dense is not None:
            return W.sum(0)
        return self.Kf @ W.reshape(-1, W.shape[2])

    @staticmethod
    def mttkrp2(PA: torch.Tensor, KB: torch.Tensor) -> torch.Tensor:
        """sum_p (P_h^T A)[p, r] (K_h^T B)[p, r]: (H, R)."""
        return (PA * KB).sum(1)
