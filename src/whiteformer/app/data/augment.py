"""Light image augmentation in plain torch (no torchvision), reproducible from a generator.

The random parameters of a whole (global) batch are drawn first (:meth:`Augment.sample`), then
applied (:meth:`Augment.apply`) to the images or to a slice of them, so that data-parallel ranks
that each process a slice of the global batch augment exactly as one process would.

- random translation by up to ``translate`` pixels in each direction (zero padding, i.e. the
  background of the [0, 1]-scaled images, then a crop at a random offset; ``translate=0``: off);
- horizontal flip with probability ``flip`` (off by default: digits are not mirror-symmetric).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.nn.functional as F

from ..._checks import is_int

__all__ = ["Augment", "translate", "hflip"]


def translate(x: torch.Tensor, shifts: torch.Tensor, pad: int) -> torch.Tensor:
    """Shift each image of x (B, C, H, W) by ``shifts`` (B, 2) = (dy, dx) in [-pad, pad], filling
    with zeros: ``out[b, :, i, j] = x[b, :, i - dy, j - dx]``."""
    if pad == 0:
        return x
    b, c, h, w = x.shape
    xp = F.pad(x, (pad, pad, pad, pad))
    rows = (pad - shifts[:, 0])[:, None] + torch.arange(h, device=x.device)  # (B, H)
    cols = (pad - shifts[:, 1])[:, None] + torch.arange(w, device=x.device)  # (B, W)
    bi = torch.arange(b, device=x.device)[:, None, None]
    out = xp.permute(0, 2, 3, 1)[bi, rows[:, :, None], cols[:, None, :]]  # (B, H, W, C)
    return out.permute(0, 3, 1, 2).contiguous()


def hflip(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mirror the images of x (B, C, H, W) where ``mask`` (B,) is True."""
    return torch.where(mask[:, None, None, None], x.flip(-1), x)


@dataclass
class Augment:
    """Random translation (+ optional horizontal flip) of [0, 1]-scaled images (B, C, H, W)."""

    translate: int = 1
    flip: float = 0.0

    def __post_init__(self):
        if not is_int(self.translate) or self.translate < 0:
            raise ValueError(f"translate must be an int >= 0 (pixels), got {self.translate!r}")
        if not 0.0 <= float(self.flip) <= 1.0:
            raise ValueError(f"flip must be a probability in [0, 1], got {self.flip!r}")

    @property
    def active(self) -> bool:
        return self.translate > 0 or self.flip > 0

    def sample(self, n: int, generator: torch.Generator) -> Dict[str, torch.Tensor]:
        """Parameters for n images: ``shifts`` (n, 2) ints, ``flip`` (n,) bools."""
        t = self.translate
        shifts = torch.randint(-t, t + 1, (n, 2), generator=generator) if t > 0 else torch.zeros(n, 2, dtype=torch.long)
        flips = torch.rand(n, generator=generator) < self.flip
        return {"shifts": shifts, "flip": flips}

    def apply(self, x: torch.Tensor, params: Dict[str, torch.Tensor], sl: Optional[slice] = None) -> torch.Tensor:
        """Augment x with ``params`` (or their slice ``sl``, for one rank's part of a batch)."""
        shifts, flips = params["shifts"], params["flip"]
        if sl is not None:
            shifts, flips = shifts[sl], flips[sl]
        if shifts.shape[0] != x.shape[0]:
            raise ValueError(f"augmentation parameters for {shifts.shape[0]} images, got {x.shape[0]}")
        x = translate(x, shifts.to(x.device), self.translate)
        if self.flip > 0:
            x = hflip(x, flips.to(x.device))
        return x
