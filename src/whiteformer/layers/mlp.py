"""MLPs of the blocks: :class:`Mlp` (timm's ``fc1``/``fc2``) and :class:`ISTA`, CRATE's sparse-coding
block that takes the MLP's place (one (dim, dim) dictionary ``weight``)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Mlp", "ISTA"]


class Mlp(nn.Module):
    """Two-layer MLP ``fc2(drop(act(fc1(x))))`` (+ dropout), timm's ``Mlp``.

    Shapes: (..., in_features) -> (..., out_features); hidden defaults to ``in_features``.
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: Optional[int] = None,
        out_features: Optional[int] = None,
        act_layer: type = nn.GELU,
        drop: float = 0.0,
        bias: bool = True,
    ):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class ISTA(nn.Module):
    """CRATE's sparse-coding block: one proximal-gradient (ISTA) step on a LASSO with dictionary D.

    ``ISTA(x) = relu(x + eta * (D^T x - D^T D x) - eta * lambda)`` (Yu et al., CRATE, 2023,
    Eq. (17) with the non-negativity constraint), ``D = weight`` of shape (dim, dim), initialised
    with ``kaiming_uniform_`` as the official CRATE code. Shapes: (..., dim) -> (..., dim).
    """

    def __init__(self, dim: int, eta: float = 0.1, lambd: float = 0.1):
        super().__init__()
        self.dim = dim
        self.eta, self.lambd = float(eta), float(lambd)
        self.weight = nn.Parameter(torch.empty(dim, dim))
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dx = F.linear(x, self.weight)  # D x
        dtdx = F.linear(dx, self.weight.t())  # D^T D x
        dtx = F.linear(x, self.weight.t())  # D^T x
        return F.relu(x + self.eta * (dtx - dtdx) - self.eta * self.lambd)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eta={self.eta}, lambd={self.lambd}"
