"""Causal language models in a nanoGPT-derived shell: causal ToST (causal TSSA) and its
softmax-attention GPT baseline (ToST, Wu et al., ICLR 2025, Section 5 / Appendix B).

Shell (as the official ``tost_lang/model_TSSA.py``): token embedding ``wte`` tied to ``lm_head``,
learned position embedding ``wpe`` (``max_len`` rows, optional), pre-LN blocks with layer scale::

    x = x + gamma1 * attn(ln_1(x))
    x = x + gamma2 * mlp(ln_2(x))          # mlp: c_fc (D -> 4D), GELU, c_proj (4D -> D)

then ``ln_f`` and ``lm_head``. No biases by default (LayerNorms without bias, as nanoGPT
``bias=False``). Init: normal(0, 0.02) for Linear/Embedding, ``0.02 / sqrt(2 L)`` for the two
residual output projections, layer scale ``init_values`` = 1e-5.

Keys follow nanoGPT (``transformer.wte``, ``transformer.h.{i}.ln_1``, ...), except the attention
parameters, which use the layer names ``qkv`` / ``proj`` / ``pos_bias`` (official ``c_attn`` /
``c_proj`` / ``denom_bias``; :meth:`CausalLM.convert_state_dict` renames them).

Generation: ToST keeps the constant-size recurrent state of causal TSSA (constant memory and
time per token); GPT keeps a key/value cache. A model built with ``eos_token_id`` (a run trained by
``whiteformer train`` records its data's end-of-document id there) stops each sequence at that token,
as ``transformers``' ``generate`` does.

Context parallelism (ToST only): after ``model.set_context_parallel(group)`` each rank of the
``torch.distributed`` group passes its contiguous chunk of every sequence (rank order = sequence
order, chunks may differ in length) to :meth:`CausalLM.forward`; positions are global, each rank
gets its rows of the logits, and the loss is the mean over all ranks' targets (the same value on
every rank). Its backward gives each rank ``R`` times its share of the parameter gradient
(``R`` the group size), so the *mean* of the gradients over the group (what
DistributedDataParallel does) is the unsplit gradient.
"""
from __future__ import annotations

from ...attention.causal import CausalAttention, CausalSelfAttention, KVCache  # noqa: F401
from ...attention.tssa import CausalTSSA  # noqa: F401
from .blocks import MLP_ACTS, LMBlock, LMMlp, PreNormBlock  # noqa: F401
from .generation import MIN_TEMPERATURE, MODEL_EOS, check_temperature, until_eos  # noqa: F401
from .model import GPTLM, CausalLM, ToSTLM, gpt_base, gpt_large, gpt_medium, tost_lm_base, tost_lm_large, tost_lm_medium  # noqa: F401
from .step import LMState  # noqa: F401

__all__ = ["CausalLM", "ToSTLM", "GPTLM", "CausalSelfAttention", "KVCache", "LMState", "MIN_TEMPERATURE",
           "MODEL_EOS", "check_temperature", "until_eos"]
