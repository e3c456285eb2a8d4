"""AdamW with weight decay only on the weight matrices.

No decay for the names in ``model.no_weight_decay()`` (temperatures, position biases, class
token, ...) and for every parameter with fewer than 2 dimensions (biases, norm weights, layer
scales), as timm's ``param_groups_weight_decay``.
"""
from __future__ import annotations

from typing import Dict, List, Set

import torch
import torch.nn as nn

__all__ = ["param_groups", "build_optimizer"]


def _no_decay_names(model: nn.Module) -> Set[str]:
    fn = getattr(model, "no_weight_decay", None)
    return set(fn()) if callable(fn) else set()


def param_groups(model: nn.Module, weight_decay: float) -> List[Dict]:
    skip = _no_decay_names(model)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1 or name in skip or name.endswith(".bias"):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.999)) -> torch.optim.AdamW:
    # foreach=False: the same (single-tensor) kernel in every process, for bit-exact resumes.
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, foreach=False)
