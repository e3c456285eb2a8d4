"""DMSA layer (Liu et al., DMST paper, Eq. (18); Appendix B Algorithm 1 ``AttentionDMSA``).

(B, N, C) -> (B, N, C): the full space ``qkv`` (C -> C; the S of Sec. III, split into heads),
membership logits ``membership`` (C -> H, no bias) of the rotary-encoded input, the operator
:func:`whiteformer.ops.dmsa`, heads merged, output projection ``proj``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from einops import rearrange

from .._checks import check_divisible, check_positive_real, check_probability, check_tokens_input
from .._utils import zero_padded
from ..ops.dmsa import _dmsa_torch, check_dmsa_options
from ..ops.rotary import _rotary
from .registry import register_attention

__all__ = ["DMSA"]


@register_attention("dmsa")
class DMSA(nn.Module):
    """Decoupled Membership-Subspace Attention layer (DMST paper Eq. (18); Algorithm 1).

    Parameters: ``qkv`` Linear(dim, dim, bias=qkv_bias) (the full space S; ``qkv`` in the
    official pseudocode), ``membership`` Linear(dim, num_heads, bias=False) (``PI_linear``),
    ``proj`` Linear(dim, dim) (``to_out.0``). No temperature: Algorithm 1 has none.

    ``sparsity`` / ``activation`` / ``mode`` / ``gate_activation`` select the paper's ablations
    (see :mod:`whiteformer.ops.dmsa`). ``attn_drop`` is dropout on the gain 1/(1+dots),
    ``proj_drop`` on the output. ``dim`` must be even (rotary encoding over the full width,
    LLaMA layout, base ``rope_base``). Unlike Algorithm 1's precomputed table (4096 positions),
    the angles are computed for any length.
    """

    returns_pi = True  # forward(..., return_pi=True) -> (out, {"pi": memberships, ...})

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, sparsity: str = "heads", activation: str = "sigmoid",
                 mode: str = "membership", gate_activation: str = "sparsemax", rope_base: float = 10000.0):
        super().__init__()
        self.head_dim = check_divisible(dim, num_heads)
        if dim % 2 != 0:
            raise ValueError(f"dim must be even for the rotary encoding of the membership input, got {dim}")
        check_dmsa_options(sparsity, activation, mode, gate_activation)
        check_positive_real(rope_base, "rope_base")
        self.dim, self.num_heads = dim, num_heads
        self.sparsity, self.activation, self.mode = sparsity, activation, mode
        self.gate_activation, self.rope_base = gate_activation, float(rope_base)
        self.attn_drop = check_probability(attn_drop, "attn_drop")
        self.qkv = nn.Linear(dim, dim, bias=qkv_bias)
        self.membership = nn.Linear(dim, num_heads, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(check_probability(proj_drop, "proj_drop"))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, sparsity={self.sparsity!r}, "
                f"activation={self.activation!r}, mode={self.mode!r}, gate_activation={self.gate_activation!r}, "
                f"attn_drop={self.attn_drop}")

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, return_pi: bool = False):
        """x (B, N, C), attn_mask (B, N) bool keep-mask -> y (B, N, C), or with ``return_pi``
        ``(y, {"pi": (B, H, N), "gate": (B, H)})``.

        Under a mask, the rotary position of a real token is its rank among the real tokens
        (0..n-1; with right padding simply its index) and padded outputs are 0, so each real token
        gets the result of its sequence alone.
        """
        attn_mask = check_tokens_input(x, "x", self.dim, like=self.qkv.weight, attn_mask=attn_mask)
        x = zero_padded(x, attn_mask)  # padded tokens take no part (NaN/inf there reach nothing)
        s = rearrange(self.qkv(x), "b n (h d) -> b h n d", h=self.num_heads)
        positions = None if attn_mask is None else (attn_mask.long().cumsum(dim=1) - 1).clamp_min(0)
        logits = self.membership(_rotary(x, self.rope_base, positions))  # (B, N, H)
        # the ops on arguments checked here and in __init__
        out, pi, gate = _dmsa_torch(s, logits, attn_mask, self.sparsity, self.activation, self.mode,
                                    self.gate_activation, self.attn_drop if self.training else 0.0)
        stats = {"pi": pi, "gate": gate}
        y = self.proj_drop(self.proj(rearrange(out, "b h n d -> b n (h d)")))
        y = zero_padded(y, attn_mask)  # padded outputs are 0, not the bias
        return (y, stats) if return_pi else y
