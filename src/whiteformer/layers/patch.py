"""Geometry of a non-overlapping patch grid (ViT, CRATE patch embeddings)."""
from __future__ import annotations

import torch
import torch.nn as nn

from .._checks import check_tensor, is_int
from .helpers import to_2tuple

__all__ = ["PatchGrid"]


class PatchGrid(nn.Module):
    """Geometry and input check shared by the non-overlapping patch embeddings (ViT, CRATE):
    ``img_size`` divisible by ``patch_size``; ``grid_size``, ``num_patches``."""

    def __init__(self, img_size=224, patch_size=16, in_chans: int = 3):
        super().__init__()
        self.img_size = to_2tuple(img_size, "img_size")
        self.patch_size = to_2tuple(patch_size, "patch_size")
        if self.img_size[0] % self.patch_size[0] or self.img_size[1] % self.patch_size[1]:
            raise ValueError(f"img_size {self.img_size} must be divisible by patch_size {self.patch_size}")
        if not is_int(in_chans) or in_chans <= 0:
            raise ValueError(f"in_chans must be a positive int, got {in_chans!r}")
        self.in_chans = in_chans
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]

    def check_images(self, x: torch.Tensor) -> None:
        """x must be (B, in_chans, *img_size) with B > 0."""
        check_tensor(x, "x", 4)
        if x.shape[0] == 0:
            raise ValueError(f"x must be a non-empty image batch, got shape {tuple(x.shape)}")
        if x.shape[1] != self.in_chans or tuple(x.shape[2:]) != self.img_size:
            raise ValueError(f"x must have shape (B, {self.in_chans}, {self.img_size[0]}, {self.img_size[1]}), "
                             f"got {tuple(x.shape)}")
