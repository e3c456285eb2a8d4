"""Resampling of learned absolute position embeddings to another patch grid (as timm's
``layers/pos_embed.py``), used when a checkpoint's grid differs from the model's."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .._checks import check_tensor

__all__ = ["resample_abs_pos_embed"]


def resample_abs_pos_embed(posemb: torch.Tensor, new_size: Tuple[int, int],
                           old_size: Optional[Tuple[int, int]] = None, num_prefix_tokens: int = 1,
                           interpolation: str = "bicubic", antialias: bool = True) -> torch.Tensor:
    """Resample a (1, prefix + H*W, D) position embedding to the grid ``new_size`` (as timm).

    The prefix (class) tokens are kept; the grid (square ``old_size`` when not given) is
    interpolated in float32 with ``F.interpolate(mode=interpolation, antialias=antialias)``.
    """
    check_tensor(posemb, "posemb", 3)
    n_old = posemb.shape[1] - num_prefix_tokens
    if old_size is None:
        side = int(math.isqrt(max(n_old, 0)))
        if side * side != n_old:
            raise ValueError(f"cannot infer a square grid from a position embedding of {n_old} patch tokens "
                             f"(shape {tuple(posemb.shape)}); pass old_size")
        old_size = (side, side)
    if tuple(old_size) == tuple(new_size):
        return posemb
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
    dim, dtype = posemb.shape[-1], posemb.dtype
    grid = grid.float().reshape(1, old_size[0], old_size[1], dim).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=tuple(new_size), mode=interpolation, antialias=antialias)
    grid = grid.permute(0, 2, 3, 1).reshape(1, -1, dim).to(dtype)
    return torch.cat([prefix, grid], dim=1)
