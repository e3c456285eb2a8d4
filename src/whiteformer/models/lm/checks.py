"""The door checks of a :class:`~whiteformer.models.lm.CausalLM`'s entry points (forward, prefill,
step, generate): token ids, keep-masks, targets, the context limit, packed documents (one rank's
checks before any collective when context-parallel)."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from ..._checks import (
    check_cu_seqlens,
    check_int,
    check_integer_tensor,
    check_mask,
    check_token_ids,
)
from ..._compile import can_read_values
from ...ops.context_parallel import chunk_layout, local_checks
from ...ops.packing import segment_positions, split_cu_seqlens
from .step import LMState

__all__ = ["LMInputChecks"]


class LMInputChecks:
    """The argument checks of a :class:`~whiteformer.models.lm.CausalLM` (see the module docstring)."""

    @staticmethod
    def _check_eos(eos_token_id, vocab_size: int) -> int:
        check_int(eos_token_id, "eos_token_id", 0)
        if eos_token_id >= vocab_size:
            raise ValueError(f"eos_token_id must be a token id in [0, {vocab_size - 1}] (vocab_size {vocab_size}), "
                             f"got {eos_token_id}")
        return int(eos_token_id)

    def _check_idx(self, idx, name: str = "idx") -> None:
        check_token_ids(idx, name, self.vocab_size, allow_no_tokens=self.context_parallel_group is not None)

    def _check_attn_mask(self, attn_mask, idx: torch.Tensor, whole: bool = True) -> Optional[torch.Tensor]:
        """A (B, T) keep-mask (bool, or 0/1 integers as in ``transformers``) -> bool or None;
        every sequence needs at least one real token (``whole=False``: checked by the caller)."""
        if attn_mask is None:
            return None
        attn_mask = check_mask(attn_mask, idx.shape[0], idx.shape[1], device=idx.device)
        if whole and can_read_values() and not bool(attn_mask.any(dim=1).all()):
            raise ValueError("attn_mask has a sequence without any real token (an all-False row)")
        return attn_mask

    def _check_len(self, t: Union[int, torch.Tensor]) -> None:
        if isinstance(t, torch.Tensor):
            if not can_read_values():
                return
            t = int(t.max())
        limit = self.context_limit
        if limit is not None and t > limit:
            raise ValueError(f"sequence length {t} exceeds the model's context limit {limit} (max_len; build the "
                             f"model with {self._length_free_hint()} to remove it)")

    def _check_targets(self, targets, idx: torch.Tensor) -> None:
        if not isinstance(targets, torch.Tensor) or targets.shape != idx.shape:
            raise ValueError(f"targets must be a tensor of shape {tuple(idx.shape)}, got "
                             f"{getattr(targets, 'shape', type(targets).__name__)}")
        check_integer_tensor(targets, "targets", "an integer tensor of token ids")
        if can_read_values():
            bad = (targets != -1) & ((targets < 0) | (targets >= self.vocab_size))
            if bool(bad.any()):
                hint = " (-100 is transformers' ignore index; here it is -1)" if bool((targets == -100).any()) else ""
                raise ValueError(f"targets hold token ids outside [0, {self.vocab_size - 1}] (-1 = ignored): "
                                 f"{sorted(set(targets[bad].tolist()))[:5]}{hint}")

    def _check_inputs(self, idx, attn_mask, cu_seqlens, targets=None, idx_checked: bool = False
                      ) -> Tuple[Optional[torch.Tensor], List[int]]:
        """This rank's checks of a forward's arguments, before any collective (context-parallel: a
        rank failing them stops every rank of the group, :class:`~whiteformer.ops.context_parallel.local_checks`).
        Returns the bool attn_mask and, for packed documents split over the group, the fingerprint of
        ``cu_seqlens`` (:func:`~whiteformer.ops.packing.split_cu_seqlens`) that the ranks compare.
        ``idx_checked``: the caller (the ``transformers`` wrapper's door) checked idx already."""
        group = self.context_parallel_group
        with local_checks(group, idx):
            if not idx_checked:
                self._check_idx(idx)
            attn_mask = self._check_attn_mask(attn_mask, idx, whole=group is None)
            if targets is not None:
                self._check_targets(targets, idx)
            if cu_seqlens is None:
                return attn_mask, []
            if idx.shape[0] != 1 or attn_mask is not None:
                raise ValueError(f"with cu_seqlens, idx must hold the packed documents in one row (1, T) and "
                                 f"attn_mask must be None; got idx of shape {tuple(idx.shape)}")
            if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device != idx.device:
                raise ValueError(f"cu_seqlens must be on idx's device ({idx.device}), got {cu_seqlens.device}")
            return attn_mask, [] if group is None else split_cu_seqlens(cu_seqlens)

    def _packed_positions(self, idx: torch.Tensor, cu_seqlens, fingerprint: Sequence[int]) -> torch.Tensor:
        """Packed documents (checked by :meth:`_check_inputs`), each within the context limit: the
        (1, T) positions within the documents (context-parallel: idx is this rank's chunk of the row
        that ``cu_seqlens`` describes)."""
        start, total = self._row_span(idx, fingerprint)
        lengths = check_cu_seqlens(cu_seqlens, total)
        self._check_len(max(lengths))
        return segment_positions(cu_seqlens, lengths, idx.device)[None, start:start + idx.shape[1]]

    def _row_span(self, idx: torch.Tensor, fingerprint: Sequence[int] = ()) -> Tuple[int, int]:
        """(first token's index in the whole row, the row's length): this rank's chunk when
        context-parallel (``fingerprint``: of the ``cu_seqlens``, checked equal on every rank), else (0, T)."""
        group = self.context_parallel_group
        if group is None:
            return 0, idx.shape[1]
        start, total, _ = chunk_layout(idx, group, name="idx", token_dim=1, same=fingerprint, same_name="cu_seqlens")
        return start, total

    def _check_prompt_mask(self, idx: torch.Tensor, attn_mask) -> Optional[torch.Tensor]:
        """A prompt's keep-mask (bool, or None), its real tokens within the context limit (idx checked)."""
        attn_mask = self._check_attn_mask(attn_mask, idx)
        self._check_len(self._real_len(idx, attn_mask))
        return attn_mask

    def _check_step(self, idx_t, state) -> LMState:
        """:meth:`step`'s arguments: idx_t (B,) token ids and a state (:meth:`_check_state`), returned."""
        check_token_ids(idx_t, "idx_t", self.vocab_size, "(B,)", ndim=1)
        return self._check_state(state)

    def _check_state(self, state) -> LMState:
        """An LMState of this model (None: a new one) whose next position is within the context limit."""
        if state is None:
            state = LMState(0, (None,) * self.depth)
        elif not isinstance(state, LMState) or len(state.layers) != self.depth:
            raise TypeError(f"state must be an LMState with {self.depth} layer states (from prefill/step) or None")
        self._check_len(state.pos + 1)
        return state
