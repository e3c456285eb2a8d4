"""Plain reference of :func:`whiteformer.ops.linear_cross_entropy`: form all logits, then the
mean cross-entropy (softmax statistics in float32)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear_cross_entropy_reference"]


def linear_cross_entropy_reference(h, weight, targets, ignore_index: int = -1):
    """``mean_{i: t_i != ignore} -log softmax(h_i W^T)[t_i]``; h (M, D), weight (V, D), targets (M,)."""
    logits = (h @ weight.T).to(torch.promote_types(h.dtype, torch.float32))
    return F.cross_entropy(logits, targets.long(), ignore_index=ignore_index)
