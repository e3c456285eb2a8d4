"""Patch embeddings: :class:`ConvPatchEmbed`, XCiT's convolutional stem of the ToST vision shell (the
parameter names of the official ToST state dict, so its checkpoints load directly)."""
from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn as nn

from .._checks import check_tensor, is_int
from .helpers import to_2tuple
from .patch import PatchGrid, pad_to_patches

__all__ = ["ConvPatchEmbed"]


def _conv3x3_bn(in_ch: int, out_ch: int) -> nn.Sequential:
    """conv3x3 (stride 2, padding 1, no bias) + BatchNorm: keys ``0.weight``, ``1.*``."""
    return nn.Sequential(nn.Conv2d(in_ch, out_ch, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(out_ch))


class ConvPatchEmbed(nn.Module):
    """XCiT's convolutional patch embedding: ``log2(patch_size)`` stride-2 conv3x3+BN stages.

    p16 = 4 stages with channels ``in_chans -> D/8 -> D/4 -> D/2 -> D``, GELU between stages
    (none after the last); p8 = 3 stages ``-> D/4 -> D/2 -> D``; p4 = 2; p2 = 1. The module
    names (``proj.{0,2,4,6}.{0,1}``) are those of the official ToST/XCiT code.

    Shapes: images (B, in_chans, H, W) of any size -> tokens (B, Hp*Wp, D) and ``(Hp, Wp)``, with
    ``Hp = ceil(H / patch)`` (each stride-2 stage pads its borders by one pixel).

    timm's flags: ``dynamic_img_size`` is accepted and changes nothing, since this stem already takes
    any size (the Fourier position encoding is computed for each grid); ``dynamic_img_pad`` pads the
    images with zeros at the right and bottom up to multiples of the patch size before the stem, as
    timm's ``PatchEmbed`` (same grid, the padding seen as image content rather than as border).
    """

    SUPPORTED_PATCH_SIZES = (2, 4, 8, 16)

    def __init__(self, img_size=224, patch_size: int = 16, in_chans: int = 3, embed_dim: int = 768,
                 dynamic_img_size: bool = False, dynamic_img_pad: bool = False):
        super().__init__()
        ps = to_2tuple(patch_size, "patch_size")
        if ps[0] != ps[1] or ps[0] not in self.SUPPORTED_PATCH_SIZES:
            raise ValueError(f"patch_size must be one of {self.SUPPORTED_PATCH_SIZES} (square, a power of two: one "
                             f"stride-2 conv per factor 2), got {patch_size!r}")
        patch_size = ps[0]
        stages = int(math.log2(patch_size))
        if not is_int(embed_dim) or embed_dim <= 0 or embed_dim % (2 ** (stages - 1)) != 0:
            raise ValueError(f"embed_dim must be a positive multiple of {2 ** (stages - 1)} for patch_size "
                             f"{patch_size}, got {embed_dim!r}")
        # checks img_size (divisible into patches), in_chans and the flags
        grid = PatchGrid(img_size, ps, in_chans, dynamic_img_size, dynamic_img_pad)
        self.img_size, self.patch_size, self.in_chans = grid.img_size, grid.patch_size, in_chans
        self.grid_size, self.num_patches = grid.grid_size, grid.num_patches
        self.dynamic_img_size, self.dynamic_img_pad = dynamic_img_size, dynamic_img_pad

        chans = [in_chans] + [embed_dim // 2 ** (stages - 1 - i) for i in range(stages)]
        layers = []
        for i in range(stages):
            if i > 0:
                layers.append(nn.GELU())
            layers.append(_conv3x3_bn(chans[i], chans[i + 1]))
        self.proj = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int]]:
        check_tensor(x, "x", 4)
        if x.shape[1] != self.in_chans or 0 in (x.shape[0], x.shape[2], x.shape[3]):
            raise ValueError(f"x must be a non-empty image batch with {self.in_chans} channels "
                             f"(B, {self.in_chans}, H, W), got shape {tuple(x.shape)}")
        if self.dynamic_img_pad:
            x = pad_to_patches(x, self.patch_size)
        x = self.proj(x)
        hp, wp = x.shape[2], x.shape[3]
        return x.flatten(2).transpose(1, 2), (hp, wp)
