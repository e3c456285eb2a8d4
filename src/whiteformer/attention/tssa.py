"""TSSA and causal TSSA layers (ToST, Wu et al., ICLR 2025; Algorithms 1 and 2).

Both map (B, N, C) -> (B, N, C): one projection ``qkv`` (C -> C, despite its name it is the
single U of Eq. (31)), the operator per head, heads merged, output projection ``proj``.

Both are :class:`~whiteformer.attention.context_parallel.ContextParallel`: after
``layer.set_context_parallel(group)`` each rank of ``group`` passes its contiguous chunk of the
tokens and gets exactly its rows of the unsplit layer (positions global).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
from einops import rearrange

from .._checks import (
    check_divisible,
    check_instance,
    check_int,
    check_probability,
    check_step_input,
    check_tokens_input,
)
from .._utils import zero_padded
from ..ops.causal_tssa import CausalTSSAState
from ..ops.causal_tssa import dispatch as causal_dispatch
from ..ops.context_parallel import local_checks
from ..ops.layout import TokenLayout
from ..ops.tssa import dispatch as tssa_dispatch
from ..ops.tssa.dispatch import check_layout_alone, layout_group
from .context_parallel import ContextParallel
from .registry import register_attention

__all__ = ["TSSA", "CausalTSSA"]


def _layout(layer: nn.Module, x: torch.Tensor, attn_mask, cu_seqlens, layout: Optional[TokenLayout],
            same: int, same_name: str) -> TokenLayout:
    """A TSSA layer's checks of its input x (B, N, C) -> the layout of its tokens: the given
    ``layout`` (a model's, built once for all its blocks) or :meth:`TokenLayout.of` the arguments
    (``same``: the layer's argument that must agree over a context-parallel group, ``same_name`` it)."""
    group = layer.context_parallel_group
    split = layout_group(layout, group)
    with local_checks(split, x):  # split: a rank failing these stops every rank
        check_tokens_input(x, "x", layer.dim, like=layer.qkv.weight, allow_no_tokens=split is not None)
        if layout is not None:
            check_layout_alone(layout, x, attn_mask, cu_seqlens, None, token_dim=1, name="x")
    if layout is not None:
        return layout
    return TokenLayout.of(x, attn_mask, cu_seqlens, group, name="x", same=[same], same_name=same_name)


def _heads(qkv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, N, H p) -> w (B, H, N, p), the operator's input."""
    return rearrange(qkv, "b n (h d) -> b h n d", h=num_heads)


@register_attention("tssa")
class TSSA(ContextParallel, nn.Module):
    """Token Statistics Self-Attention layer (ToST Eq. (11); Algorithm 1).

    Parameters: ``qkv`` Linear(dim, dim, bias=qkv_bias), ``temp`` (H, 1) ones, ``proj``
    Linear(dim, dim). ``attn_drop`` is dropout on the gain 1/(1+dots), ``proj_drop`` on the output.
    ``normalize=False`` drops the l2 normalisation over tokens in the memberships (ToST Table 8).
    Official checkpoints name ``proj`` ``to_out.0``.

    What it mixes: with ``w_kn`` token n's head-k projection (``qkv``), its output is ``proj`` of
    the heads' ``-pi_kn g_k * w_kn``, where ``g_k = 1 / (1 + d_k)`` and ``d_k`` is the
    membership-weighted mean of ``w_k^2`` over the tokens (p numbers per head; the memberships use
    the per-channel l2 norms over the tokens). A token sees the others only through these
    per-channel statistics: it cannot read another token's content, so a [CLS] token learns almost
    nothing and there is no local (neighbour-to-neighbour) mixing. As a drop-in for softmax
    attention in a plain ViT it needs, around it, a content-based readout
    (:class:`~whiteformer.layers.ClassAttentionPool` instead of a [CLS] token or mean pooling)
    and a local mixer (:class:`~whiteformer.layers.LocalPatchInteraction`, XCiT's LPI; the
    ready block is :class:`~whiteformer.layers.ViTBlock` ``(attn="tssa", lpi=True)``); keep
    the position embedding and the pre-norm. The ToST models (``create_model("tost_*")``) have
    both (conv stem, class attention). docs/results.md (section 8) measures each readout and mixer.
    """

    returns_pi = True  # forward(..., return_pi=True) -> (out, {"pi": memberships, ...})

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, normalize: bool = True):
        super().__init__()
        check_instance(normalize, "normalize", bool, "a bool")
        self.normalize = normalize
        self.head_dim = check_divisible(dim, num_heads)
        self.dim, self.num_heads = dim, num_heads
        self.attn_drop = check_probability(attn_drop, "attn_drop")
        self.qkv = nn.Linear(dim, dim, bias=qkv_bias)
        self.temp = nn.Parameter(torch.ones(num_heads, 1))
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(check_probability(proj_drop, "proj_drop"))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, attn_drop={self.attn_drop}, normalize={self.normalize}"

    def no_weight_decay(self):
        return {"temp"}

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, return_pi: bool = False, *,
                cu_seqlens: Optional[torch.Tensor] = None, layout: Optional[TokenLayout] = None):
        """x (B, N, C), attn_mask (B, N) bool keep-mask -> y (B, N, C), or ``(y, {"pi": (B, H, N)})``.
        ``cu_seqlens`` (S + 1,) int32: x (1, N, C) holds S packed documents, each its own sequence
        (see :func:`whiteformer.ops.tssa`). ``layout``: instead of ``attn_mask`` / ``cu_seqlens``,
        their :class:`~whiteformer.ops.layout.TokenLayout` (a model's, built once for its blocks)."""
        drop = self.training and self.attn_drop > 0
        layout = _layout(self, x, attn_mask, cu_seqlens, layout, 2 * self.normalize + drop,
                         "cu_seqlens, normalize and attn_drop (training)")
        # padded tokens take no part: zeroed inputs (NaN/inf reach nothing), outputs 0 (not the bias)
        w = _heads(self.qkv(zero_padded(x, layout.mask)), self.num_heads)
        out, pi = tssa_dispatch.run(w, self.temp, layout=layout, return_pi=True, attn_drop=self.attn_drop,
                                    training=self.training, normalize=self.normalize)
        y = self.proj_drop(self.proj(rearrange(out, "b h n d -> b n (h d)")))
        y = zero_padded(y, layout.mask)
        return (y, {"pi": pi}) if return_pi else y


