"""One generation step of a causal ToST language model as a module of plain tensors, for export.

:meth:`CausalLM.step` carries an :class:`~whiteformer.models.lm.LMState` (Python objects); an
exported graph (``torch.export``, ONNX) takes and returns tensors only. :class:`LMStep` lays the
constant-size state of causal TSSA (ToST Eq. (28), memberships Eq. (39)) out as explicit inputs
and outputs::

    logits, next_pos, *next_state = LMStep(model)(idx_t, pos, *state)

with ``idx_t`` (B,) the current token, ``pos`` (B,) int64 the number of tokens each sequence has
consumed (its next position), and per block ``sum_sq`` (B, H, p), ``sum_pi`` (B, H),
``sum_sq_pi`` (B, H, p) and ``scale`` (B, H, p) (float32 for half models; the sums of squares are
in units of the power of two per feature ``scale``, see :class:`~whiteformer.ops.CausalTSSAState`),
in block order. Memory and time per token are
independent of the position; a GPT's key/value cache grows each token, so it has no such step.

Example (ONNX Runtime runs the loop)::

    step = LMStep(model).eval()
    idx_t, pos, *state = step.example_inputs(batch_size=2)
    torch.onnx.export(step, (idx_t, pos, *state), "step.onnx", dynamo=True,
                      input_names=step.input_names(), output_names=step.output_names(),
                      dynamic_shapes=step.dynamic_shapes())
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn as nn
from torch.export import Dim

from .._checks import check_instance
from .._dtypes import stats_dtype
from ..attention.tssa import CausalTSSA
from ..ops.causal_tssa import CausalTSSAState
from .lm import CausalLM, LMState

__all__ = ["LMStep"]

_FIELDS = ("sum_sq", "sum_pi", "sum_sq_pi", "scale")
_N = len(_FIELDS)  # state tensors per block


class LMStep(nn.Module):
    """:meth:`CausalLM.step` of a ToST language model with its state as tensors (see the module
    docstring). Shares the model's parameters; call ``.eval()`` on it (or the model) before export."""

    def __init__(self, model: CausalLM):
        super().__init__()
        check_instance(model, "model", CausalLM, "a CausalLM (whiteformer language model)")
        kinds = {type(blk.attn).__name__ for blk in model.transformer.h if not isinstance(blk.attn, CausalTSSA)}
        if kinds:
            raise TypeError(f"LMStep needs causal TSSA in every block (a constant-size state); this model has "
                            f"{', '.join(sorted(kinds))}, whose key/value cache grows each token")
        self.model = model

    def _heads(self) -> Tuple[int, int]:
        return self.model.num_heads, self.model.dim // self.model.num_heads

    def forward(self, idx_t: torch.Tensor, pos: torch.Tensor, *state: torch.Tensor):
        """idx_t (B,) tokens, pos (B,) int64 positions, the 4 * depth state tensors -> ``(logits
        (B, V), pos + 1, *new state)``."""
        depth = self.model.depth
        if len(state) != _N * depth:
            raise ValueError(f"expected {_N * depth} state tensors ({', '.join(_FIELDS)} for each of "
                             f"{depth} blocks), got {len(state)}")
        if not isinstance(pos, torch.Tensor) or pos.dim() != 1:
            raise ValueError(f"pos must be a (B,) integer tensor, got {getattr(pos, 'shape', type(pos).__name__)}")
        layers = tuple(CausalTSSAState(*state[_N * i:_N * i + 3], pos, state[_N * i + 3]) for i in range(depth))
        logits, new = self.model.step(idx_t, LMState(pos, layers))
        return (logits, new.pos, *self.state_tensors(new))

    @staticmethod
    def state_tensors(state: LMState) -> List[torch.Tensor]:
        """An :class:`LMState` (e.g. from the model's ``prefill``) -> its 4 * depth tensors in this
        module's input order (:meth:`state_names`): a prompt's state continued by the exported step."""
        return [t for layer in state.layers for t in (*layer[:3], layer.scale)]

    def example_inputs(self, batch_size: int = 1, device: Optional[torch.device] = None) -> Tuple[torch.Tensor, ...]:
        """The inputs of the first step: token 0, position 0, zero state (the state before any token)."""
        param = self.model.lm_head.weight
        device = param.device if device is None else device
        sd = stats_dtype(param)
        heads, p = self._heads()
        idx = torch.zeros(batch_size, dtype=torch.long, device=device)
        pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        state = []
        for _ in range(self.model.depth):
            state += [torch.zeros(batch_size, heads, p, dtype=sd, device=device),
                      torch.zeros(batch_size, heads, dtype=sd, device=device),
                      torch.zeros(batch_size, heads, p, dtype=sd, device=device),
                      torch.ones(batch_size, heads, p, dtype=sd, device=device)]
        return (idx, pos, *state)

    def state_names(self) -> List[str]:
        """``block{i}.{sum_sq, sum_pi, sum_sq_pi, scale}`` in input order."""
        return [f"block{i}.{f}" for i in range(self.model.depth) for f in _FIELDS]

    def input_names(self) -> List[str]:
        return ["idx", "pos", *self.state_names()]

    def output_names(self) -> List[str]:
        return ["logits", "next_pos", *(f"next.{n}" for n in self.state_names())]

    def dynamic_shapes(self, max_batch: Optional[int] = None) -> Tuple:
        """``dynamic_shapes`` for ``torch.export`` / ``torch.onnx.export(dynamo=True)``: the batch
        dimension of every input is dynamic (the state, ``*state`` of :meth:`forward`, is one entry)."""
        batch = {0: Dim("B", max=max_batch) if max_batch else Dim("B")}
        return (batch, batch, tuple(batch for _ in range(_N * self.model.depth)))
