"""Recurrent / cached inference of a :class:`~whiteformer.models.lm.CausalLM`: :meth:`prefill` runs a
prompt and returns an :class:`LMState` (one state per block: causal TSSA's constant-size running
sums, or a key/value cache), :meth:`step` feeds one token from it."""
from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Tuple, Union

import torch

from ...ops.layout import TokenLayout
from .._context_parallel import one_process

__all__ = ["LMState", "LMRecurrence"]


class LMState(NamedTuple):
    """Generation state of a :class:`CausalLM`: ``pos`` real tokens consumed (an int, or a (B,)
    integer tensor after a padded prefill: the next token's position per sequence), one state
    per block (a :class:`~whiteformer.ops.causal_tssa.CausalTSSAState` for ToST, a
    :class:`KVCache` for GPT)."""

    pos: Union[int, torch.Tensor]
    layers: Tuple[Any, ...]


class LMRecurrence:
    """:meth:`prefill` / :meth:`step` of a :class:`~whiteformer.models.lm.CausalLM`."""

    def _prefill_hidden(self, idx: torch.Tensor, layout: Optional[TokenLayout] = None
                        ) -> Tuple[torch.Tensor, LMState]:
        """:meth:`prefill` of checked arguments (``layout``: :meth:`_check_prompt_mask`'s; None: no
        padding), without the ``lm_head``: the layout is handed to every block."""
        one_process(self, "prefill / generation")
        if layout is None:
            layout = TokenLayout.of(idx, name="idx")
        x = self._embed(idx, positions=layout.positions if self.has_pos_emb else None)
        states = []
        for blk in self.transformer.h:
            x, st = blk.prefill(x, None, layout)
            states.append(st)
        return self.transformer.ln_f(x), LMState(layout.real, tuple(states))

    def prefill(self, idx: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, LMState]:
        """Run a prompt idx (B, T) (``attn_mask`` (B, T) keep-mask for a padded batch):
        ``(logits (B, T, V), state)`` to continue with :meth:`step`. Steps after a padded
        prefill continue each sequence from its own real tokens."""
        self._check_idx(idx)
        h, state = self._prefill_hidden(idx, self._check_prompt_mask(idx, attn_mask))
        return self.lm_head(h), state

    def step(self, idx_t: torch.Tensor, state: Optional[LMState] = None) -> Tuple[torch.Tensor, LMState]:
        """Feed one token per sequence, idx_t (B,) -> ``(logits (B, V), new state)``.

        ToST: constant memory and time per token; GPT: the key/value cache grows by one token.
        Raises ``ValueError`` past the context limit (see :attr:`context_limit`).
        """
        h, state = self._step_hidden(idx_t, self._check_step(idx_t, state))
        return self.lm_head(h), state

    def step_hidden_states(self, idx_t: torch.Tensor, state: Optional[LMState] = None
                           ) -> Tuple[torch.Tensor, LMState, List[torch.Tensor]]:
        """:meth:`step` with the per-block outputs of the new token: ``(final hidden after ln_f (B, D),
        new state, [embedding, block 1 output, ..., block L output])``, each (B, D) (the token's
        column of :meth:`forward_hidden_states`)."""
        states: List[torch.Tensor] = []
        h, state = self._step_hidden(idx_t, self._check_step(idx_t, state), states)
        return h, state, states

    def _step_hidden(self, idx_t: torch.Tensor, state: LMState,
                     states: Optional[List[torch.Tensor]] = None) -> Tuple[torch.Tensor, LMState]:
        """One token of checked arguments (:meth:`_check_step`) through the blocks -> ``(hidden after
        ln_f (B, D), new state)``; the embedding and each block's output are appended to ``states``
        when a list is given."""
        one_process(self, "step")
        x = self._embed(idx_t[:, None], state.pos)[:, 0]
        if states is not None:
            states.append(x)
        new = []
        for blk, st in zip(self.transformer.h, state.layers):
            x, st = blk.step(x, st)
            new.append(st)
            if states is not None:
                states.append(x)
        return self.transformer.ln_f(x), LMState(state.pos + 1, tuple(new))
