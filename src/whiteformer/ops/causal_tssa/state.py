"""The running statistics of causal TSSA (its recurrent state) and the position bias lookup."""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from ..._checks import check_instance, check_same_device, check_tensor, is_int

__all__ = ["CausalTSSAState", "check_state", "feature_scale_of", "position_logit_bias"]


class CausalTSSAState(NamedTuple):
    """Running statistics of causal TSSA after ``t`` tokens (memory independent of ``t``).

    The sums of squares are kept in units of a per-(sequence, head, feature) power of two
    ``scale`` (the scale of :mod:`whiteformer.ops.scaling`: 1 unless the largest |w_j| seen
    exceeds 2^32), so that they stay finite for any finite ``w``; ``sum_sq * scale^2`` is the sum
    in ``w``'s units.

    Fields (statistics dtype: float32 for half inputs):
        sum_sq: (B, H, p) sum_{s<t} (w_sj / scale_j)^2.
        sum_pi: (B, H) sum_{s<t} Pi_s.
        sum_sq_pi: (B, H, p) sum_{s<t} Pi_s (w_sj / scale_j)^2.
        t: number of tokens seen: an int, or a (B,) integer tensor (per-sequence counts, e.g.
           after a padded prefill); it indexes ``pos_bias`` for the next token.
        scale: (B, H, p) the power of two of the sums' units per feature, or None for 1 (sums in
            ``w``'s units). A (B, H) scale (one per head) is accepted too and taken for every
            feature (:func:`feature_scale_of`).
    """

    sum_sq: torch.Tensor
    sum_pi: torch.Tensor
    sum_sq_pi: torch.Tensor
    t: Union[int, torch.Tensor]
    scale: Optional[torch.Tensor] = None


def check_state(state, w_t: torch.Tensor) -> None:
    """``state`` continues a sequence of ``w_t`` (B, H, p): field shapes, device and ``t``."""
    check_instance(state, "state", CausalTSSAState, "a CausalTSSAState or None")
    b, h, p = w_t.shape
    for name, shape in (("sum_sq", (b, h, p)), ("sum_pi", (b, h)), ("sum_sq_pi", (b, h, p)), ("scale", (b, h, p))):
        val = getattr(state, name)
        if val is None and name == "scale":
            continue
        check_tensor(val, f"state.{name}")
        if val.shape != shape and not (name == "scale" and val.shape == (b, h)):
            also = " (or (B, H): one scale per head)" if name == "scale" else ""
            raise ValueError(f"state.{name} must have shape {shape}{also} to match w_t, got {tuple(val.shape)}")
    t = state.t
    if isinstance(t, torch.Tensor):
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.shape not in ((), (b,)):
            raise ValueError(f"state.t must be an int or an integer tensor of shape () or ({b},), got {t}")
    elif not is_int(t) or t < 0:
        raise ValueError(f"state.t must be a non-negative int or an integer tensor, got {t!r}")
    check_same_device(w_t, "w_t", **{f"state.{name}": value for name, value in zip(state._fields, state)})


def feature_scale_of(scale: Optional[torch.Tensor], p: int) -> Optional[torch.Tensor]:
    """A state's ``scale`` as (B, H, p): a (B, H) one (per head) taken for each of the ``p``
    features (the sums are then in units of it for every feature), None kept."""
    if scale is None or scale.dim() == 3:
        return scale
    return scale.unsqueeze(-1).expand(*scale.shape, p)


def position_logit_bias(
    pos_bias: torch.Tensor, p: int, n: int, attn_mask: Optional[torch.Tensor] = None,
    start: Union[int, torch.Tensor] = 0,
) -> torch.Tensor:
    """The logit bias ``p * b_t`` of ToST Eq. (39) for ``n`` tokens after ``start`` earlier ones.

    ``pos_bias`` (H, T_max, 1) is added to each of the p ratios before their sum over features (as
    the official code does), hence the factor p. A real token's position is ``start`` plus its
    index among the real tokens of its sequence (``attn_mask`` (B, n), True = real; ``start`` an
    int or a (B,) tensor). Returns (H, n) when every sequence has the same positions, else (B, H, n).
    """
    if attn_mask is None:  # a gather, not a slice: an exported graph keeps n dynamic up to T_max
        pos = torch.arange(n, device=pos_bias.device)
    else:
        pos = (attn_mask.long().cumsum(dim=-1) - 1).clamp_min(0)  # (B, n)
    if isinstance(start, torch.Tensor):
        pos = pos + start.reshape(-1, 1)
    elif start:
        pos = pos + start
    bias = pos_bias[:, pos, 0]  # (H, n) or (H, B, n)
    if bias.dim() == 3 and isinstance(start, int) and not start:
        # a row padded on the right (a packed document in its padded layout) has its tokens at
        # positions 0, 1, ... in order: there the table is broadcast over the rows, so its gradient
        # is a sum over the rows (as for rows without a mask), not accumulated row after row
        m = min(n, pos_bias.shape[1])
        in_order = pos[:, :m] == torch.arange(m, device=pos.device)
        bias = torch.cat([torch.where(in_order, pos_bias[:, None, :m, 0], bias[..., :m]), bias[..., m:]], dim=-1)
    return p * (bias.transpose(0, 1) if bias.dim() == 3 else bias)
