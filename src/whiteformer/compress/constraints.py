"""Rank-constrained head fusion for fine-tuning CP SlimAtt (IrrAtt paper, Sec. 3.3, Eq. 7).

The fusion matrix S^H (H x R) of each block is constrained to ``S^H >= 0`` and ``S^H S^H^T = I``.
Non-negative rows that are orthonormal have disjoint supports, so every rank-1 term belongs to
exactly one head: the constraint makes S^H block diagonal (after permutation) and reveals the
per-head ranks D_h of IrrAtt. :func:`project_fusion` maps any S^H onto this set (use it after
each optimiser step: projected gradient), :func:`fusion_penalty` is a soft version.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn as nn

from .layers import CPSlimAtt, IrrAtt

__all__ = ["project_fusion", "fusion_penalty", "fusion_head_ranks", "apply_fusion_constraints"]


def _check(S) -> None:
    if not isinstance(S, torch.Tensor) or S.dim() != 2 or not S.is_floating_point():
        raise ValueError(f"the fusion matrix must be a floating 2-D tensor (H, R), got "
                         f"{getattr(S, 'shape', type(S).__name__)}")


def fusion_head_ranks(S: torch.Tensor) -> Tuple[int, ...]:
    """Per-head ranks D_h: the number of columns whose largest entry is in row h."""
    _check(S)
    return tuple(int(c) for c in torch.bincount(S.argmax(0), minlength=S.shape[0]))


@torch.no_grad()
def project_fusion(S: torch.Tensor, *, fewer_columns: bool = False) -> torch.Tensor:
    """Map S^H (H x R) onto {S >= 0, S S^T = I}: each column is assigned to the head of its largest
    entry (a head left without columns takes its best column from a head that has several), keeps
    only that entry clamped to >= 0, and each row is normalised to unit norm (a row whose kept
    entries are all <= 0 becomes uniform on its columns). Returns a new (H, R) tensor.

    With fewer columns than heads (R < H: BTD blocks dropped) the set is empty; ``fewer_columns=True``
    then keeps each column's largest entry (clamped) and normalises the rows, a head left without a
    column getting a zero row (S S^T diagonal with entries 0 or 1); otherwise R < H is a ``ValueError``."""
    _check(S)
    H, R = S.shape
    if R < H:
        if not fewer_columns:
            raise ValueError(f"S^H S^H^T = I needs at least as many columns as heads, got shape {(H, R)}")
        head = S.argmax(0)
        cols = torch.arange(R, device=S.device)
        P = torch.zeros_like(S)
        P[head, cols] = S[head, cols].clamp_min(0)
        n = P.norm(dim=1, keepdim=True)
        return torch.where(n > 0, P / n.clamp_min(torch.finfo(S.dtype).tiny), P)
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


# ----------------------------------------------------------------------------- on a model
def _component_slices(layer) -> List[slice]:
    if isinstance(layer, IrrAtt):
        off = layer.qk_layout.offsets
        return [slice(off[b], off[b + 1]) for b in range(len(off) - 1)]
    return [slice(r, r + 1) for r in range(layer.rank)]


@torch.no_grad()
def _scale_queries(layer, factors: torch.Tensor) -> None:
    """Multiply the query factor of fusion column b by ``factors[b]`` (weight rows and bias)."""
    for b, sl in enumerate(_component_slices(layer)):
        f = factors[b].to(layer.q.weight.dtype)
        layer.q.weight[sl] *= f
        if layer.q.bias is not None:
            layer.q.bias[sl] *= f


@torch.no_grad()
def apply_fusion_constraints(model: nn.Module, absorb_scale: bool = True) -> int:
    """Project every head-fusion matrix of ``model`` (IrrAtt with general fusion, C of shape
    (H, blocks); CP SlimAtt, S^H of shape (H, R)) onto ``{S >= 0, S S^T = I}`` (IrrAtt paper, Sec. 3.3,
    Eq. 7) with :func:`project_fusion`: each column keeps only its head's entry, rows
    get unit norm. Call after each optimizer step (projected gradient). Returns the number of
    matrices projected (0 if the model has none).

    ``absorb_scale`` (default): the logits ``sum_b C[h, b] q_b k_b^T`` are invariant under
    ``C[:, b] -> C[:, b] / s``, ``q_b -> s q_b``, so before projecting each column's largest-magnitude
    entry is made positive (flipping q_b) and afterwards the scale of every kept entry is moved into
    its query factor: the projection then changes the model only by the dropped off-head entries.
    With ``absorb_scale=False`` only the fusion matrices change (plain projection).
    With fewer columns than heads (BTD blocks dropped), heads without a column get a zero row.
    """
    n = 0
    for m in model.modules():
        if not isinstance(m, (IrrAtt, CPSlimAtt)) or m.fusion is None:
            continue
        S = m.fusion.detach().to(torch.float64)
        if absorb_scale:
            cols = torch.arange(S.shape[1], device=S.device)
            sign = torch.sign(S[S.abs().argmax(0), cols])
            sign[sign == 0] = 1
            S = S * sign
            _scale_queries(m, sign)
        P = project_fusion(S, fewer_columns=True)
        if absorb_scale:
            kept = P.argmax(0)
            cols = torch.arange(S.shape[1], device=S.device)
            p, s = P[kept, cols], S[kept, cols]
            ok = (p > 0) & (s.abs() > 1e-12)
            _scale_queries(m, torch.where(ok, s / torch.where(ok, p, torch.ones_like(p)), torch.ones_like(p)))
        m.fusion.copy_(P.to(m.fusion.dtype))
        n += 1
    return n
