"""CaiT/XCiT class attention block of the ToST / XCiT head: :class:`ClassAttentionBlock` (the
parameter names of the official ToST state dict)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from .._utils import apply_layer_scale, layer_scale_param
from ..attention.baselines import ClassAttention
from .drop import DropPath
from .mlp import Mlp

__all__ = ["ClassAttentionBlock"]


class ClassAttentionBlock(nn.Module):
    """CaiT/XCiT class-attention block: only the CLS token (index 0) queries all tokens.

    As the official XCiT/ToST code (``tokens_norm=True`` there)::

        y = norm1(x);   a = ClassAttention(y)          # only a[:, 0] is used
        x = x + drop_path(gamma1 * [a_0, y_1..N])       # patch tokens: x_i + gamma1 * y_i
        x = norm2(x)    if tokens_norm else  [norm2(x_0), x_1..N]
        x = x + drop_path([gamma2 * mlp(x_0), x_1..N])  # patch tokens are doubled (XCiT quirk)

    The patch-token updates (adding ``gamma1 * norm1(x)`` and the doubling) reproduce the official
    implementation exactly; they matter because the next class-attention block attends to them.
    ``eta=None`` disables the layer scale (gammas = 1). Shapes: (B, 1+N, C) -> (B, 1+N, C).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        act_layer: type = nn.GELU,
        norm_eps: float = 1e-6,
        eta: Optional[float] = None,
        tokens_norm: bool = False,
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = ClassAttention(
            dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=drop
        )
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=drop)
        self.gamma1 = layer_scale_param(dim, eta)
        self.gamma2 = layer_scale_param(dim, eta)
        self.tokens_norm = tokens_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        a = self.attn(y)
        upd = torch.cat([a[:, :1], y[:, 1:]], dim=1)
        x = x + self.drop_path(apply_layer_scale(self.gamma1, upd))
        if self.tokens_norm:
            x = self.norm2(x)
        else:
            x = torch.cat([self.norm2(x[:, :1]), x[:, 1:]], dim=1)
        cls = apply_layer_scale(self.gamma2, self.mlp(x[:, :1]))
        return x + self.drop_path(torch.cat([cls, x[:, 1:]], dim=1))
