"""Per-head ranks of the compressed attention layers (IrrAtt paper): one int for every head, or
one per head, each in [0, max_rank] (or [1, max_rank]) and not all zero, as a tuple of H ints."""
from __future__ import annotations

from typing import Tuple

import torch

from .._checks import is_int

__all__ = ["normalize_ranks"]


def normalize_ranks(ranks, num_heads: int, max_rank: int, name: str = "ranks",
                    allow_zero: bool = True) -> Tuple[int, ...]:
    """Turn an int or a sequence of H ints into a validated tuple of per-head ranks."""
    if isinstance(ranks, bool):
        raise TypeError(f"{name} must be an int or a sequence of ints, got bool")
    if is_int(ranks):
        ranks = (ranks,) * num_heads
    elif isinstance(ranks, (list, tuple)) or (isinstance(ranks, torch.Tensor) and ranks.dim() == 1):
        values = ranks.tolist() if isinstance(ranks, torch.Tensor) else list(ranks)
        if not all(is_int(r) for r in values):
            raise TypeError(f"{name} must hold ints (one rank per head), got {values!r}")
        ranks = tuple(int(r) for r in values)
    else:
        raise TypeError(f"{name} must be an int or a sequence of {num_heads} ints, got {type(ranks).__name__}")
    if len(ranks) != num_heads:
        raise ValueError(f"{name} must have one rank per head ({num_heads}), got {len(ranks)}")
    lo = 0 if allow_zero else 1
    for r in ranks:
        if r < lo or r > max_rank:
            raise ValueError(f"{name} out of range: each rank must be in [{lo}, {max_rank}], got {ranks}")
    if sum(ranks) == 0:
        raise ValueError(f"{name} must not all be zero")
    return ranks
