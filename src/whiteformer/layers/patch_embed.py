"""Patch embeddings: :class:`ConvPatchEmbed`, XCiT's convolutional stem of the ToST vision shell (the
parameter names of the official ToST state dict, so its checkpoints load directly)."""
from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn as nn

from .._checks import check_tensor
from .helpers import to_2tuple

__all__ = ["ConvPatchEmbed"]


def _conv3x3_bn(in_ch: int, out_ch: int) -> nn.Sequential:
    """conv3x3 (stride 2, padding 1, no bias) + BatchNorm: keys ``0.weight``, ``1.*``."""
    return nn.Sequential(nn.Conv2d(in_ch, out_ch, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(out_ch))


class ConvPatchEmbed(nn.Module):
    """XCiT's convolutional patch embedding: ``log2(patch_size)`` stride-2 conv3x3+BN stages.

    p16 = 4 stages with channels ``in_chans -> D/8 -> D/4 -> D/2 -> D``, GELU between stages
    (none after the last); p8 = 3 stages ``-> D/4 -> D/2 -> D``; p4 = 2; p2 = 1. The module
    names (``proj.{0,2,4,6}.{0,1}``) are those of the official ToST/XCiT code.

    Shapes: images (B, in_chans, H, W) -> tokens (B, Hp*Wp, D) and ``(Hp, Wp)``, with
    ``Hp = ceil(H / patch)`` (= H / patch for the divisible sizes checked at construction).
    """

    SUPPORTED_PATCH_SIZES = (2, 4, 8, 16)

    def __init__(self, img_size=224, patch_size: int = 16, in_chans: int = 3, embed_dim: int = 768):
        super().__init__()
        if isinstance(patch_size, (tuple, list)):
            ps = to_2tuple(patch_size, "patch_size")
            if ps[0] != ps[1]:
                raise ValueError(f"patch_size must be square for the conv patch embedding, got {patch_size!r}")
            patch_size = ps[0]
        if patch_size not in self.SUPPORTED_PATCH_SIZES:
            raise ValueError(
                f"patch_size must be one of {self.SUPPORTED_PATCH_SIZES} (a power of two: one stride-2 conv "
                f"per factor 2), got {patch_size!r}"
            )
        if not isinstance(in_chans, int) or in_chans <= 0:
            raise ValueError(f"in_chans must be a positive int, got {in_chans!r}")
        stages = int(math.log2(patch_size))
        if not isinstance(embed_dim, int) or embed_dim <= 0 or embed_dim % (2 ** (stages - 1)) != 0:
            raise ValueError(
                f"embed_dim must be a positive multiple of {2 ** (stages - 1)} for patch_size {patch_size}, "
                f"got {embed_dim!r}"
            )
        img = to_2tuple(img_size, "img_size")
        if img[0] % patch_size or img[1] % patch_size:
            raise ValueError(f"img_size {img} must be divisible by patch_size {patch_size}")
        self.img_size = img
        self.patch_size = (patch_size, patch_size)
        self.grid_size = (img[0] // patch_size, img[1] // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.in_chans = in_chans

        chans = [in_chans] + [embed_dim // 2 ** (stages - 1 - i) for i in range(stages)]
        layers = []
        for i in range(stages):
            if i > 0:
                layers.append(nn.GELU())
            layers.append(_conv3x3_bn(chans[i], chans[i + 1]))
        self.proj = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int]]:
        check_tensor(x, "x", 4)
        if x.shape[1] != self.in_chans:
            raise ValueError(
                f"x must have {self.in_chans} channels (B, {self.in_chans}, H, W), got shape {tuple(x.shape)}"
            )
        if x.shape[0] == 0 or x.shape[2] == 0 or x.shape[3] == 0:
            raise ValueError(f"x must be a non-empty image batch, got shape {tuple(x.shape)}")
        x = self.proj(x)
        hp, wp = x.shape[2], x.shape[3]
        return x.flatten(2).transpose(1, 2), (hp, wp)
