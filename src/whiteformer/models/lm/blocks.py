"""The blocks of the language models' shells: nanoGPT's MLP and pre-norm block with layer scale
(``x + gamma1 * attn(ln_1(x))``, ``x + gamma2 * mlp(ln_2(x))``), and the pre-norm passes over a
causal attention layer (forward, prefill, step) that the decoder's block shares."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn as nn

from ..._utils import apply_layer_scale, layer_scale_param
from ...attention.causal import CausalAttention
from ...attention.tssa import CausalTSSA
from ...ops.layout import TokenLayout

__all__ = ["MLP_ACTS", "LMMlp", "PreNormBlock", "LMBlock"]

#: the MLP activations of the GPT shell: exact GELU (nanoGPT), its tanh approximation (GPT-2's ``gelu_new``)
MLP_ACTS = {"gelu": "none", "gelu_tanh": "tanh"}


class LMMlp(nn.Module):
    """nanoGPT MLP: ``c_fc`` (D -> hidden), GELU (exact, or ``act="gelu_tanh"``: the tanh
    approximation of GPT-2), ``c_proj`` (hidden -> D), dropout."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, drop: float = 0.0, act: str = "gelu"):
        super().__init__()
        self.c_fc = nn.Linear(dim, hidden, bias=bias)
        self.act = nn.GELU(approximate=MLP_ACTS[act])
        self.c_proj = nn.Linear(hidden, dim, bias=bias)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.act(self.c_fc(x))))


class PreNormBlock(nn.Module):
    """A pre-norm block's passes over its ``ln_1`` and causal ``attn``; the subclass's ``_finish(x, h)``
    adds the attention update ``h`` and the MLP branch."""

    def _finish(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, layout: Optional[TokenLayout] = None) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D); ``layout``: the model's :class:`~whiteformer.ops.layout.TokenLayout`
        of the tokens (instead of ``attn_mask`` / ``cu_seqlens``)."""
        if layout is not None:
            return self._finish(x, self.attn(self.ln_1(x), layout=layout))
        packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        return self._finish(x, self.attn(self.ln_1(x), attn_mask, **packed))

    def prefill(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                layout: Optional[TokenLayout] = None) -> Tuple[torch.Tensor, Any]:
        h, state = (self.attn.prefill(self.ln_1(x), attn_mask) if layout is None
                    else self.attn.prefill(self.ln_1(x), layout=layout))
        return self._finish(x, h), state

    def step(self, x_t: torch.Tensor, state: Any) -> Tuple[torch.Tensor, Any]:
        """One token; the model checked the state's position against its context limit (``max_len``)."""
        checked = {"check_position": False} if isinstance(self.attn, CausalTSSA) else {}
        h, state = self.attn.step(self.ln_1(x_t), state, **checked)
        return self._finish(x_t, h), state


class LMBlock(PreNormBlock):
    """Pre-LN block with layer scale: ``x + gamma1 * attn(ln_1(x))``, ``x + gamma2 * mlp(ln_2(x))``."""

    def __init__(self, dim: int, attn: CausalAttention, mlp_ratio: float = 4.0, bias: bool = False,
                 drop: float = 0.0, init_values: float = 1e-5, act: str = "gelu"):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-5, bias=bias)
        self.attn = attn
        self.ln_2 = nn.LayerNorm(dim, eps=1e-5, bias=bias)
        self.mlp = LMMlp(dim, int(dim * mlp_ratio), bias=bias, drop=drop, act=act)
        self.gamma1 = layer_scale_param(dim, init_values)
        self.gamma2 = layer_scale_param(dim, init_values)

    def _finish(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        x = x + apply_layer_scale(self.gamma1, h)
        return x + apply_layer_scale(self.gamma2, self.mlp(self.ln_2(x)))
