"""Exponential moving average of a model's weights (as timm's ``ModelEmaV2``)."""
from __future__ import annotations

import copy
from typing import Dict

import torch
import torch.nn as nn

__all__ = ["ModelEMA"]


class ModelEMA:
    """``ema = decay * ema + (1 - decay) * w`` for floating parameters and buffers after each
    step (integer buffers such as BatchNorm's ``num_batches_tracked`` are copied). The averaged
    copy ``module`` is in eval mode and has no gradients."""

    def __init__(self, model: nn.Module, decay: float = 0.999):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        self.decay = float(decay)
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        src = model.state_dict()
        for name, ema_t in self.module.state_dict().items():
            t = src[name].detach()
            if ema_t.dtype.is_floating_point:
                ema_t.mul_(self.decay).add_(t.to(ema_t.dtype), alpha=1.0 - self.decay)
            else:
                ema_t.copy_(t)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)
