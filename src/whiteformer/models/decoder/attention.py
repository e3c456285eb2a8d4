"""Grouped-query causal softmax attention with rotary positions and a key/value cache: the
softmax layer of :class:`~whiteformer.models.decoder.DecoderLM` (Llama / Qwen2 / Mistral).

Grouped-query attention (Ainslie et al., "GQA", EMNLP 2023): ``H`` query heads share
``H_kv`` key/value heads, query head ``h`` reading key/value head ``h // (H / H_kv)``::

    q = rope(x W_q), k = rope(x W_k), v = x W_v      (H, H_kv, H_kv heads of width p)
    y = W_o concat_h softmax(q_h k_g^T / sqrt(p) + causal) v_g

Implements :class:`~whiteformer.attention.CausalAttention`: ``forward`` / ``prefill`` / ``step``.
A token's position is its index among the real tokens of its sequence (padded batches), within
its document (packed ``cu_seqlens``), or the number of real tokens in the cache (``step``). The
:class:`~whiteformer.attention.KVCache` holds the H_kv rotated keys and values (not repeated).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from ..._checks import check_instance, check_step_input
from ..._utils import zero_padded
from ...attention.causal import KVCache, causal_layout
from ...ops.baselines import _mhsa
from ...ops.layout import TokenLayout, from_padded, to_padded
from .layers import apply_rope, rope_cos_sin, rope_inv_freq

__all__ = ["RotaryCausalAttention"]


class RotaryCausalAttention(nn.Module):
    """Causal grouped-query softmax attention with RoPE and a key/value cache (see the module docstring).

    Parameters (transformers' Llama names): ``q_proj`` Linear(dim, H p), ``k_proj`` / ``v_proj``
    Linear(dim, H_kv p) (bias: ``qkv_bias``, Qwen2's), ``proj`` Linear(H p, dim) (bias:
    ``proj_bias``). ``rope_theta`` and the checked ``rope_scaling`` set the rotation frequencies.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, rope_theta: float = 10000.0,
                 rope_scaling: Optional[Dict[str, Any]] = None, qkv_bias: bool = False, proj_bias: bool = False,
                 attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        self.dim, self.num_heads, self.num_kv_heads, self.head_dim = dim, num_heads, num_kv_heads, head_dim
        self.rope_theta, self.rope_scaling = float(rope_theta), rope_scaling
        self.attn_drop = attn_drop
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.proj = nn.Linear(num_heads * head_dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, rope_theta={self.rope_theta}, rope_scaling={self.rope_scaling}")

    def _qkv(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, N, C) -> q (B, H, N, p), k and v (B, H_kv, N, p), before the rotation."""
        q = rearrange(self.q_proj(x), "b n (h d) -> b h n d", d=self.head_dim)
        k = rearrange(self.k_proj(x), "b n (h d) -> b h n d", d=self.head_dim)
        v = rearrange(self.v_proj(x), "b n (h d) -> b h n d", d=self.head_dim)
        return q, k, v

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q and k rotated to ``positions`` ((N,) or (B, N) integers)."""
        cos, sin = rope_cos_sin(positions, rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling,
                                                         q.device))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def _repeat(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, T, p) -> (B, H, T, p): each key/value head serves H / H_kv query heads in a row."""
        groups = self.num_heads // self.num_kv_heads
        return t if groups == 1 else t.repeat_interleave(groups, dim=1)

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        return self.proj_drop(self.proj(rearrange(y, "b h n d -> b n (h d)")))

    def _attend(self, q, k, v, keep: Optional[torch.Tensor]) -> torch.Tensor:
        drop = self.attn_drop if self.training else 0.0
        return _mhsa(q, self._repeat(k), self._repeat(v), keep, True, self.head_dim ** -0.5, drop)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, *,
                cu_seqlens: Optional[torch.Tensor] = None, layout: Optional[TokenLayout] = None) -> torch.Tensor:
        """x (B, N, C), attn_mask (B, N) bool keep-mask -> y (B, N, C); y[:, t] depends only on the
        real tokens of x[:, :t+1]; padded outputs are 0. ``cu_seqlens`` (S + 1,) int32: x (1, N, C)
        holds S packed documents, each attending causally within itself, positions from 0.
        ``layout``: instead of ``attn_mask`` / ``cu_seqlens``, their
        :class:`~whiteformer.ops.layout.TokenLayout` (a model's, built once for its blocks)."""
        layout = causal_layout(x, attn_mask, cu_seqlens, layout, self.dim, self.q_proj.weight)
        if not layout.packed:
            return self._prefill(x, layout)[0]
        pk = layout.packing  # documents side by side, each from 0
        q, k, v = (to_padded(t, pk) for t in self._qkv(x))
        q, k = self._rotate(q, k, torch.arange(q.shape[2], device=x.device))
        return self._out(from_padded(self._attend(q, k, v, pk.mask), pk))

    def prefill(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, *,
                layout: Optional[TokenLayout] = None) -> Tuple[torch.Tensor, KVCache]:
        """Like :meth:`forward` (without packed documents), also returning the key/value cache (rotated
        keys) of the N tokens."""
        return self._prefill(x, causal_layout(x, attn_mask, None, layout, self.dim, self.q_proj.weight))

    def _prefill(self, x: torch.Tensor, layout: TokenLayout) -> Tuple[torch.Tensor, KVCache]:
        attn_mask = layout.mask
        q, k, v = self._qkv(zero_padded(x, attn_mask))  # a padded token takes no part, NaN/inf included
        q, k = self._rotate(q, k, layout.positions[0] if attn_mask is None else layout.positions)
        y = self._out(self._attend(q, k, v, attn_mask))
        return zero_padded(y, attn_mask), KVCache(k, v, attn_mask)

    def step(self, x_t: torch.Tensor, state: Optional[KVCache] = None) -> Tuple[torch.Tensor, KVCache]:
        """One token x_t (B, C) at the next position of each sequence (0 when ``state`` is None)
        attending to the cached tokens and itself -> (y_t (B, C), cache one token longer)."""
        check_step_input(x_t, self.dim, self.q_proj.weight)
        q, k, v = self._qkv(x_t.unsqueeze(1))
        mask = None
        if state is None:
            pos = torch.zeros(1, dtype=torch.long, device=x_t.device)
        else:
            check_instance(state, "state", KVCache, "a KVCache or None")
            if state.k.shape[:2] != k.shape[:2] or state.k.shape[3] != k.shape[3]:
                raise ValueError(f"state holds keys of shape {tuple(state.k.shape)} (B, H_kv, T, p), not those of "
                                 f"x_t ({k.shape[0]}, {k.shape[1]}, T, {k.shape[3]}): a cache of another batch or layer")
            if state.mask is None:
                pos = torch.full((1,), state.k.shape[2], dtype=torch.long, device=x_t.device)
            else:
                pos = state.mask.long().sum(dim=1)[:, None]  # (B, 1): each sequence's real tokens so far
                mask = torch.cat([state.mask, state.mask.new_ones(state.mask.shape[0], 1)], dim=1)
        q, k = self._rotate(q, k, pos)
        if state is not None:
            k, v = torch.cat([state.k, k], dim=2), torch.cat([state.v, v], dim=2)
        allowed = None if mask is None else mask[:, None, None, :]
        drop = self.attn_drop if self.training else 0.0
        y = F.scaled_dot_product_attention(q, self._repeat(k), self._repeat(v), attn_mask=allowed, dropout_p=drop,
                                           scale=self.head_dim ** -0.5)
        return self._out(y)[:, 0], KVCache(k, v, mask)
