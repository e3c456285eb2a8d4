"""AdamW with weight decay only on the weight matrices.

No decay for the names in ``model.no_weight_decay()`` (temperatures, position biases, class
token, ...) and for every parameter with fewer than 2 dimensions (biases, norm weights, layer
scales), as timm's ``param_groups_weight_decay``.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Set

import torch
import torch.nn as nn

__all__ = ["param_groups", "build_optimizer"]


def _no_decay_names(model: nn.Module) -> Set[str]:
    fn = getattr(model, "no_weight_decay", None)
    return set(fn()) if callable(fn) else set()


def param_groups(model: nn.Module, weight_decay: float, no_decay: Optional[Callable[[str], bool]] = None
                 ) -> List[Dict]:
    """[decayed weights, the rest]; ``no_decay(name)`` True exempts more parameters (e.g. the
    head-fusion matrices of compressed attention)."""
    skip = _no_decay_names(model)
    decay, rest = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1 or name in skip or name.endswith(".bias") or (no_decay is not None and no_decay(name)):
            rest.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.999),
                    no_decay: Optional[Callable[[str], bool]] = None) -> torch.optim.AdamW:
    # foreach=False: the same (single-tensor) kernel in every process, for bit-exact resumes.
    return torch.optim.AdamW(param_groups(model, weight_decay, no_decay), lr=lr, betas=betas, foreach=False)
