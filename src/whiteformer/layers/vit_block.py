"""A ready pre-norm ViT block around any registered attention, with an optional local mixer.

    x = x + attn(norm1(x))                       any name of :func:`whiteformer.attention.build`
    x = x + lpi(norm3(x))       (lpi=True)       XCiT's local patch interaction on the token grid
    x = x + mlp(norm2(x))

TSSA mixes tokens only through per-head second moments (a global, position-blind statistic), so a
plain ViT built from it has no way to combine neighbouring patches; XCiT faced the same with XCA
and added LPI (El-Nouby et al. 2021, "XCiT", Sec. 3.1): two depthwise 3x3 convolutions over the
patch grid with GELU and BatchNorm between them. Together with
:class:`~whiteformer.layers.ClassAttentionPool` as the readout this makes TSSA a drop-in for
softmax attention (numbers in docs/results.md, "Plain ViT").
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch
import torch.nn as nn
from einops import rearrange

from .._checks import check_instance, check_positive_real, check_tokens_input, is_int
from .._utils import apply_layer_scale, layer_scale_param
from ..attention.registry import build

__all__ = ["LocalPatchInteraction", "ViTBlock"]


def _grid(grid_size, tokens: int) -> tuple:
    if not isinstance(grid_size, Sequence) or len(grid_size) != 2 or not all(is_int(v) for v in grid_size) \
            or grid_size[0] * grid_size[1] != tokens or min(grid_size) < 1:
        raise ValueError(f"grid_size must be (H, W) positive ints with H * W = {tokens} (the patch tokens), "
                         f"got {grid_size!r}")
    return tuple(grid_size)


class LocalPatchInteraction(nn.Module):
    """XCiT's local patch interaction: depthwise conv, GELU, BatchNorm, depthwise conv on the grid.

    ``forward(x, grid_size)``: x (B, H*W, C) patch tokens in row-major grid order, grid_size
    (H, W) -> (B, H*W, C). Each token is mixed with its ``kernel_size`` x ``kernel_size``
    neighbourhood (zero padding), one filter per channel: 2 C k^2 weights.
    """

    def __init__(self, dim: int, kernel_size: int = 3):
        super().__init__()
        if not is_int(kernel_size) or kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be an odd positive int, got {kernel_size!r}")
        pad = kernel_size // 2
        self.dim = dim
        self.conv1 = nn.Conv2d(dim, dim, kernel_size, padding=pad, groups=dim)
        self.act = nn.GELU()
        self.bn = nn.BatchNorm2d(dim)
        self.conv2 = nn.Conv2d(dim, dim, kernel_size, padding=pad, groups=dim)

    def forward(self, x: torch.Tensor, grid_size: Sequence[int]) -> torch.Tensor:
        check_tokens_input(x, "x", self.dim)
        h, w = _grid(grid_size, x.shape[1])
        y = rearrange(x, "b (h w) c -> b c h w", h=h, w=w)
        y = self.conv2(self.bn(self.act(self.conv1(y))))
        return rearrange(y, "b c h w -> b (h w) c")


class ViTBlock(nn.Module):
    """Pre-norm transformer block (timm ViT layout) with any registered attention.

    Args:
        dim: C. num_heads: H. attn: a name of :func:`whiteformer.attention.list_attention`
            ("tssa", "mhsa", "dmsa", "eca", ...); ``attn_kwargs`` go to its constructor.
        mlp_ratio: MLP hidden width as a multiple of C (GELU MLP).
        lpi: add :class:`LocalPatchInteraction` between attention and MLP (needs ``grid_size``).
        layer_scale: initial value of per-channel layer scales on each residual branch (None: off;
            not applied to a layer with its own learned scales, ``learned_scale = True``, e.g. ECA).
        norm_eps: LayerNorm epsilon.

    ``forward(x, attn_mask=None, grid_size=None, num_prefix_tokens=0)``: x (B, N, C) -> (B, N, C).
    ``attn_mask`` (B, N) keep-mask goes to the attention (not with ``lpi``: the convolution has no
    notion of padding). With ``lpi`` the last N - num_prefix_tokens tokens must form the
    ``grid_size`` (H, W) patch grid in row-major order; prefix tokens (e.g. [CLS]) skip the LPI.
    """

    def __init__(self, dim: int, num_heads: int = 8, attn: str = "tssa", attn_kwargs: Optional[Dict[str, Any]] = None,
                 mlp_ratio: float = 4.0, lpi: bool = False, layer_scale: Optional[float] = None,
                 norm_eps: float = 1e-6):
        super().__init__()
        check_instance(attn_kwargs, "attn_kwargs", dict, "a dict or None", optional=True)
        check_positive_real(mlp_ratio, "mlp_ratio")
        self.dim = dim
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = build(attn, dim, num_heads=num_heads, **(attn_kwargs or {}))
        self.lpi = LocalPatchInteraction(dim) if lpi else None
        self.norm3 = nn.LayerNorm(dim, eps=norm_eps) if lpi else None
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

        def scale(on: bool) -> Optional[nn.Parameter]:
            return layer_scale_param(dim, layer_scale) if on else None

        self.gamma1 = scale(not getattr(self.attn, "learned_scale", False))
        self.gamma3 = scale(lpi)
        self.gamma2 = scale(True)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                grid_size: Optional[Sequence[int]] = None, num_prefix_tokens: int = 0) -> torch.Tensor:
        """x (B, N, C) -> (B, N, C); see the class docstring for the arguments."""
        check_tokens_input(x, "x", self.dim)
        if self.lpi is not None and attn_mask is not None:
            raise ValueError("attn_mask is not supported with lpi=True (the convolution cannot skip padding)")
        if self.lpi is not None and (not is_int(num_prefix_tokens) or not 0 <= num_prefix_tokens < x.shape[1]):
            raise ValueError(f"num_prefix_tokens must be an int in [0, N), got {num_prefix_tokens!r}")
        x = x + apply_layer_scale(self.gamma1, self.attn(self.norm1(x), attn_mask=attn_mask))
        if self.lpi is not None:  # grid_size: checked by the LPI
            k = num_prefix_tokens
            local = self.lpi(self.norm3(x[:, k:]), grid_size)
            x = torch.cat([x[:, :k], x[:, k:] + apply_layer_scale(self.gamma3, local)], dim=1)
        return x + apply_layer_scale(self.gamma2, self.mlp(self.norm2(x)))
