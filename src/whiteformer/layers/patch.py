"""Geometry of a non-overlapping patch grid (ViT, CRATE patch embeddings)."""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import check_instance, check_int, check_tensor
from .helpers import to_2tuple
from .pos_embed import resample_abs_pos_embed

__all__ = ["PatchGrid", "pad_to_patches"]


def pad_to_patches(x: torch.Tensor, patch_size: Tuple[int, int]) -> torch.Tensor:
    """Images (B, C, H, W) padded with zeros at the right and bottom up to multiples of ``patch_size``
    (timm's ``dynamic_img_pad``); ``x`` itself when they already are."""
    pad_h, pad_w = (-x.shape[2]) % patch_size[0], (-x.shape[3]) % patch_size[1]
    return F.pad(x, (0, pad_w, 0, pad_h)) if pad_h or pad_w else x


def _side(size: Tuple[int, int]):
    """A square size as its one side (as the user usually writes it), else the pair."""
    return size[0] if size[0] == size[1] else size


class PatchGrid(nn.Module):
    """Geometry and input check shared by the non-overlapping patch embeddings (ViT, CRATE):
    ``img_size`` divisible by ``patch_size``; ``grid_size``, ``num_patches``.

    timm's flags: ``dynamic_img_size`` takes images of any size whose sides are multiples of the
    patch size (the model resizes its position embeddings to each input's grid);
    ``dynamic_img_pad`` pads the right and bottom of the images with zeros up to such multiples."""

    def __init__(self, img_size=224, patch_size=16, in_chans: int = 3, dynamic_img_size: bool = False,
                 dynamic_img_pad: bool = False):
        super().__init__()
        self.img_size = to_2tuple(img_size, "img_size")
        self.patch_size = to_2tuple(patch_size, "patch_size")
        if self.img_size[0] % self.patch_size[0] or self.img_size[1] % self.patch_size[1]:
            raise ValueError(f"img_size {_side(self.img_size)} must be divisible by patch_size {_side(self.patch_size)}")
        check_int(in_chans, "in_chans", 1)
        for name, flag in (("dynamic_img_size", dynamic_img_size), ("dynamic_img_pad", dynamic_img_pad)):
            check_instance(flag, name, bool, "a bool")
        self.in_chans = in_chans
        self.dynamic_img_size, self.dynamic_img_pad = dynamic_img_size, dynamic_img_pad
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]

    def input_grid(self, x: torch.Tensor) -> Tuple[int, int]:
        """The patch grid (Hp, Wp) of images ``x`` (B, in_chans, H, W), after checking them: (H, W) must
        be ``img_size``; with ``dynamic_img_size`` any size that divides into patches (with
        ``dynamic_img_pad``, rounded up to one)."""
        check_tensor(x, "x", 4)
        if x.shape[0] == 0:
            raise ValueError(f"x must be a non-empty image batch, got shape {tuple(x.shape)}")
        (h, w), (ph, pw) = x.shape[2:], self.patch_size
        if x.shape[1] == self.in_chans and self.dynamic_img_pad:
            h, w = h + (-h) % ph, w + (-w) % pw
        if x.shape[1] == self.in_chans and (h, w) == self.img_size:
            return self.grid_size
        if x.shape[1] != self.in_chans or not self.dynamic_img_size:
            raise ValueError(f"x must have shape (B, {self.in_chans}, {self.img_size[0]}, {self.img_size[1]}), "
                             f"got {tuple(x.shape)}" + ("" if self.dynamic_img_size else
                                                        " (dynamic_img_size=True takes other sizes)"))
        if h % ph or w % pw or h == 0 or w == 0:
            raise ValueError(f"x's height and width must be positive multiples of patch_size {self.patch_size} "
                             f"(dynamic_img_pad=True pads them), got {tuple(x.shape)}")
        return h // ph, w // pw

    def check_images(self, x: torch.Tensor) -> torch.Tensor:
        """Checked images (:meth:`input_grid`), padded at the right and bottom with ``dynamic_img_pad``."""
        self.input_grid(x)
        return pad_to_patches(x, self.patch_size) if self.dynamic_img_pad else x

    def pos_embed_for(self, pos_embed: torch.Tensor, grid: Tuple[int, int], num_prefix_tokens: int = 1
                      ) -> torch.Tensor:
        """The position embedding (1, prefix + Hp*Wp, D) of ``grid``: ``pos_embed`` itself on the
        model's grid, else resized to it (bicubic with antialiasing, timm's ``dynamic_img_size``)."""
        if tuple(grid) == self.grid_size:
            return pos_embed
        return resample_abs_pos_embed(pos_embed, grid, old_size=self.grid_size, num_prefix_tokens=num_prefix_tokens)
