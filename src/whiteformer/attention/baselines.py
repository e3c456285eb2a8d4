"""Baseline attention layers with the timm contract: ``(B, N, C)`` in and out, ``forward(x, attn_mask=None)``.

Parameter names and layouts follow the official implementations so their checkpoints load unchanged:

* :class:`MHSA` -- timm ``Attention`` (``qkv`` (3C, C), ``proj``; qkv output read as (B, N, 3, H, p));
* :class:`XCA` -- XCiT ``XCA`` (``temperature`` (H, 1, 1), ``qkv``, ``proj``);
* :class:`MSSA` -- CRATE ``Attention`` (``qkv`` (H*dim_head, C) without bias, ``to_out.0``);
* :class:`ClassAttention` -- CaiT/XCiT ``ClassAttention`` (``qkv`` (3C, C), ``proj``), as in ToST's
  ``cls_attn_blocks.i.attn``.

With an ``attn_mask`` (B, N) keep-mask, padded tokens are zeroed before the projections (NaN/inf
held there reaches nothing), excluded as keys, and the outputs at padded positions are 0
(ClassAttention passes tokens 1: through unchanged, padded or not).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from .._checks import check_divisible, check_tokens_input
from .._dtypes import stats_dtype
from .._utils import zero_padded
from ..ops.baselines import _class_attention, _mhsa, _mhsa_explicit, _xca
from ..ops.context_parallel import local_checks
from .context_parallel import ContextParallel
from .registry import register_attention

__all__ = ["MHSA", "XCA", "MSSA", "ClassAttention"]


def _split_qkv(qkv: torch.Tensor, heads: int):
    """(B, N, 3C) -> q, k, v each (B, H, N, p); the timm/XCiT layout ``reshape(B, N, 3, H, p)``."""
    return rearrange(qkv, "b n (three h p) -> three b h n p", three=3, h=heads).unbind(0)


@register_attention("mhsa")
class MHSA(nn.Module):
    """Multi-head softmax self-attention, a drop-in for timm's ``vision_transformer.Attention``.

    ``y = proj(softmax(q k^T / sqrt(p)) v)`` per head (Vaswani et al. 2017, Eq. 1), through
    ``F.scaled_dot_product_attention`` (or explicit matmuls when ``fused_attn = False``, e.g. for
    FLOP counting).

    Args:
        dim: channels C; num_heads: H (C must be divisible by H), head dim p = C / H.
        qkv_bias: bias of ``qkv``; qk_norm: LayerNorm (``norm_layer``) on q and k per head, as timm.
        attn_drop, proj_drop: dropout on the attention weights / the output.
        causal: token i attends to j <= i only (GPT baseline); combines with ``attn_mask``.
    Shapes: x (B, N, C) -> (B, N, C).
    """

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, causal: bool = False,
                 norm_layer=nn.LayerNorm):
        super().__init__()
        self.head_dim = check_divisible(dim, num_heads)
        self.dim, self.num_heads, self.causal = dim, num_heads, bool(causal)
        self.scale = self.head_dim ** -0.5
        self.fused_attn = True
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, attn_mask=None) -> torch.Tensor:
        """x (B, N, C), attn_mask (B, N) bool keep-mask (True = real token; padded keys are
        excluded, combined with ``causal``) -> y (B, N, C), 0 at padded tokens."""
        keep = check_tokens_input(x, "x", self.dim, like=self.qkv.weight, attn_mask=attn_mask)
        q, k, v = _split_qkv(self.qkv(zero_padded(x, keep)), self.num_heads)
        q, k = self.q_norm(q), self.k_norm(k)
        op = _mhsa if self.fused_attn else _mhsa_explicit  # the layer checked x and the mask
        drop = self.attn_drop.p if self.training else 0.0
        y = op(q, k, v, keep, self.causal, self.scale, drop)
        y = self.proj_drop(self.proj(rearrange(y, "b h n p -> b n (h p)")))
        return zero_padded(y, keep)


@register_attention("xca")
class XCA(nn.Module):
    """Cross-covariance attention of XCiT (El-Nouby et al. 2021), parameter names as the official code.

    Per head, with q, k l2-normalised along the tokens: ``A = softmax(q_hat^T k_hat * temperature)``
    (p x p), ``y = proj(v A^T)``. ``temperature`` (H, 1, 1) is learnable, initialised to 1 and excluded
    from weight decay (:meth:`no_weight_decay`).
    Shapes: x (B, N, C) -> (B, N, C).
    """

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False,
                 attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        self.head_dim = check_divisible(dim, num_heads)
        self.dim, self.num_heads = dim, num_heads
        self.temperature = nn.Parameter(torch.ones(num_heads, 1, 1))
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, attn_mask=None) -> torch.Tensor:
        """x (B, N, C), attn_mask (B, N) bool keep-mask (True = real token; padded tokens are left
        out of the p x p cross-covariance) -> y (B, N, C), 0 at padded tokens."""
        keep = check_tokens_input(x, "x", self.dim, like=self.qkv.weight, attn_mask=attn_mask)
        q, k, v = _split_qkv(self.qkv(zero_padded(x, keep)), self.num_heads)
        drop = self.attn_drop.p if self.training else 0.0
        y = _xca(q, k, v, self.temperature.to(stats_dtype(q)), keep, drop)
        y = self.proj_drop(self.proj(rearrange(y, "b h n p -> b n (h p)")))
        return zero_padded(y, keep)

    @torch.jit.ignore
    def no_weight_decay(self):
        return {"temperature"}


@register_attention("mssa")
class MSSA(nn.Module):
    """Multi-head subspace self-attention of CRATE (Yu et al. 2023), parameter names as the official
    ``model/crate.py``: one shared projection ``qkv`` (no bias) and ``to_out = [Linear, Dropout]``.

    ``w = qkv(x)`` split into heads; ``y = to_out(softmax(w w^T * dim_head^-1/2) w)``.
    As in the official code, ``to_out`` is the identity when ``num_heads == 1`` and ``dim_head == dim``.

    Args:
        dim: channels C; num_heads: H; dim_head: head dim p (default C / H, which must then divide).
        attn_drop, proj_drop: dropout on the attention weights / the output (CRATE uses one rate
            for both).
    Shapes: x (B, N, C) -> (B, N, C).
    """

    shell_options = ("attn_drop", "proj_drop")  # one shared projection, no bias

    def __init__(self, dim: int, num_heads: int = 8, dim_head: int | None = None,
                 attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        if dim_head is None:
            dim_head = check_divisible(dim, num_heads)
        else:  # an explicit head dim: only positivity is required (inner dim H * dim_head != dim allowed)
            check_divisible(dim, 1)
            check_divisible(dim_head, 1, "dim_head")
            check_divisible(num_heads, 1, "num_heads")
        self.dim, self.num_heads, self.dim_head = dim, num_heads, dim_head
        self.scale = dim_head ** -0.5
        inner = num_heads * dim_head
        self.qkv = nn.Linear(dim, inner, bias=False)
        self.attn_drop = nn.Dropout(attn_drop)
        if num_heads == 1 and dim_head == dim:
            self.to_out = nn.Identity()
        else:
            self.to_out = nn.Sequential(nn.Linear(inner, dim), nn.Dropout(proj_drop))

    def forward(self, x: torch.Tensor, attn_mask=None) -> torch.Tensor:
        """x (B, N, C), attn_mask (B, N) bool keep-mask (True = real token; padded keys are
        excluded) -> y (B, N, C), 0 at padded tokens."""
        keep = check_tokens_input(x, "x", self.dim, like=self.qkv.weight, attn_mask=attn_mask)
        w = rearrange(self.qkv(zero_padded(x, keep)), "b n (h p) -> b h n p", h=self.num_heads)
        drop = self.attn_drop.p if self.training else 0.0
        y = _mhsa(w, w, w, keep, False, self.scale, drop)
        y = self.to_out(rearrange(y, "b h n p -> b n (h p)"))
        return zero_padded(y, keep)


@register_attention("class_attention")
class ClassAttention(ContextParallel, nn.Module):
    """Class attention of CaiT/XCiT (used by ToST's head): only the class token (token 0) queries.

    ``cls' = proj(softmax(q_0 k^T / sqrt(p)) v)`` over all N tokens; the output is
    ``cat([cls', x[:, 1:]])``: tokens 1: are passed through unchanged (a padded token's output is 0,
    as for every layer). Not a token mixer.
    Parameter names as XCiT/ToST: ``qkv`` (3C, C) (bias ``qkv_bias``), ``proj`` (C, C) with bias.
    Shapes: x (B, N, C) -> (B, N, C). Context-parallel (``set_context_parallel(group)``): x is the
    class token followed by this rank's chunk of the tokens; the class token's output is the
    unsplit one on every rank.
    """

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False,
                 attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        self.head_dim = check_divisible(dim, num_heads)
        self.dim, self.num_heads = dim, num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, attn_mask=None) -> torch.Tensor:
        """x (B, N, C) with the class token at index 0, attn_mask (B, N) bool keep-mask (padded
        keys excluded) -> (B, N, C): the updated class token, tokens 1: unchanged (0 at padded tokens)."""
        group = self.context_parallel_group
        with local_checks(group, x):  # split: a rank failing these stops every rank
            keep = check_tokens_input(x, "x", self.dim, like=self.qkv.weight, attn_mask=attn_mask)
            if group is not None and keep is not None:
                raise ValueError("class_attention with a group takes no attn_mask")
        C = self.dim
        x = zero_padded(x, keep)  # padded tokens take no part, and their output is 0 (NaN included)
        # Only the class token needs a query: project it with the q rows of qkv, all tokens with k, v.
        w, b = self.qkv.weight, self.qkv.bias
        q = F.linear(x[:, :1], w[:C], None if b is None else b[:C])
        kv = F.linear(x, w[C:], None if b is None else b[C:])
        q = rearrange(q, "b n (h p) -> b h n p", h=self.num_heads)
        k, v = rearrange(kv, "b n (two h p) -> two b h n p", two=2, h=self.num_heads).unbind(0)
        drop = self.attn_drop.p if self.training else 0.0
        cls = _class_attention(q, k, v, keep, self.scale, drop, group)
        cls = self.proj_drop(self.proj(rearrange(cls, "b h n p -> b n (h p)")))
        if keep is not None:
            cls = zero_padded(cls, keep[:, :1])
        return torch.cat([cls, x[:, 1:]], dim=1)
