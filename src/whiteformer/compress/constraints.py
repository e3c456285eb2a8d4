"""Rank-constrained head fusion for fine-tuning CP SlimAtt (paper 004, Sec. 3.3, Eq. 7).

The fusion matrix S^H (H x R) of each block is constrained to ``S^H >= 0`` and ``S^H S^H^T = I``.
Non-negative rows that are orthonormal have disjoint supports, so every rank-1 term belongs to
exactly one head: the constraint makes S^H block diagonal (after permutation) and reveals the
per-head ranks D_h of IrrAtt. :func:`project_fusion` maps any S^H onto this set (use it after
each optimiser step: projected gradient), :func:`fusion_penalty` is a soft version.
"""
from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["project_fusion", "fusion_penalty", "fusion_head_ranks"]


def _check(S) -> None:
    if not isinstance(S, torch.Tensor) or S.dim() != 2 or not S.is_floating_point():
        raise ValueError(f"the fusion matrix must be a floating 2-D tensor (H, R), got "
                         f"{getattr(S, 'shape', type(S).__name__)}")


def fusion_head_ranks(S: torch.Tensor) -> Tuple[int, ...]:
    """Per-head ranks D_h: the number of columns whose largest entry is in row h."""
    _check(S)
    return tuple(int(c) for c in torch.bincount(S.argmax(0), minlength=S.shape[0]))


@torch.no_grad()
def project_fusion(S: torch.Tensor) -> torch.Tensor:
    """Map S^H (H x R) onto {S >= 0, S S^T = I}: each column is assigned to the head of its largest
    entry (a head left without columns takes its best column from a head that has several), keeps
    only that entry clamped to >= 0, and each row is normalised to unit norm (a row whose kept
    entries are all <= 0 becomes uniform on its columns). Returns a new (H, R) tensor."""
    _check(S)
    H, R = S.shape
    if R < H:
        raise ValueError(f"S^H S^H^T = I needs at least as many columns as heads, got shape {(H, R)}")
    head = S.argmax(0).tolist()
    counts = [head.count(h) for h in range(H)]
    for h in range(H):
        if counts[h] == 0:
            cand = [j for j in range(R) if counts[head[j]] > 1]
            j = max(cand, key=lambda c: float(S[h, c]))
            counts[head[j]] -= 1
            head[j], counts[h] = h, 1
    idx = torch.tensor(head, device=S.device)
    cols = torch.arange(R, device=S.device)
    P = torch.zeros_like(S)
    P[idx, cols] = S[idx, cols].clamp_min(0)
    for h in range(H):
        n = P[h].norm()
        if n > 0:
            P[h] /= n
        else:
            mine = idx == h
            P[h, mine] = mine.sum().to(S.dtype).rsqrt()
    return P


def fusion_penalty(S: torch.Tensor) -> torch.Tensor:
    """Soft constraint ``||min(S, 0)||^2 + ||S S^T - I||^2`` (differentiable)."""
    _check(S)
    eye = torch.eye(S.shape[0], dtype=S.dtype, device=S.device)
    return S.clamp_max(0).pow(2).sum() + (S @ S.T - eye).pow(2).sum()
