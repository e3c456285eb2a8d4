"""The generation state of a whiteformer language model as a ``transformers`` ``Cache``.

:class:`WhiteformerCache` holds one :class:`~whiteformer.models.lm.LMState` (what
``CausalLM.prefill`` / ``step`` return): for ToST the running statistics of causal TSSA, per layer
``sum_sq`` (B, H, p), ``sum_pi`` (B, H), ``sum_sq_pi`` (B, H, p) and their power-of-two ``scale``
(B, H, p) -- a size independent of the
number of tokens -- and for the GPT baseline the key/value cache (B, H, T, p) that grows by one
token per step. Every tensor in the state has the batch first, so beam search reorders it with one
``index_select`` per tensor.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from transformers.cache_utils import Cache

from ..models.lm import LMState

__all__ = ["WhiteformerCache"]


def _map_batch(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor with a batch dimension in a (nested) NamedTuple/tuple state."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.dim() > 0 else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*[_map_batch(v, fn) for v in obj])
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_batch(v, fn) for v in obj)
    return obj  # ints (token counts) and None


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _tensors(v)


class WhiteformerCache(Cache):
    """Generation state of a whiteformer ``CausalLM`` for ``transformers``' ``generate()``.

    ``state``: the :class:`~whiteformer.models.lm.LMState` (None before the prompt);
    ``seq_length``: the number of input positions consumed, padding included (what
    ``get_seq_length`` reports to ``generate``).
    """

    is_compileable = False

    def __init__(self, state: Optional[LMState] = None, seq_length: int = 0):
        super().__init__(layers=[])
        self.state = state
        self.seq_length = int(seq_length)

    def __repr__(self) -> str:
        return f"WhiteformerCache(seq_length={self.seq_length}, bytes={self.nbytes()})"

    def update_state(self, state: LMState, new_tokens: int) -> None:
        self.state = state
        self.seq_length += int(new_tokens)

    def nbytes(self) -> int:
        """Memory held by the state (bytes): constant in the number of tokens for ToST."""
        return sum(t.numel() * t.element_size() for t in _tensors(self.state))

    # ---- what generate() asks -----------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seq_length

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self.seq_length + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.seq_length

    @property
    def batch_size(self) -> int:
        first = next(_tensors(self.state), None)
        return -1 if first is None else first.shape[0]

    @property
    def is_initialized(self) -> bool:
        return self.state is not None

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_sliding(self):
        return []

    @property
    def is_linear(self):
        # not [] (all([]) is True): generate() skips, for caches that are all linear-attention layers, the
        # slicing of a prompt that restarts from a filled cache to its uncached tokens; this cache counts
        # its positions (get_seq_length), so the prompt is sliced as for any other cache
        return [False]

    @property
    def is_dummy(self):
        return []

    def reset(self) -> None:
        self.state, self.seq_length = None, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: keep the states of the beams ``beam_idx`` (B,)."""
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.state = _map_batch(self.state, lambda t: t.index_select(0, indices.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.state = _map_batch(self.state, lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("a whiteformer cache cannot be cropped (ToST's running statistics cannot forget "
                             "tokens); assisted / speculative decoding is not supported")
