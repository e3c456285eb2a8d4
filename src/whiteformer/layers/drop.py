"""Stochastic depth (as timm's ``layers/drop.py``): :func:`drop_path`, :class:`DropPath`."""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["drop_path", "DropPath"]


def drop_path(x: torch.Tensor, drop_prob: float = 0.0, training: bool = False, scale_by_keep: bool = True):
    """Stochastic depth per sample: zero whole samples with probability ``drop_prob``.

    The kept samples are divided by the keep probability when ``scale_by_keep`` (timm semantics).
    """
    if drop_prob == 0.0 or not training:
        return x
    keep = 1.0 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.dim() - 1)
    mask = x.new_empty(shape).bernoulli_(keep)
    if keep > 0.0 and scale_by_keep:
        mask.div_(keep)
    return x * mask


class DropPath(nn.Module):
    """Stochastic depth (Huang et al., 2016) applied to a residual branch, timm's ``DropPath``."""

    def __init__(self, drop_prob: float = 0.0, scale_by_keep: bool = True):
        super().__init__()
        self.drop_prob = float(drop_prob)
        self.scale_by_keep = scale_by_keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.drop_prob, self.training, self.scale_by_keep)

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:.3f}"