@register_attention("causal_tssa")
class CausalTSSA(ContextParallel, nn.Module):
    """Causal TSSA layer (ToST Appendix B Eq. (28), memberships Eq. (39); Algorithm 2).

    Parameters: ``qkv`` Linear(dim, dim, bias=qkv_bias), ``temp`` (H, 1) ones, ``pos_bias``
    (H, max_len, 1) zeros (None when ``pos_bias=False``; then no length limit), ``proj``
    Linear(dim, dim, bias=proj_bias). Official language checkpoints name them ``c_attn``,
    ``temp``, ``denom_bias``, ``c_proj``. ``attn_drop`` / ``proj_drop`` as the official
    ``attn_dropout`` / ``resid_dropout``.

    Implements :class:`~whiteformer.attention.CausalAttention`: :meth:`step` generates with
    constant memory; :meth:`prefill` runs a prompt and returns the state to continue from.
    """

    returns_pi = True  # forward(..., return_pi=True) -> (out, {"pi": memberships, ...})

    def __init__(self, dim: int, num_heads: int = 8, max_len: int = 1024, pos_bias: bool = True,
                 qkv_bias: bool = False, proj_bias: bool = False, attn_drop: float = 0.0,
                 proj_drop: float = 0.0):
        super().__init__()
        self.head_dim = check_divisible(dim, num_heads)
        check_int(max_len, "max_len", 1)
        self.dim, self.num_heads, self.max_len = dim, num_heads, max_len
        self.attn_drop = check_probability(attn_drop, "attn_drop")
        self.qkv = nn.Linear(dim, dim, bias=qkv_bias)
        self.temp = nn.Parameter(torch.ones(num_heads, 1))
        if pos_bias:
            self.pos_bias = nn.Parameter(torch.zeros(num_heads, max_len, 1))
        else:
            self.register_parameter("pos_bias", None)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(check_probability(proj_drop, "proj_drop"))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, max_len={self.max_len}, "
                f"pos_bias={self.pos_bias is not None}, attn_drop={self.attn_drop}")

    def no_weight_decay(self):
        return {"temp", "pos_bias"} if self.pos_bias is not None else {"temp"}

    def _run(self, x, attn_mask, cu_seqlens=None, layout: Optional[TokenLayout] = None):
        t_max = 0 if self.pos_bias is None else self.pos_bias.shape[1]
        layout = _layout(self, x, attn_mask, cu_seqlens, layout, t_max, "cu_seqlens and pos_bias (its length T_max)")
        w = _heads(self.qkv(zero_padded(x, layout.mask)), self.num_heads)
        out, pi, state = causal_dispatch.run(w, self.temp, self.pos_bias, layout=layout, return_pi=True,
                                             return_state=True, attn_drop=self.attn_drop, training=self.training)
        y = self.proj_drop(self.proj(rearrange(out, "b h n d -> b n (h d)")))
        return zero_padded(y, layout.mask), pi, state

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, return_pi: bool = False, *,
                cu_seqlens: Optional[torch.Tensor] = None, layout: Optional[TokenLayout] = None):
        """x (B, N, C) with N <= max_len (when pos_bias), attn_mask (B, N) bool keep-mask ->
        y (B, N, C), or ``(y, {"pi": (B, H, N)})``. y[:, t] depends only on x[:, :t+1].
        ``cu_seqlens`` (S + 1,) int32: x (1, N, C) holds S packed documents, each its own sequence
        with positions from 0 (see :func:`whiteformer.ops.causal_tssa`). ``layout``: instead of
        ``attn_mask`` / ``cu_seqlens``, their :class:`~whiteformer.ops.layout.TokenLayout` (a
        model's, built once for its blocks)."""
        y, pi, _ = self._run(x, attn_mask, cu_seqlens, layout)
        return (y, {"pi": pi}) if return_pi else y

    def prefill(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, *,
                cu_seqlens: Optional[torch.Tensor] = None, layout: Optional[TokenLayout] = None
                ) -> Tuple[torch.Tensor, CausalTSSAState]:
        """Like :meth:`forward`, also returning the state after the last (real) token (of this
        rank's chunk, when context-parallel; with ``cu_seqlens``: one state per document, batch S)."""
        y, _, state = self._run(x, attn_mask, cu_seqlens, layout)
        return y, state

    def step(self, x_t: torch.Tensor, state: Optional[CausalTSSAState] = None, *, check_position: bool = True
             ) -> Tuple[torch.Tensor, CausalTSSAState]:
        """One token x_t (B, C) -> (y_t (B, C), new state); memory independent of position.
        ``check_position=False``: the caller (a language model) checked the state's next position
        against ``max_len`` (after a padded prefill that is a host read, which each layer would repeat)."""
        check_step_input(x_t, self.dim, self.qkv.weight)
        if self.context_parallel_group is not None:
            raise ValueError("CausalTSSA.step runs on one process: call set_context_parallel(None) before "
                             "generating (the state of a split prefill is on the group's last rank)")
        w_t = rearrange(self.qkv(x_t), "b (h d) -> b h d", h=self.num_heads)
        out, state = causal_dispatch.run_step(w_t, state, self.temp, self.pos_bias, attn_drop=self.attn_drop,
                                              training=self.training, check_position=check_position)
        y = self.proj_drop(self.proj(rearrange(out, "b h d -> b (h d)")))
        return y, state
