"""What ``generate()`` may ask of a whiteformer language model, checked before generating.

A whiteformer model keeps its generation state in a :class:`~whiteformer.hf.cache.WhiteformerCache`
that it builds itself (ToST: constant-size running statistics; GPT: a growing key/value cache).
``transformers``' own cache options name other cache classes, which such a model never uses, so
they are refused instead of silently ignored.
"""
from __future__ import annotations

from typing import Any

import torch

from .._checks import is_int

__all__ = ["check_generation_config", "check_prompt_mask", "check_user_cache", "kept_positions",
           "refuse_cache_implementation", "refuse_continuous_batching"]

#: the ``cache_implementation`` values a whiteformer model honours (``None``: the default)
SUPPORTED_CACHE_IMPLEMENTATIONS = (None, "dynamic")


def check_generation_config(generation_config: Any) -> None:
    """``ValueError`` for the options of a resolved ``GenerationConfig`` the model cannot honour:
    ``cache_implementation`` other than ``"dynamic"`` (``"static"``, ``"offloaded"``,
    ``"quantized"``, ``"paged"``, ...) and ``prefill_chunk_size``."""
    impl = getattr(generation_config, "cache_implementation", None)
    if impl not in SUPPORTED_CACHE_IMPLEMENTATIONS:
        refuse_cache_implementation(impl)
    chunk = getattr(generation_config, "prefill_chunk_size", None)
    if chunk is not None:
        raise ValueError(f"prefill_chunk_size={chunk!r} is not supported by whiteformer models: the prompt is "
                         "prefilled in one pass (ToST's causal TSSA is linear in its length); leave it unset")


def check_user_cache(cache: Any) -> None:
    """``ValueError`` for a ``transformers`` cache passed in (``cache=`` / ``past_key_values=``) whose kind the
    model cannot honour: a ``StaticCache``, a ``QuantizedCache``, an offloading ``DynamicCache``. (A
    :class:`~whiteformer.hf.cache.WhiteformerCache` is the model's own; an empty plain ``DynamicCache`` is
    replaced by one, returned in the output.)"""
    from transformers.cache_utils import QuantizedCache, StaticCache

    if isinstance(cache, (StaticCache, QuantizedCache)) or getattr(cache, "offloading", False) is True:
        kind = f"{type(cache).__name__}{'(offloading=True)' if getattr(cache, 'offloading', False) else ''}"
        raise ValueError(f"cache={kind} is not supported by whiteformer models; pass a WhiteformerCache() "
                         "(whiteformer.hf), an empty DynamicCache or no cache")


def refuse_cache_implementation(impl: Any) -> None:
    raise ValueError(
        f"cache_implementation={impl!r} is not supported by whiteformer models; supported: 'dynamic' or unset. "
        "The model carries its own WhiteformerCache (ToST: running statistics of a constant size whatever the "
        "number of tokens, already what a static cache bounds; GPT: a key/value cache that grows per token)")


def refuse_continuous_batching() -> None:
    raise ValueError("continuous batching (generate_batch, cache_implementation='paged') is not supported by "
                     "whiteformer models: they keep a WhiteformerCache, not a paged key/value cache; call "
                     "generate() on a (left-padded) batch instead")


def check_prompt_mask(attention_mask: Any) -> None:
    """``ValueError`` for a right-padded prompt (a row whose last ``attention_mask`` column is 0):
    ``generate()`` continues every row from its last column, so such a row would continue from a pad
    token's logits (``transformers`` only warns)."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or attention_mask.shape[1] == 0:
        return
    empty = (attention_mask == 0).all(dim=1).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask: row(s) {empty} hold no real token (all 0); every prompt needs one")
    rows = (attention_mask[:, -1] == 0).nonzero().flatten().tolist()
    if rows:
        raise ValueError(f"attention_mask: row(s) {rows} end in padding (right padding); generate() continues "
                         "each row from its last column, so pad prompts on the left (tokenizer.padding_side = "
                         "'left')")


def kept_positions(hidden: torch.Tensor, logits_to_keep: Any) -> torch.Tensor:
    """The positions of ``hidden`` (B, T, D) whose logits ``transformers``' ``logits_to_keep`` asks for:
    0 every position, an int k > 0 the last k, a 1-D integer tensor those positions (``generate``
    passes 1: the prompt's (B, T, V) logits are never formed)."""
    if is_int(logits_to_keep):
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be >= 0 (0 = every position), got {logits_to_keep}")
        return hidden if logits_to_keep == 0 else hidden[:, -logits_to_keep:]
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.dim() == 1 \
            and not logits_to_keep.is_floating_point() and logits_to_keep.dtype != torch.bool:
        return hidden[:, logits_to_keep.to(hidden.device)]
    raise TypeError(f"logits_to_keep must be an int >= 0 or a 1-D integer tensor of positions, got "
                    f"{getattr(logits_to_keep, 'shape', type(logits_to_keep).__name__)}")
