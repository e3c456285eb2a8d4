"""Attention-pooling readout: a learned class token that attends to the final tokens.

TSSA (and the other token-statistics layers) mix tokens only through per-head second moments,
so a [CLS] token carried through the blocks learns little about the image (see
:class:`whiteformer.attention.TSSA`). This readout does the aggregation *after* the blocks, as
CaiT's class attention (Touvron et al. 2021, "Going deeper with image transformers", Sec. 3.2)
and the ToST/XCiT/ECA heads do: only the class token queries, the patch tokens are not updated::

    c_0 = cls (learned)
    c_{l+1} = c_l + ClassAttention(norm([c_l; x]))_0     (softmax over the N tokens and c_l)
    c_{l+1} = c_{l+1} + mlp(norm(c_{l+1}))
    out = norm(c_L)

Cost O(N C) per layer (one query). Works after any token mixer.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from .._checks import check_int, check_positive_real, check_tokens_input
from ..attention.baselines import ClassAttention

__all__ = ["ClassAttentionPool"]


class _ClassAttentionLayer(nn.Module):
    """One pre-norm class-attention layer updating the class token only: (B, 1, C), (B, N, C) -> (B, 1, C)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, qkv_bias: bool, norm_eps: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = ClassAttention(dim, num_heads=num_heads, qkv_bias=qkv_bias)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, cls: torch.Tensor, x: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
        cls = cls + self.attn(self.norm1(torch.cat([cls, x], dim=1)), keep)[:, :1]
        return cls + self.mlp(self.norm2(cls))


class ClassAttentionPool(nn.Module):
    """Attention-pooling readout (class attention, CaiT): tokens (B, N, C) -> pooled features (B, C).

    Put it after the blocks instead of a [CLS] token or mean pooling: ``logits = head(pool(x))``.
    It is what TSSA needs around it to be a drop-in for softmax attention in a plain ViT
    (measured in docs/results.md, "Plain ViT": on MNIST TSSA goes from a [CLS]-token readout far
    below softmax to on par with it).

    Args:
        dim: C. num_heads: heads of the class attention (C divisible by them).
        depth: number of class-attention layers (CaiT/XCiT/ToST use 2; 1 is enough for small data).
        mlp_ratio: hidden width of each layer's MLP, as a multiple of C.
        qkv_bias: bias of the class attention's ``qkv``.
        norm_eps: LayerNorm epsilon.

    ``forward(x, attn_mask=None)``: x (B, N, C), attn_mask (B, N) bool keep-mask (True = real
    token; padded tokens are not attended to) -> (B, C), layer-normalised. Parameters:
    ``cls_token`` (1, 1, C) (trunc-normal 0.02, listed by :meth:`no_weight_decay`), ``blocks``,
    ``norm``.
    """

    def __init__(self, dim: int, num_heads: int = 8, depth: int = 1, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, norm_eps: float = 1e-6):
        super().__init__()
        check_int(depth, "depth", 1)
        check_positive_real(mlp_ratio, "mlp_ratio")
        self.dim = dim
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.blocks = nn.ModuleList(
            _ClassAttentionLayer(dim, num_heads, mlp_ratio, qkv_bias, norm_eps) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim, eps=norm_eps)

    def no_weight_decay(self):
        return {"cls_token"}

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (B, N, C), attn_mask (B, N) bool keep-mask -> pooled, normalised features (B, C)."""
        keep = check_tokens_input(x, "x", self.dim, attn_mask=attn_mask)
        if keep is not None:
            keep = torch.cat([keep.new_ones(x.shape[0], 1), keep], dim=1)
        cls = self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype)
        for blk in self.blocks:
            cls = blk(cls, x, keep)
        return self.norm(cls[:, 0])
