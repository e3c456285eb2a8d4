"""Causal ToST in the GPT shell, softmax attention kept in chosen blocks: the student of a GPT-2 /
``gpt_*`` teacher linearized by :func:`whiteformer.convert.linearize`.

The shell is :class:`~whiteformer.models.lm.CausalLM`'s (token + learned position embeddings,
pre-LN blocks with layer scale, LayerNorm, GELU MLP, tied head), as :class:`~whiteformer.models.lm.GPTLM`
with ``mlp_act`` (``"gelu_tanh"``: GPT-2's ``gelu_new``). Every block's attention is
:class:`~whiteformer.attention.tssa.CausalTSSA` (ToST, Wu et al., ICLR 2025, Appendix B Eq. (28):
a constant-size generation state) except the blocks in ``keep_softmax``, which keep GPT's
:class:`~whiteformer.attention.causal.CausalSelfAttention` (and only they a key/value cache).
Parameter names are the GPT shell's (``transformer.h.{i}.attn.qkv`` / ``proj``), so the teacher's
embeddings, norms, MLPs and kept layers load unchanged.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch.nn as nn

from .._checks import check_keep_softmax
from ..attention.causal import CausalSelfAttention
from ..attention.tssa import CausalTSSA
from .lm import CausalLM
from .registry import build_with_defaults, register_model

__all__ = ["HybridGPTLM"]


class HybridGPTLM(CausalLM):
    """The GPT shell with causal TSSA in every block but ``keep_softmax`` (see the module docstring).

    Args: those of :class:`~whiteformer.models.lm.GPTLM` (``mlp_act`` included) and of
    :class:`~whiteformer.models.lm.ToSTLM` (``pos_bias``: TSSA's per-position membership bias),
    plus ``keep_softmax``: the blocks (indices) that keep softmax attention. Shapes as
    :class:`~whiteformer.models.lm.CausalLM`: idx (B, T) -> logits (B, T, V).
    """

    hf_model_type = "whiteformer-tost-lm"
    length_free_kwargs = {"pos_emb": False, "pos_bias": False}

    def __init__(self, vocab_size: int = 50304, dim: int = 768, depth: int = 12, num_heads: int = 12,
                 max_len: int = 1024, pos_emb: bool = True, pos_bias: bool = True, mlp_ratio: float = 4.0,
                 bias: bool = False, dropout: float = 0.0, init_values: float = 1e-5, mlp_act: str = "gelu",
                 keep_softmax: Optional[Sequence[int]] = None, eos_token_id: Optional[int] = None):
        keep = check_keep_softmax(keep_softmax, depth, "tssa")
        super().__init__(vocab_size, dim, depth, num_heads, max_len, pos_emb, mlp_ratio, bias, dropout, init_values,
                         mlp_act, eos_token_id=eos_token_id, pos_bias=bool(pos_bias), keep_softmax=keep)
        self.keep_softmax = keep

    def is_softmax(self, i: int) -> bool:
        """Whether block ``i``'s attention is softmax (else causal TSSA)."""
        return i in self._attn_opts["keep_softmax"]

    def _make_attn(self, i: int) -> nn.Module:
        if self.is_softmax(i):
            return CausalSelfAttention(self.dim, num_heads=self.num_heads, qkv_bias=self.bias, proj_bias=self.bias,
                                       attn_drop=self.dropout, proj_drop=self.dropout)
        return CausalTSSA(self.dim, num_heads=self.num_heads, max_len=self.max_len,
                          pos_bias=self._attn_opts["pos_bias"], qkv_bias=self.bias, proj_bias=self.bias,
                          attn_drop=self.dropout, proj_drop=self.dropout)

    def _attn_len_limit(self) -> Optional[int]:
        return self.max_len if self._attn_opts["pos_bias"] else None


@register_model
def tost_gpt_base(**kwargs) -> HybridGPTLM:
    """Causal ToST in the GPT shell with GPT-2 base dims (12/12/768); ``keep_softmax``: softmax blocks."""
    return build_with_defaults(HybridGPTLM, dict(dim=768, depth=12, num_heads=12), kwargs)
