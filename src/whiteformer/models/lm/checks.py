"""The door checks of a :class:`~whiteformer.models.lm.CausalLM`'s entry points (forward, prefill,
step, generate): token ids, keep-masks, targets, the context limit, packed documents (one rank's
checks before any collective when context-parallel)."""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..._checks import (
    check_int,
    check_integer_tensor,
    check_mask,
    check_token_ids,
)
from ..._compile import can_read_values
from ...ops.context_parallel import local_checks
from ...ops.layout import TokenLayout
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

    def _check_idx(self, idx, name: str = "idx", values: bool = True) -> None:
        check_token_ids(idx, name, self.vocab_size, allow_no_tokens=self.context_parallel_group is not None,
                        values=values)

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

    def _check_layout_len(self, layout: TokenLayout) -> None:
        """Every sequence (document) of ``layout`` within the context limit (the real tokens of a padded
        one: read once, into the layout, where the blocks find it; not while torch.compile traces)."""
        if self.context_limit is not None and (not isinstance(layout.real, torch.Tensor) or can_read_values()):
            self._check_len(layout.longest)

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

    def _check_inputs(self, idx, attn_mask, cu_seqlens, targets=None, idx_checked: bool = False) -> TokenLayout:
        """The checks of a forward's arguments -> the :class:`~whiteformer.ops.layout.TokenLayout` of its
        tokens, built once for every block. This rank's checks come before any collective
        (context-parallel: a rank failing them stops every rank of the group,
        :class:`~whiteformer.ops.context_parallel.local_checks`); the layout then exchanges the chunks'
        shapes once. ``idx_checked``: the caller (the ``transformers`` wrapper's door) checked idx already."""
        group = self.context_parallel_group
        with local_checks(group, idx):
            if not idx_checked:
                self._check_idx(idx)
            attn_mask = self._check_attn_mask(attn_mask, idx, whole=group is None)
            if targets is not None:
                self._check_targets(targets, idx)
        layout = TokenLayout.of(idx, attn_mask, cu_seqlens, group, name="idx", row="(1, T)")
        if group is not None and isinstance(layout.real, torch.Tensor) and not bool((layout.real > 0).all()):
            raise ValueError("attn_mask has a sequence without any real token on any rank (an all-False row)")
        self._check_layout_len(layout)
        return layout

    def _check_prompt_mask(self, idx: torch.Tensor, attn_mask) -> TokenLayout:
        """A prompt's layout: its keep-mask checked (bool, or None), its real tokens within the context
        limit (idx checked)."""
        layout = TokenLayout.of(idx, self._check_attn_mask(attn_mask, idx), name="idx")
        self._check_layout_len(layout)
        return layout

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
