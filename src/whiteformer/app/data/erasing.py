"""Random erasing of normalised images in plain torch (timm's ``RandomErasing`` semantics).

Random erasing (Zhong, Zheng, Kang, Li, Yang: "Random Erasing Data Augmentation",
arXiv:1708.04896): with probability ``prob``, an image gets ``count`` rectangles (with
``count > 1``: between 1 and ``count``, drawn per image) of area ``U(0.02, 1/3) H W / count`` and
aspect ratio ``exp(U(log 0.3, log 1/0.3))``, placed uniformly; up to 10 draws per rectangle until one
fits. The rectangle is filled, in normalised units, with zeros (``mode="const"``: the mean colour),
one normal colour per channel (``"rand"``) or normal noise per pixel (``"pixel"``).

The parameters of a global batch are drawn first (:meth:`RandomErasing.sample`) and applied to a
slice (:meth:`RandomErasing.apply`), so data-parallel processes erase as one process would.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from ..._checks import is_int

__all__ = ["RandomErasing", "ERASE_MODES"]

ERASE_MODES = ("const", "rand", "pixel")
_ATTEMPTS = 10


@dataclass
class RandomErasing:
    """Erase rectangles of (B, C, H, W) normalised images (see the module docstring)."""

    prob: float = 0.25
    mode: str = "pixel"
    count: int = 1
    min_area: float = 0.02
    max_area: float = 1 / 3
    min_aspect: float = 0.3

    def __post_init__(self):
        if not 0 <= self.prob <= 1:
            raise ValueError(f"prob must be a probability in [0, 1], got {self.prob!r}")
        if self.mode not in ERASE_MODES:
            raise ValueError(f"mode must be one of {', '.join(ERASE_MODES)}, got {self.mode!r}")
        if not is_int(self.count) or self.count < 1:
            raise ValueError(f"count must be an int >= 1, got {self.count!r}")

    def sample(self, n: int, generator: torch.Generator) -> Dict[str, torch.Tensor]:
        """Parameters for n images: ``erase`` (n,) bool, ``boxes`` (n, count) used, and per box and
        attempt (n, count, 10) ``area`` fraction, ``log_aspect``, ``top`` / ``left`` uniform in [0, 1),
        and ``seed`` (n,) of the fill noise."""
        k = self.count
        erase = torch.rand(n, generator=generator) < self.prob
        boxes = torch.randint(1, k + 1, (n,), generator=generator) if k > 1 else torch.ones(n, dtype=torch.long)
        shape = (n, k, _ATTEMPTS)
        area = self.min_area + (self.max_area - self.min_area) * torch.rand(shape, generator=generator, dtype=torch.float64)
        lo, hi = math.log(self.min_aspect), math.log(1 / self.min_aspect)
        log_aspect = lo + (hi - lo) * torch.rand(shape, generator=generator, dtype=torch.float64)
        top = torch.rand(shape, generator=generator, dtype=torch.float64)
        left = torch.rand(shape, generator=generator, dtype=torch.float64)
        seed = torch.randint(0, 2 ** 62, (n,), generator=generator)
        return {"erase": erase, "boxes": boxes, "area": area, "log_aspect": log_aspect, "top": top, "left": left,
                "seed": seed}

    def apply(self, x: torch.Tensor, params: Dict[str, torch.Tensor], sl: Optional[slice] = None) -> torch.Tensor:
        """Erase in a copy of x (B, C, H, W) with ``params`` (or their rows ``sl``)."""
        if sl is not None:
            params = {k: v[sl] for k, v in params.items()}
        b, c, h, w = x.shape
        if params["erase"].shape[0] != b:
            raise ValueError(f"erasing parameters for {params['erase'].shape[0]} images, got {b}")
        out = x.clone()
        for i in torch.nonzero(params["erase"]).flatten().tolist():
            count = int(params["boxes"][i])
            g = torch.Generator().manual_seed(int(params["seed"][i]))
            for r in range(count):
                for a in range(_ATTEMPTS):
                    target = float(params["area"][i, r, a]) * h * w / count
                    aspect = math.exp(float(params["log_aspect"][i, r, a]))
                    eh, ew = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
                    if ew < w and eh < h:
                        top = int(float(params["top"][i, r, a]) * (h - eh + 1))
                        left = int(float(params["left"][i, r, a]) * (w - ew + 1))
                        out[i, :, top:top + eh, left:left + ew] = self._fill((c, eh, ew), g).to(out)
                        break
        return out

    def _fill(self, shape, g: torch.Generator) -> torch.Tensor:
        if self.mode == "pixel":
            return torch.randn(shape, generator=g)
        if self.mode == "rand":
            return torch.randn((shape[0], 1, 1), generator=g).expand(shape)
        return torch.zeros(shape)
