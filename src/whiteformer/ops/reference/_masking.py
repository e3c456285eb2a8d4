"""How the references honour a padding mask and packed documents: by definition, each sequence's
real tokens (each document of a packed row) are run alone and padded positions get 0."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch


def per_sequence(
    fn: Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]],
    x: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``fn`` maps (1, H, n, p) tokens to (out (1, H, n, p), pi (1, H, n)); applied to x (B, H, N, p)
    one sequence at a time on its real tokens (``attn_mask`` (B, N), True = real), zeros elsewhere."""
    if attn_mask is None:
        return fn(x)
    out, pi = torch.zeros_like(x), x.new_zeros(x.shape[:3])
    for b in range(x.shape[0]):
        keep = attn_mask[b]
        if not bool(keep.any()):
            continue
        o, p = fn(x[b : b + 1, :, keep])
        out[b, :, keep] = o[0]
        pi[b, :, keep] = p[0]
    return out, pi


def per_segment(
    fn: Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]],
    x: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``fn`` as in :func:`per_sequence`, applied to each packed document of x (1, H, total, p)
    alone (document s: tokens ``cu_seqlens[s]:cu_seqlens[s + 1]``), the results concatenated."""
    if cu_seqlens is None:
        return fn(x)
    bounds = cu_seqlens.tolist()
    pieces = [fn(x[:, :, a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
    return torch.cat([o for o, _ in pieces], dim=2), torch.cat([p for _, p in pieces], dim=2)
