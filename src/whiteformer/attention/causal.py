"""Causal attention layers for generation: the prefill/step protocol they share, and the softmax
(GPT) baseline with its key/value cache.

:class:`CausalAttention` is what a language model's block needs of its attention: ``forward``
(timm's contract, causal), ``prefill`` (the same, plus the state after the last real token) and
``step`` (one token and the state -> its output and the next state). Two layers implement it:
:class:`~whiteformer.attention.CausalTSSA` (ToST's causal TSSA: a constant-size state of running
statistics, constant memory per generated token) and :class:`CausalSelfAttention` here (a
:class:`KVCache` that grows with the tokens seen). ``prefill`` then ``step`` reproduces ``forward``
token for token (tests/attention/test_causal.py).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol, Tuple, runtime_checkable

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from .._checks import (
    check_divisible,
    check_instance,
    check_probability,
    check_step_input,
    check_tokens_input,
)
from .._utils import zero_padded
from ..ops.baselines import _mhsa, _mhsa_explicit
from ..ops.layout import TokenLayout, from_padded, to_padded
from ..ops.tssa.dispatch import check_layout_alone
from .registry import register_attention

__all__ = ["CausalAttention", "CausalSelfAttention", "KVCache"]


@runtime_checkable
class CausalAttention(Protocol):
    """The generation protocol of a causal attention layer (x (B, N, C), x_t (B, C)).

    - ``forward(x, attn_mask=None) -> y``: y[:, t] depends only on the real tokens of x[:, :t+1];
    - ``prefill(x, attn_mask=None) -> (y, state)``: as ``forward``, plus the state after the last
      real token of each sequence;
    - ``step(x_t, state=None) -> (y_t, state)``: the next token (``state=None``: the first one).
    """

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> Any: ...

    def prefill(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Any]: ...

    def step(self, x_t: torch.Tensor, state: Any = None) -> Tuple[torch.Tensor, Any]: ...


class KVCache(NamedTuple):
    """Keys and values of the tokens seen so far: k, v of shape (B, H, T, p); ``mask`` (B, T)
    bool keep-mask of those tokens (None: all real), from a padded prefill."""

    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor] = None


def causal_layout(x: torch.Tensor, attn_mask, cu_seqlens, layout: Optional[TokenLayout], dim: int,
                  like: torch.Tensor) -> TokenLayout:
    """A causal layer's checks of its input x (B, N, C) (C == ``dim``, on the device and in the dtype
    of ``like``, one of its weights) -> the layout of its tokens: the given ``layout`` (a model's,
    built once for all its blocks) or :meth:`TokenLayout.of` ``attn_mask`` / ``cu_seqlens``."""
    check_tokens_input(x, "x", dim, like=like)
    if layout is None:
        return TokenLayout.of(x, attn_mask, cu_seqlens, name="x")
    check_layout_alone(layout, x, attn_mask, cu_seqlens, None, token_dim=1, name="x")
    return layout


@register_attention("causal_mhsa")
class CausalSelfAttention(nn.Module):
    """Causal softmax multi-head attention with a key/value cache (GPT baseline); implements
    :class:`CausalAttention` (its state is a :class:`KVCache`, growing with the tokens seen).

    ``qkv``: Linear(dim, 3 dim) with output layout (3, H, p) (as timm / nanoGPT ``c_attn``),
    ``proj``: Linear(dim, dim) (nanoGPT ``c_proj``). ``softmax(q k^T / sqrt(p) + causal) v``.

    ``fused_attn`` (timm's attribute, default True): :func:`whiteformer.ops.mhsa` (SDPA); False:
    :func:`whiteformer.ops.mhsa_explicit`, the (B, H, N, N) scores and their softmax formed
    explicitly with float32 statistics (nanoGPT's slow path, the baseline of benchmarks that compare
    against "explicit softmax", the same as :class:`~whiteformer.attention.MHSA`'s).
    """

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, proj_bias: bool = False,
                 attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        self.head_dim = check_divisible(dim, num_heads)
        self.dim, self.num_heads = dim, num_heads
        self.attn_drop = check_probability(attn_drop, "attn_drop")
        self.fused_attn = True
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(check_probability(proj_drop, "proj_drop"))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, attn_drop={self.attn_drop}"

    def _qkv(self, x: torch.Tensor):
        q, k, v = rearrange(self.qkv(x), "b n (s h d) -> s b h n d", s=3, h=self.num_heads)
        return q, k, v

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        return self.proj_drop(self.proj(rearrange(y, "b h n d -> b n (h d)")))

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, *,
                cu_seqlens: Optional[torch.Tensor] = None, layout: Optional[TokenLayout] = None) -> torch.Tensor:
        """x (B, N, C), attn_mask (B, N) bool keep-mask -> y (B, N, C); y[:, t] depends only on
        the real tokens of x[:, :t+1]; padded outputs are 0. ``cu_seqlens`` (S + 1,) int32: x
        (1, N, C) holds S packed documents, each attending causally within itself only (a
        block-diagonal causal mask). ``layout``: instead of ``attn_mask`` / ``cu_seqlens``, their
        :class:`~whiteformer.ops.layout.TokenLayout` (a model's, built once for its blocks)."""
        layout = causal_layout(x, attn_mask, cu_seqlens, layout, self.dim, self.qkv.weight)
        if not layout.packed:
            return self._prefill(x, layout.mask)[0]
        pk = layout.packing
        q, k, v = (to_padded(t, pk) for t in self._qkv(x))
        return self._out(from_padded(self._attend(q, k, v, pk.mask), pk))

    def prefill(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, *,
                layout: Optional[TokenLayout] = None) -> Tuple[torch.Tensor, KVCache]:
        """Like :meth:`forward` (without packed documents), also returning the key/value cache of the N tokens."""
        return self._prefill(x, causal_layout(x, attn_mask, None, layout, self.dim, self.qkv.weight).mask)

    def _prefill(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, KVCache]:
        q, k, v = self._qkv(zero_padded(x, attn_mask))  # a padded token takes no part, NaN/inf included
        y = self._out(self._attend(q, k, v, attn_mask))
        return zero_padded(y, attn_mask), KVCache(k, v, attn_mask)

    def _attend(self, q, k, v, attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Causal softmax attention of (B, H, N, p) heads through the ops: :func:`whiteformer.ops.mhsa`
        (SDPA) or, with ``fused_attn = False``, :func:`whiteformer.ops.mhsa_explicit` (the (B, H, N, N)
        scores formed, float32 statistics under half precision)."""
        op = _mhsa if self.fused_attn else _mhsa_explicit  # the layer checked x and the mask
        return op(q, k, v, attn_mask, True, q.shape[-1] ** -0.5, self.attn_drop if self.training else 0.0)

    def step(self, x_t: torch.Tensor, state: Optional[KVCache] = None) -> Tuple[torch.Tensor, KVCache]:
        """One token x_t (B, C) attending to the cached tokens and itself -> (y_t (B, C), cache)."""
        check_step_input(x_t, self.dim, self.qkv.weight)
        q, k, v = self._qkv(x_t.unsqueeze(1))
        mask = None
        if state is not None:
            check_instance(state, "state", KVCache, "a KVCache or None")
            if state.k.shape[0] != k.shape[0] or state.k.shape[1] != k.shape[1] or state.k.shape[3] != k.shape[3]:
                raise ValueError(f"state holds keys of shape {tuple(state.k.shape)} (B, H, T, p), not those of x_t "
                                 f"({k.shape[0]}, {k.shape[1]}, T, {k.shape[3]}): a cache of another batch or layer")
            k, v = torch.cat([state.k, k], dim=2), torch.cat([state.v, v], dim=2)
            if state.mask is not None:
                mask = torch.cat([state.mask, state.mask.new_ones(state.mask.shape[0], 1)], dim=1)
        drop = self.attn_drop if self.training else 0.0
        allowed = None if mask is None else mask[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=drop)
        return self._out(y)[:, 0], KVCache(k, v, mask)
