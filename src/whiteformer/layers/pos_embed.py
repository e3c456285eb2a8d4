"""Position embeddings (as timm's ``layers/pos_embed.py``): resampling of learned absolute position
embeddings to another patch grid (used when a checkpoint's grid differs from the model's), and
XCiT's :class:`FourierPositionalEncoding` of the ToST vision shell (any resolution)."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import check_tensor

__all__ = ["resample_abs_pos_embed", "FourierPositionalEncoding"]


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


class FourierPositionalEncoding(nn.Module):
    """Sinusoidal 2-d position encoding of XCiT (from DETR), projected by a 1x1 conv.

    For a grid of ``H x W`` patches, the normalised coordinates ``y = i / (H + 1e-6) * scale``,
    ``x = j / (W + 1e-6) * scale`` (i, j = 1..H, 1..W; scale = 2 pi) are divided by
    ``temperature ** (2 floor(k/2) / hidden_dim)``, k < hidden_dim, and encoded as
    ``[sin, cos, sin, cos, ...]`` (even k sin, odd k cos) per axis; the ``2 * hidden_dim`` features
    ``[enc(y), enc(x)]`` are mapped to ``dim`` by ``token_projection`` (Conv2d 1x1 with bias).
    The encoding is computed for any grid, so the model works at any resolution. The features are
    computed in float32 (float64 for a float64 model), as the official code.

    ``forward(batch, height, width)`` -> (batch, height*width, dim), row-major over the grid.
    """

    def __init__(self, hidden_dim: int = 32, dim: int = 768, temperature: float = 10000.0):
        super().__init__()
        self.token_projection = nn.Conv2d(hidden_dim * 2, dim, kernel_size=1)
        self.scale = 2 * math.pi
        self.temperature = temperature
        self.hidden_dim = hidden_dim
        self.dim = dim

    def features(self, height: int, width: int, device=None, dtype=torch.float32) -> torch.Tensor:
        """Raw sinusoidal features (1, 2*hidden_dim, height, width) before the projection."""
        eps = 1e-6
        y = torch.arange(1, height + 1, device=device, dtype=dtype)[:, None].expand(height, width)
        x = torch.arange(1, width + 1, device=device, dtype=dtype)[None, :].expand(height, width)
        y = y / (height + eps) * self.scale
        x = x / (width + eps) * self.scale
        k = torch.arange(self.hidden_dim, device=device, dtype=dtype)
        freq = self.temperature ** (2 * (k // 2) / self.hidden_dim)

        def enc(c: torch.Tensor) -> torch.Tensor:
            c = c[:, :, None] / freq  # (H, W, hidden)
            return torch.stack((c[:, :, 0::2].sin(), c[:, :, 1::2].cos()), dim=3).flatten(2)

        return torch.cat((enc(y), enc(x)), dim=2).unsqueeze(0).permute(0, 3, 1, 2)

    def forward(self, batch: int, height: int, width: int) -> torch.Tensor:
        w = self.token_projection.weight
        dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
        feats = self.features(height, width, device=w.device, dtype=dtype).to(w.dtype)
        pos = self.token_projection(feats)  # (1, dim, H, W)
        return pos.flatten(2).transpose(1, 2).expand(batch, -1, -1)

    def extra_repr(self) -> str:
        return f"hidden_dim={self.hidden_dim}, dim={self.dim}, temperature={self.temperature}"
