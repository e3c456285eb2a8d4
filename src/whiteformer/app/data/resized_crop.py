"""Random resized crops (the Inception / DeiT training crop, torchvision's and timm's
``RandomResizedCrop``): a box of ``U(scale)`` of the image's area and aspect ratio
``exp(U(log ratio))``, placed uniformly, resized to the output size; up to 10 draws until one fits,
else the centre crop of the largest box of a ratio within ``ratio``.

The draws do not depend on the image's size (:meth:`RandomResizedCrop.sample`); each image's box is
resolved from them and its own size (:meth:`RandomResizedCrop.box`), so files of any size are cropped
from the original (``image-folder`` reads the box with Pillow) and in-memory images in torch
(:meth:`RandomResizedCrop.apply`, bilinear).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..._checks import is_real

__all__ = ["RandomResizedCrop", "check_crop_range"]

_ATTEMPTS = 10


def check_crop_range(value, name: str, low: float, high: float) -> Tuple[float, float]:
    """``value`` as a pair (lo, hi) with ``low < lo <= hi <= high``, or a ``ValueError`` naming ``name``."""
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(is_real(v) for v in value)
    if not ok or not (low < value[0] <= value[1] <= high):
        raise ValueError(f"{name} must be two numbers [lo, hi] with {low:g} < lo <= hi <= {high:g}, got {value!r}")
    return float(value[0]), float(value[1])


@dataclass
class RandomResizedCrop:
    """Random resized crop of area fraction in ``scale`` and aspect ratio (width / height) in ``ratio``."""

    scale: Sequence[float] = (0.08, 1.0)
    ratio: Sequence[float] = (3 / 4, 4 / 3)

    def __post_init__(self):
        self.scale = check_crop_range(list(self.scale), "crop_scale", 0.0, 1.0)
        self.ratio = check_crop_range(list(self.ratio), "crop_ratio", 0.0, math.inf)

    def sample(self, n: int, generator: torch.Generator) -> Dict[str, torch.Tensor]:
        """Draws for n images, each (n, 10): ``area`` fraction, ``log_ratio``, ``top`` / ``left`` in [0, 1)."""
        shape = (n, _ATTEMPTS)
        u = torch.rand((4,) + shape, generator=generator, dtype=torch.float64)
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        return {"area": self.scale[0] + (self.scale[1] - self.scale[0]) * u[0], "log_ratio": lo + (hi - lo) * u[1],
                "top": u[2], "left": u[3]}

    def box(self, params: Dict[str, torch.Tensor], i: int, height: int, width: int) -> Tuple[int, int, int, int]:
        """(top, left, h, w) in pixels of image ``i`` (row of ``params``) of size (height, width)."""
        area = height * width
        for a in range(_ATTEMPTS):
            target = float(params["area"][i, a]) * area
            aspect = math.exp(float(params["log_ratio"][i, a]))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top = int(float(params["top"][i, a]) * (height - h + 1))
                left = int(float(params["left"][i, a]) * (width - w + 1))
                return top, left, h, w
        in_ratio = width / height  # fallback: the whole image, cut to the nearest allowed ratio
        if in_ratio < self.ratio[0]:
            w, h = width, int(round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            h, w = height, int(round(height * self.ratio[1]))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def apply(self, x: torch.Tensor, params: Dict[str, torch.Tensor], sl: Optional[slice] = None) -> torch.Tensor:
        """Crop each image of x (B, C, H, W) by its box and resize it back to (H, W) (bilinear,
        antialiased when shrinking)."""
        if sl is not None:
            params = {k: v[sl] for k, v in params.items()}
        b, _, h, w = x.shape
        if params["area"].shape[0] != b:
            raise ValueError(f"crop parameters for {params['area'].shape[0]} images, got {b}")
        out = []
        for i in range(b):
            top, left, ch, cw = self.box(params, i, h, w)
            crop = x[i:i + 1, :, top:top + ch, left:left + cw]
            out.append(F.interpolate(crop, size=(h, w), mode="bilinear", align_corners=False,
                                     antialias=ch > h or cw > w))
        return torch.cat(out)
