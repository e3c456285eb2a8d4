"""TruncAtt: per-head truncated SVD of the query-key (or value-output) tensor (IrrAtt paper, Sec. 2.3).

``Y[:, :, h] ~= A_h B_h^T`` with ``A_h`` (I x r_h) and ``B_h`` (J x r_h). Equal ranks give the paper's
TruncAtt; per-head ranks give IrrAtt with identity head fusion (Sec. 3.1, Eq. 6).

From thin factors ``Y_h = P_h K_h^T`` (I x p, J x p) the SVD is computed without forming Y_h:
``P_h = Q_p R_p``, ``K_h = Q_k R_k`` (thin QR), SVD of the small core ``R_p R_k^T = U S V^T``, so
``Y_h = (Q_p U) S (Q_k V)^T``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .._checks import check_int
from ._tensor import HeadFactors, TensorLike, as_float64, check_tensor_like, head_slice, norm_sq
from .ranks import normalize_ranks
from .whitening import Whitening

__all__ = ["TruncAttResult", "truncatt", "head_spectra", "allocate_ranks_spectral"]


@dataclass
class TruncAttResult:
    """Per-head low-rank factors ``Y[:, :, h] ~= A[h] @ B[h].T``.

    Attributes:
        A: list of H tensors (I, r_h); B: list of H tensors (J, r_h) (singular values split as
            sqrt between the two sides).
        ranks: (r_1, ..., r_H).
        singular_values: list of H tensors, the full spectrum of each (whitened) slice.
        rel_error: ||Y - Yhat||_F / ||Y||_F (in the whitened metric when calibrated: the relative
            error of the attention logits on the calibration batch).
    """

    A: List[torch.Tensor]
    B: List[torch.Tensor]
    ranks: Tuple[int, ...]
    singular_values: List[torch.Tensor] = field(repr=False)
    rel_error: float

    def to_tensor(self) -> torch.Tensor:
        """The approximation (I, J, H)."""
        return torch.stack([a @ b.T for a, b in zip(self.A, self.B)], dim=-1)


def _slice_svd(Y: TensorLike, h: int):
    """Thin SVD (U, s, V) of Y[:, :, h], from factors via QR when available."""
    if isinstance(Y, HeadFactors):
        qp, rp = torch.linalg.qr(Y.P[h])
        qk, rk = torch.linalg.qr(Y.K[h])
        u, s, vh = torch.linalg.svd(rp @ rk.T)
        return qp @ u, s, qk @ vh.T
    u, s, vh = torch.linalg.svd(head_slice(Y, h), full_matrices=False)
    return u, s, vh.T


def head_spectra(Y: TensorLike, calib: Optional[Union[torch.Tensor, Whitening]] = None) -> List[torch.Tensor]:
    """Singular values of each head slice (of the whitened tensor when ``calib`` is given)."""
    check_tensor_like(Y)
    Y64 = as_float64(Y)
    if calib is not None:
        Y64 = _whitening(calib, Y64).apply(Y64)
    return [_slice_svd(Y64, h)[1] for h in range(Y64.shape[2])]


def allocate_ranks_spectral(spectra: Sequence[torch.Tensor], total_rank: int,
                            max_rank: Optional[int] = None, start: Optional[Sequence[int]] = None) -> Tuple[int, ...]:
    """Per-head ranks summing to ``total_rank`` that keep the globally largest singular values.

    For identity head fusion (IrrAtt = TruncAtt with irregular ranks) this allocation minimises
    ``sum_h ||Y_h - Yhat_h||_F^2`` over all rank splits with the given total (Eckart-Young per head),
    so it is never worse than equal ranks of the same total.

    ``start``: ranks already given to the heads (e.g. Algorithm 1's counts capped at ``max_rank``);
    the remaining ``total_rank - sum(start)`` units then go one by one to the head with the
    largest next gain ``s_h[r_h]^2`` (the error drop of one more rank for that head), i.e. the
    next-largest singular values not kept yet.
    """
    check_int(total_rank, "total_rank", 1)
    caps = [len(s) if max_rank is None else min(len(s), max_rank) for s in spectra]
    if total_rank > sum(caps):
        raise ValueError(f"total_rank {total_rank} exceeds the available rank {sum(caps)}")
    start = [0] * len(spectra) if start is None else [int(r) for r in start]
    if len(start) != len(spectra) or any(not 0 <= r <= c for r, c in zip(start, caps)):
        raise ValueError(f"start must hold one rank per head within the caps {caps}, got {start}")
    extra = total_rank - sum(start)
    if extra < 0:
        raise ValueError(f"start ranks {start} already exceed total_rank {total_rank}")
    vals, heads = [], []
    for h, s in enumerate(spectra):
        vals.append(s[start[h]: caps[h]].to(torch.float64).cpu())
        heads.append(torch.full((caps[h] - start[h],), h, dtype=torch.long))
    vals_t, heads_t = torch.cat(vals), torch.cat(heads)
    # stable sort: ties go to the lower head index, deterministic
    order = torch.sort(-vals_t, stable=True).indices[:extra]
    counts = torch.bincount(heads_t[order], minlength=len(spectra))
    return tuple(r + int(c) for r, c in zip(start, counts))


def _whitening(calib, Y) -> Whitening:
    if isinstance(calib, Whitening):
        return calib
    return Whitening.from_calibration(calib, Y.shape)


def truncatt(Y: TensorLike, ranks: Union[int, Sequence[int]], *,
             calib: Optional[Union[torch.Tensor, Whitening]] = None) -> TruncAttResult:
    """Per-head truncated SVD ``Y[:, :, h] ~= A_h B_h^T`` of rank ``ranks[h]`` (IrrAtt paper, Sec. 2.3).

    Args:
        Y: (I, J, H) tensor or :class:`HeadFactors` (then no slice is formed: QR + p x p SVD).
        ranks: one int (equal ranks, TruncAtt) or H ints (irregular; 0 allowed for a head).
        calib: optional calibration tokens (..., F) or a :class:`Whitening`: the activation-aware
            variant, minimising the logits error ``||X~ (Y_h - Yhat_h) X^T||`` on the batch.
    Returns:
        :class:`TruncAttResult` in the dtype of ``Y`` (computed in float64).
    """
    check_tensor_like(Y)
    I, J, H = Y.shape
    p_max = Y.P.shape[2] if isinstance(Y, HeadFactors) else min(I, J)
    p_max = min(p_max, I, J)
    ranks = normalize_ranks(ranks, H, p_max)
    Y64 = as_float64(Y)
    wh = _whitening(calib, Y64) if calib is not None else None
    Yw = wh.apply(Y64) if wh is not None else Y64
    A, B, spectra = [], [], []
    dropped = 0.0
    for h in range(H):
        u, s, v = _slice_svd(Yw, h)
        r = ranks[h]
        root = s[:r].sqrt()
        a, b = u[:, :r] * root, v[:, :r] * root
        if wh is not None:
            a, b = wh.unwhiten_q(a), wh.unwhiten_k(b)
        A.append(a.to(Y.dtype))
        B.append(b.to(Y.dtype))
        spectra.append(s)
        dropped += float((s[r:] ** 2).sum())  # the thin SVD holds the whole spectrum of the slice
    total = float(norm_sq(Yw))
    rel = (dropped / total) ** 0.5 if total > 0 else 0.0
    return TruncAttResult(A, B, ranks, spectra, rel)
