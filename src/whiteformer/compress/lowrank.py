"""A linear layer factorised through a rank-r bottleneck (truncated SVD of a dense linear)."""
from __future__ import annotations

import torch
import torch.nn as nn

from .._checks import check_int
from .flops import lowrank_linear_macs

__all__ = ["LowRankLinear"]


class LowRankLinear(nn.Module):
    """A linear layer factorised as two linears, ``y = second(first(x))`` with
    ``first = Linear(in, r, bias=False)``, ``second = Linear(r, out)`` (truncated SVD; MACs N r (in + out)).

    Shapes: x (..., in) -> (..., out).
    """

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True):
        super().__init__()
        for v, n in ((in_features, "in_features"), (out_features, "out_features"), (rank, "rank")):
            check_int(v, n, 1)
        if rank > min(in_features, out_features):
            raise ValueError(f"rank out of range: must be <= min(in_features, out_features) = "
                             f"{min(in_features, out_features)} (a factorisation of a larger rank is no lower), "
                             f"got {rank}")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.first = nn.Linear(in_features, rank, bias=False)
        self.second = nn.Linear(rank, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must be a tensor (..., {self.in_features}), got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
        return self.second(self.first(x))

    def weight(self) -> torch.Tensor:
        """The dense (out, in) weight ``second.weight @ first.weight``."""
        return self.second.weight @ self.first.weight

    def macs(self, num_tokens: int) -> int:
        return lowrank_linear_macs(num_tokens, self.in_features, self.out_features, self.rank)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"
