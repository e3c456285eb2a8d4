"""Mixup / CutMix with label smoothing, and the soft-target cross-entropy, in plain torch.

Mixup (Zhang, Cisse, Dauphin, Lopez-Paz: "mixup: Beyond Empirical Risk Minimization",
arXiv:1710.09412): ``x = lam x_i + (1 - lam) x_j``; CutMix (Yun et al.: "CutMix: Regularization
Strategy to Train Strong Classifiers with Localizable Features", arXiv:1905.04899): a box of area
``(1 - lam) H W`` of x_j pasted into x_i, ``lam`` then corrected to the box's clipped area. Both
with ``lam ~ Beta(alpha, alpha)``; the targets are mixed the same way from smoothed one-hot
vectors (``on = 1 - s + s / K``, ``off = s / K``), so each row sums to 1.

timm's conventions (``timm.data.Mixup``): image i is mixed with image ``B - 1 - i`` of its batch
(one process's batch under data parallelism); ``mode="batch"`` draws one ``lam`` (and one box) per
batch, ``mode="elem"`` one per image; a mix happens with probability ``prob``; with both alphas > 0,
CutMix is chosen with probability ``switch_prob``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["MixupCutmix", "smooth_one_hot", "soft_target_cross_entropy", "MIXUP_MODES"]

MIXUP_MODES = ("batch", "elem")


def smooth_one_hot(y: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """Labels (B,) -> (B, K) float targets ``1 - s + s / K`` on the label, ``s / K`` elsewhere."""
    off = smoothing / num_classes
    out = torch.full((y.shape[0], num_classes), off, dtype=torch.float32, device=y.device)
    return out.scatter_(1, y.long().view(-1, 1), 1.0 - smoothing + off)


def soft_target_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``mean_b sum_k -target[b, k] log softmax(logits)[b, k]`` (logits, target: (B, K)), in float32."""
    return torch.sum(-target.float() * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()


def _numpy_rng(generator: torch.Generator) -> np.random.Generator:
    return np.random.default_rng(int(torch.randint(0, 2 ** 62, (1,), generator=generator)))


@dataclass
class MixupCutmix:
    """Mixup (``mixup_alpha`` > 0) and / or CutMix (``cutmix_alpha`` > 0) of image batches with
    label-smoothed targets (``label_smoothing``) over ``num_classes`` classes."""

    mixup_alpha: float = 0.8
    cutmix_alpha: float = 1.0
    prob: float = 1.0
    switch_prob: float = 0.5
    mode: str = "batch"
    label_smoothing: float = 0.1
    num_classes: int = 1000

    def __post_init__(self):
        if self.mixup_alpha < 0 or self.cutmix_alpha < 0 or self.mixup_alpha + self.cutmix_alpha <= 0:
            raise ValueError(f"mixup_alpha and cutmix_alpha must be >= 0 and one > 0, got {self.mixup_alpha!r}, "
                             f"{self.cutmix_alpha!r}")
        if self.mode not in MIXUP_MODES:
            raise ValueError(f"mode must be one of {', '.join(MIXUP_MODES)}, got {self.mode!r}")
        if not (0 <= self.prob <= 1 and 0 <= self.switch_prob <= 1 and 0 <= self.label_smoothing < 1):
            raise ValueError("prob and switch_prob must be in [0, 1], label_smoothing in [0, 1)")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes!r}")

    def sample(self, n: int, generator: torch.Generator) -> Dict[str, torch.Tensor]:
        """Parameters for a global batch of n images (one row, or n rows with ``mode="elem"``):
        ``lam`` (the Beta draw; 1: no mix), ``cutmix`` (bool), ``centre`` (rows, 2) uniform in [0, 1)
        (the box centre as a fraction of the height / width)."""
        rows = n if self.mode == "elem" else 1
        rng = _numpy_rng(generator)
        mixing = rng.random(rows) < self.prob
        if self.mixup_alpha > 0 and self.cutmix_alpha > 0:
            cut = rng.random(rows) < self.switch_prob
        else:
            cut = np.full(rows, self.cutmix_alpha > 0)
        lam_cut = rng.beta(self.cutmix_alpha, self.cutmix_alpha, rows) if self.cutmix_alpha > 0 else np.ones(rows)
        lam_mix = rng.beta(self.mixup_alpha, self.mixup_alpha, rows) if self.mixup_alpha > 0 else np.ones(rows)
        lam = np.where(mixing, np.where(cut, lam_cut, lam_mix), 1.0)
        centre = rng.random((rows, 2))
        return {"lam": torch.from_numpy(lam).float(), "cutmix": torch.from_numpy(cut & mixing),
                "centre": torch.from_numpy(centre).float()}

    def apply(self, x: torch.Tensor, y: torch.Tensor, params: Dict[str, torch.Tensor],
              sl: Optional[slice] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Mix the images x (B, C, H, W) and labels y (B,) -> (mixed x, soft targets (B, K)); ``sl``
        selects this process's rows of per-image (``elem``) parameters."""
        b, _, h, w = x.shape
        if self.mode == "elem" and sl is not None:
            params = {k: v[sl] for k, v in params.items()}
        lam, cut, centre = (params[k].to(x.device) for k in ("lam", "cutmix", "centre"))
        if lam.shape[0] not in (1, b):
            raise ValueError(f"mixup parameters for {lam.shape[0]} images, got {b}")
        lam, cut, centre = lam.expand(b), cut.expand(b), centre.expand(b, 2)
        partner = x.flip(0)
        # CutMix box: side sqrt(1 - lam) of the image's, centred at an integer pixel, clipped to the frame.
        ratio = torch.sqrt(1 - lam)
        ch, cw = (h * ratio).long(), (w * ratio).long()
        cy, cx = (centre[:, 0] * h).long(), (centre[:, 1] * w).long()
        y0, y1 = (cy - ch // 2).clamp(0, h), (cy + ch // 2).clamp(0, h)
        x0, x1 = (cx - cw // 2).clamp(0, w), (cx + cw // 2).clamp(0, w)
        ii = torch.arange(h, device=x.device).view(1, h, 1)
        jj = torch.arange(w, device=x.device).view(1, 1, w)
        box = (ii >= y0.view(-1, 1, 1)) & (ii < y1.view(-1, 1, 1)) & (jj >= x0.view(-1, 1, 1)) & (jj < x1.view(-1, 1, 1))
        box = box & cut.view(-1, 1, 1)
        lam_cut = 1 - ((y1 - y0) * (x1 - x0)).float() / (h * w)
        lam = torch.where(cut, lam_cut, lam)
        lam_x = lam.view(-1, 1, 1, 1).to(x.dtype)
        blended = torch.where(cut.view(-1, 1, 1, 1), x, lam_x * x + (1 - lam_x) * partner)
        mixed = torch.where(box.unsqueeze(1), partner, blended)
        t = smooth_one_hot(y, self.num_classes, self.label_smoothing)
        target = lam.view(-1, 1) * t + (1 - lam.view(-1, 1)) * t.flip(0)
        return mixed, target
