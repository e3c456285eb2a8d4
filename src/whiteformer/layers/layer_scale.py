"""Layer scale (CaiT, as timm's ``layers/layer_scale.py``): :class:`LayerScale`, parameter ``gamma``."""
from __future__ import annotations

import torch
import torch.nn as nn

from .._checks import check_finite_real
from .._utils import apply_layer_scale, layer_scale_param

__all__ = ["LayerScale"]


class LayerScale(nn.Module):
    """Per-channel scale ``x * gamma`` with ``gamma`` (dim,) initialised to ``init_values`` (CaiT)."""

    def __init__(self, dim: int, init_values: float = 1e-5):
        super().__init__()
        self.gamma = layer_scale_param(dim, check_finite_real(init_values, "init_values"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_layer_scale(self.gamma, x)
