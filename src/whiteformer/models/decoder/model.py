"""A Llama-style decoder language model whose layers are softmax attention, causal TSSA, or a mix.

Shell (transformers' ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and ``MistralForCausalLM``): token
embedding ``wte`` (tied to ``lm_head`` or not), pre-norm blocks without layer scale::

    x = x + attn(ln_1(x))          # ln_1, ln_2, ln_f: RMSNorm
    x = x + mlp(ln_2(x))           # mlp: SwiGLU, down(silu(gate(x)) * up(x))

then ``ln_f`` and ``lm_head``; no position embedding (positions enter through the rotary
embedding of the softmax layers). Each block's attention is one of

- softmax: :class:`~whiteformer.models.decoder.attention.RotaryCausalAttention`, grouped-query
  heads with RoPE (``rope_theta``, ``rope_scaling``) and a key/value cache growing with the tokens;
- causal TSSA: :class:`~whiteformer.attention.CausalTSSA` (ToST, Wu et al., ICLR 2025, Appendix B
  Eq. (28)), ``num_heads`` heads of width ``dim / num_heads``, no position bias (no length limit),
  whose generation state has a constant size.

``attention="softmax"`` makes every layer softmax (what :func:`whiteformer.convert.from_transformers`
imports); ``attention="tssa"`` makes every layer causal TSSA except those listed in
``keep_softmax`` (a hybrid: only they keep a key/value cache).

The forward pass, loss (``loss_chunk`` included), packed ``cu_seqlens`` batches, ``prefill`` /
``step`` / ``generate`` and ``save_pretrained`` are those of :class:`~whiteformer.models.lm.CausalLM`.
``max_len`` (None: unlimited) is the context limit that :meth:`forward` and ``generate`` enforce
(generation crops past it as nanoGPT does).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence

import torch
import torch.nn as nn

from ..._checks import (
    check_choice,
    check_divisible,
    check_instance,
    check_int,
    check_keep_softmax,
    check_positive_real,
    check_probability,
)
from ...attention.context_parallel import ContextParallel
from ...attention.tssa import CausalTSSA
from ..lm import CausalLM, PreNormBlock
from ..registry import build_with_defaults, register_model
from .attention import RotaryCausalAttention
from .layers import RMSNorm, SwiGLU, check_rope_scaling

__all__ = ["DecoderBlock", "DecoderLM", "ATTENTION_KINDS"]

#: the values of DecoderLM's ``attention`` argument
ATTENTION_KINDS = ("softmax", "tssa")


class DecoderBlock(PreNormBlock):
    """Pre-norm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))`` (RMSNorm, SwiGLU)."""

    def __init__(self, dim: int, attn: nn.Module, hidden: int, eps: float, mlp_bias: bool = False,
                 drop: float = 0.0):
        super().__init__()
        self.ln_1 = RMSNorm(dim, eps)
        self.attn = attn
        self.ln_2 = RMSNorm(dim, eps)
        self.mlp = SwiGLU(dim, hidden, bias=mlp_bias, drop=drop)

    def _finish(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        x = x + h
        return x + self.mlp(self.ln_2(x))


class DecoderLM(CausalLM):
    """Llama-style decoder language model, softmax, causal TSSA or a hybrid (see the module docstring).

    Args:
        vocab_size, dim, depth: vocabulary, width, number of blocks.
        num_heads: query heads (and the causal TSSA layers' heads); ``num_kv_heads`` key/value heads
            of the softmax layers (None: ``num_heads``; must divide it); ``head_dim`` their width
            (None: ``dim / num_heads``).
        intermediate_size: the SwiGLU's hidden width.
        max_len: context limit (None: none).
        rope_theta, rope_scaling: the rotary embedding (``rope_scaling`` None or a dict with
            ``rope_type`` "default", "linear" or "llama3" and its parameters).
        norm_eps: RMSNorm's epsilon. tie_embeddings: ``lm_head`` shares ``wte``'s weight.
        qkv_bias, proj_bias, mlp_bias: biases of the attention's input and output projections and of the MLP.
        attention: "softmax" or "tssa"; keep_softmax: with "tssa", the layers that stay softmax.
        dropout: of the embeddings, attention, residual branches.
        eos_token_id: where ``generate`` stops by default (None: it runs to ``max_new_tokens``).
    """

    hf_model_type = "whiteformer-decoder"
    length_free_kwargs = {"max_len": None}

    def __init__(self, vocab_size: int = 32000, dim: int = 768, depth: int = 12, num_heads: int = 12,
                 num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None, intermediate_size: int = 2048,
                 max_len: Optional[int] = None, rope_theta: float = 10000.0,
                 rope_scaling: Optional[Dict[str, Any]] = None, norm_eps: float = 1e-6, tie_embeddings: bool = True,
                 qkv_bias: bool = False, proj_bias: bool = False, mlp_bias: bool = False, attention: str = "softmax",
                 keep_softmax: Optional[Sequence[int]] = None, dropout: float = 0.0,
                 eos_token_id: Optional[int] = None):
        nn.Module.__init__(self)  # the modules below replace the GPT shell's (CausalLM only lends its methods)
        check_int(vocab_size, "vocab_size", 1)
        self.eos_token_id = self._check_eos(eos_token_id, vocab_size) if eos_token_id is not None else None
        check_int(depth, "depth", 0)
        check_int(intermediate_size, "intermediate_size", 1)
        check_divisible(dim, num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else check_int(num_kv_heads, "num_kv_heads", 1)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        head_dim = dim // num_heads if head_dim is None else check_int(head_dim, "head_dim", 2)
        if head_dim % 2:
            raise ValueError(f"head_dim must be even (the rotary embedding pairs channels), got {head_dim}")
        if max_len is not None:
            check_int(max_len, "max_len", 1)
        check_choice(attention, "attention", ATTENTION_KINDS)
        for name, flag in (("tie_embeddings", tie_embeddings), ("qkv_bias", qkv_bias), ("proj_bias", proj_bias),
                           ("mlp_bias", mlp_bias)):
            check_instance(flag, name, bool, "a bool")
        self.keep_softmax = check_keep_softmax(keep_softmax, depth, attention)
        self.rope_theta = check_positive_real(rope_theta, "rope_theta")
        self.rope_scaling = check_rope_scaling(rope_scaling)
        self.norm_eps = check_positive_real(norm_eps, "norm_eps")
        self.dropout = check_probability(dropout, "dropout")
        self.vocab_size, self.dim, self.depth, self.num_heads = vocab_size, dim, depth, num_heads
        self.num_kv_heads, self.head_dim, self.max_len, self.attention = num_kv_heads, head_dim, max_len, attention
        self.has_pos_emb, self.bias, self.tie_embeddings = False, qkv_bias, tie_embeddings
        self.qkv_bias, self.proj_bias = qkv_bias, proj_bias
        self.num_features = self.embed_dim = dim

        blocks = [DecoderBlock(dim, self._make_attn(i), intermediate_size, self.norm_eps, mlp_bias, dropout)
                  for i in range(depth)]
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab_size, dim), drop=nn.Dropout(dropout),
                                              h=nn.ModuleList(blocks), ln_f=RMSNorm(dim, self.norm_eps)))
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        if tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight
        self._init_weights(depth)

    def is_softmax(self, i: int) -> bool:
        """Whether block ``i``'s attention is softmax (else causal TSSA)."""
        return self.attention == "softmax" or i in self.keep_softmax

    def _make_attn(self, i: int) -> nn.Module:
        if self.is_softmax(i):
            return RotaryCausalAttention(self.dim, self.num_heads, self.num_kv_heads, self.head_dim,
                                         self.rope_theta, self.rope_scaling, self.qkv_bias, self.proj_bias,
                                         self.dropout, self.dropout)
        return CausalTSSA(self.dim, num_heads=self.num_heads, pos_bias=False, qkv_bias=self.qkv_bias,
                          proj_bias=self.proj_bias, attn_drop=self.dropout, proj_drop=self.dropout)

    def _attn_len_limit(self) -> Optional[int]:
        return self.max_len

    def _init_weights(self, depth: int) -> None:
        """normal(0, 0.02) for the Linear / Embedding weights, ``0.02 / sqrt(2 L)`` for the residual
        output projections (``attn.proj``, ``mlp.down_proj``), zero biases, unit RMSNorm gains."""
        proj_std = 0.02 / math.sqrt(2 * max(depth, 1))
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=proj_std if name.endswith(("attn.proj", "mlp.down_proj")) else 0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)

    def check_context_parallel(self) -> None:
        for i, blk in enumerate(self.transformer.h):
            if not isinstance(blk.attn, ContextParallel):
                raise ValueError(f"DecoderLM cannot run context-parallel: block {i} is softmax attention, which "
                                 "would need ring attention; only an all-TSSA model (attention='tssa', no "
                                 "keep_softmax) splits exactly")

    def convert_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Own keys only (:func:`whiteformer.convert.from_transformers` maps transformers' layouts);
        with tied embeddings a missing ``lm_head.weight`` or ``transformer.wte.weight`` is the other."""
        out = dict(state_dict)
        if self.tie_embeddings:
            for a, b in (("lm_head.weight", "transformer.wte.weight"), ("transformer.wte.weight", "lm_head.weight")):
                if a not in out and b in out:
                    out[a] = out[b]
        return out


_SIZES = dict(base=dict(dim=768, depth=12, num_heads=12, num_kv_heads=4, intermediate_size=2048))


@register_model
def decoder_base(**kwargs) -> DecoderLM:
    """Llama-style decoder, softmax attention: 12 layers, 12 query / 4 key-value heads, D 768, SwiGLU 2048."""
    return build_with_defaults(DecoderLM, _SIZES["base"], kwargs)


@register_model
def tost_decoder_base(**kwargs) -> DecoderLM:
    """The same decoder with causal TSSA in every layer (``keep_softmax``: the layers that stay softmax)."""
    return build_with_defaults(DecoderLM, {**_SIZES["base"], "attention": "tssa"}, kwargs)
