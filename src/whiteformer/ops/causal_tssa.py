"""Causal TSSA (ToST, Wu et al., ICLR 2025, Appendix B Eq. (28) with the memberships of
Appendix C.1 Eq. (39); Algorithm 2 and the official language model).

For each head, with w of shape (N, p) and prefix sums over tokens s <= t:

    ratio_t = w_t^2 / max(sum_{s<=t} w_s^2, 1e-12)                       (Eq. 35, squared)
    Pi_t    = softmax_heads( temp * (sum_p ratio_t + p * b_t) )          (Eq. 39, b = pos_bias)
    dots_t  = sum_{s<=t} Pi_s w_s^2 / (sum_{s<=t} Pi_s + 1e-8)
    out_t   = -(w_t * Pi_t) / (1 + dots_t)                                (Eq. 28)

The bias ``pos_bias`` (H, T_max, 1) is added to every feature's ratio before the sum over p, as
the official code does, hence ``+ p * b_t``. ``out_t`` depends only on tokens ``<= t``.

:func:`causal_tssa_step` runs the same recurrence one token at a time with a constant-size
:class:`CausalTSSAState` (running sums), for generation.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .._checks import autocast_off, check_mask, check_nonempty, check_tensor, stats_dtype
from .tssa import PI_EPS, _check_drop, _check_heads_input, _check_temp
from .tssa_fused import causal_tssa_fused, fused_supported

__all__ = ["CausalTSSAState", "causal_tssa", "causal_tssa_step"]

RATIO_EPS = 1e-12  # clamp on the prefix energy sum_{s<=t} w_s^2 (official code)


class CausalTSSAState(NamedTuple):
    """Running statistics of causal TSSA after ``t`` tokens (memory independent of ``t``).

    Fields (statistics dtype: float32 for half inputs):
        sum_sq: (B, H, p) sum_{s<t} w_s^2.
        sum_pi: (B, H) sum_{s<t} Pi_s.
        sum_sq_pi: (B, H, p) sum_{s<t} Pi_s w_s^2.
        t: number of tokens seen: an int, or a (B,) integer tensor (per-sequence counts, e.g.
           after a padded prefill); it indexes ``pos_bias`` for the next token.
    """

    sum_sq: torch.Tensor
    sum_pi: torch.Tensor
    sum_sq_pi: torch.Tensor
    t: Union[int, torch.Tensor]


def _check_pos_bias(pos_bias, heads: int) -> None:
    if pos_bias is None:
        return
    check_tensor(pos_bias, "pos_bias", 3)
    if pos_bias.shape[0] != heads or pos_bias.shape[2] != 1 or pos_bias.shape[1] == 0:
        raise ValueError(
            f"pos_bias must have shape (H, T_max, 1) with H = {heads} and T_max >= 1, "
            f"got {tuple(pos_bias.shape)}"
        )


def causal_tssa(
    w: torch.Tensor,
    temp: torch.Tensor,
    pos_bias: Optional[torch.Tensor] = None,
    attn_mask: Optional[torch.Tensor] = None,
    return_pi: bool = False,
    *,
    return_state: bool = False,
    attn_drop: float = 0.0,
    training: bool = False,
):
    """Causal Token Statistics Self-Attention (ToST Eq. (28) with memberships Eq. (39)).

    Args:
        w: (B, H, N, p) projected tokens per head.
        temp: (H, 1) temperature.
        pos_bias: optional (H, T_max, 1) per-head, per-position bias on the membership logits
            (zeros at init). ``N > T_max`` raises ``ValueError``; ``None`` has no length limit.
        attn_mask: optional (B, N) bool keep-mask (True = real token). Padded tokens are left
            out of all cumulative statistics and their outputs (and Pi) are 0; a real token's
            position (for ``pos_bias``) is its index among the real tokens of its sequence, so
            each real token gets the result of its sequence alone (left or right padding).
        return_pi: also return Pi (B, H, N).
        return_state: also return the :class:`CausalTSSAState` after the last token (to
            continue with :func:`causal_tssa_step`); with a mask, ``t`` is the (B,) count of
            real tokens.
        attn_drop: dropout probability on the gain ``1 / (1 + dots)`` (official code).
        training: dropout is applied only when True.

    Returns:
        out (B, H, N, p) in ``w``'s dtype, or a tuple ``(out, [pi], [state])`` in that order.
    """
    _check_heads_input(w)
    heads, n = w.shape[1], w.shape[2]
    _check_temp(temp, heads)
    _check_pos_bias(pos_bias, heads)
    if pos_bias is not None and n > pos_bias.shape[1]:
        raise ValueError(
            f"sequence length N = {n} exceeds the positional bias table length T_max = "
            f"{pos_bias.shape[1]} (pos_bias has shape {tuple(pos_bias.shape)})"
        )
    attn_mask = check_mask(attn_mask, w.shape[0], n)
    _check_drop(attn_drop)
    out, pi, state = _causal_tssa_forward(w, temp, pos_bias, attn_mask, float(attn_drop) if training else 0.0)
    if not (return_pi or return_state):
        return out
    res = (out,)
    if return_pi:
        res += (pi,)
    if return_state:
        res += (state,)
    return res


def _causal_tssa_forward(w, temp, pos_bias, attn_mask, drop_p):
    """Single dispatch point (inputs validated): the fused kernel (:mod:`.tssa_fused`) when it
    supports ``w`` and there is no dropout, else the pure-PyTorch path
    (``WHITEFORMER_DISABLE_KERNELS=1`` forces the latter)."""
    if drop_p == 0.0 and fused_supported(w):
        n, p = w.shape[-2], w.shape[-1]
        bias = None
        if pos_bias is not None:
            if attn_mask is None:
                bias = p * pos_bias[:, :n, 0]  # (H, N)
            else:
                pos = (attn_mask.long().cumsum(dim=-1) - 1).clamp_min(0)  # (B, N)
                bias = p * pos_bias[:, pos, 0].transpose(0, 1)  # (B, H, N)
        out, pi, sum_sq, sum_pi, sum_sq_pi = causal_tssa_fused(w, temp, bias, attn_mask)
        t = n if attn_mask is None else attn_mask.long().sum(dim=-1)
        sd = stats_dtype(w)
        state = CausalTSSAState(sum_sq.to(sd), sum_pi.to(sd), sum_sq_pi.to(sd), t)
        return out, pi, state
    return _causal_tssa_torch(w, temp, pos_bias, attn_mask, drop_p)


def _causal_tssa_torch(
    w: torch.Tensor,
    temp: torch.Tensor,
    pos_bias: Optional[torch.Tensor],
    attn_mask: Optional[torch.Tensor],
    drop_p: float,
) -> Tuple[torch.Tensor, torch.Tensor, CausalTSSAState]:
    """Pure-PyTorch causal TSSA with prefix sums; returns (out, pi, final state)."""
    sd = stats_dtype(w)
    p, n = w.shape[-1], w.shape[-2]
    with autocast_off(w):
        x = w.to(sd)
        if attn_mask is not None:
            x = x.masked_fill(~attn_mask[:, None, :, None], 0.0)
        x2 = x * x
        energy = x2.cumsum(dim=-2)  # (B, H, N, p)
        logits = (x2 / energy.clamp_min(RATIO_EPS)).sum(dim=-1)  # (B, H, N)
        if pos_bias is not None:
            if attn_mask is None:
                bias = pos_bias[:, :n, 0].to(sd)  # (H, N)
            else:
                pos = (attn_mask.long().cumsum(dim=-1) - 1).clamp_min(0)  # (B, N)
                bias = pos_bias[:, pos, 0].to(sd).transpose(0, 1)  # (B, H, N)
            # the bias is added to each of the p ratios before the sum over features
            logits = logits + p * bias
        pi = torch.softmax(logits * temp.to(sd), dim=1)
        if attn_mask is not None:
            pi = pi.masked_fill(~attn_mask[:, None, :], 0.0)
        sq_pi = (x2 * pi.unsqueeze(-1)).cumsum(dim=-2)  # (B, H, N, p)
        mass = pi.cumsum(dim=-1)  # (B, H, N)
        gain = (1.0 + sq_pi / (mass + PI_EPS).unsqueeze(-1)).reciprocal()
        if drop_p > 0.0:
            gain = F.dropout(gain, p=drop_p, training=True)
        out = -(x * pi.unsqueeze(-1)) * gain
        t = n if attn_mask is None else attn_mask.long().sum(dim=-1)
        state = CausalTSSAState(energy[:, :, -1], mass[:, :, -1], sq_pi[:, :, -1], t)
    return out.to(w.dtype), pi.to(w.dtype), state


def _check_state(state: CausalTSSAState, b: int, h: int, p: int) -> None:
    if not isinstance(state, CausalTSSAState):
        raise TypeError(f"state must be a CausalTSSAState or None, got {type(state).__name__}")
    for name, shape in (("sum_sq", (b, h, p)), ("sum_pi", (b, h)), ("sum_sq_pi", (b, h, p))):
        val = getattr(state, name)
        check_tensor(val, f"state.{name}")
        if val.shape != shape:
            raise ValueError(f"state.{name} must have shape {shape} to match w_t, got {tuple(val.shape)}")
    t = state.t
    if isinstance(t, torch.Tensor):
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.shape not in ((), (b,)):
            raise ValueError(f"state.t must be an int or an integer tensor of shape () or ({b},), got {t}")
    elif isinstance(t, bool) or not isinstance(t, int) or t < 0:
        raise ValueError(f"state.t must be a non-negative int or an integer tensor, got {t!r}")


def causal_tssa_step(
    w_t: torch.Tensor,
    state: Optional[CausalTSSAState],
    temp: torch.Tensor,
    pos_bias: Optional[torch.Tensor] = None,
    *,
    return_pi: bool = False,
    attn_drop: float = 0.0,
    training: bool = False,
):
    """One step of causal TSSA (recurrent form of :func:`causal_tssa`, same equations).

    Args:
        w_t: (B, H, p) the projected current token.
        state: :class:`CausalTSSAState` of the previous tokens, or None to start.
        temp: (H, 1) temperature.
        pos_bias: optional (H, T_max, 1); raises ``ValueError`` once ``t`` reaches ``T_max``.
        return_pi: also return pi_t (B, H).

    Returns:
        ``(out_t, new_state)`` (or ``(out_t, pi_t, new_state)``) with out_t (B, H, p) in
        ``w_t``'s dtype. Stepping through a sequence reproduces :func:`causal_tssa`.
    """
    check_tensor(w_t, "w_t", 3)
    check_nonempty(w_t, "w_t", 1, "heads")
    check_nonempty(w_t, "w_t", 2, "features (head dim p)")
    b, h, p = w_t.shape
    _check_temp(temp, h)
    _check_pos_bias(pos_bias, h)
    _check_drop(attn_drop)
    sd = stats_dtype(w_t)
    if state is None:
        zeros = torch.zeros(b, h, p, dtype=sd, device=w_t.device)
        state = CausalTSSAState(zeros, torch.zeros(b, h, dtype=sd, device=w_t.device), zeros, 0)
    else:
        _check_state(state, b, h, p)
    t = state.t
    if pos_bias is not None:
        t_max = pos_bias.shape[1]
        too_long = bool((t >= t_max).any()) if isinstance(t, torch.Tensor) else t >= t_max
        if too_long:
            raise ValueError(
                f"position t = {t} reached the positional bias table length T_max = {t_max}; "
                f"causal TSSA with pos_bias cannot go past T_max tokens"
            )
    with autocast_off(w_t):
        x = w_t.to(sd)
        x2 = x * x
        sum_sq = state.sum_sq.to(sd) + x2
        logits = (x2 / sum_sq.clamp_min(RATIO_EPS)).sum(dim=-1)  # (B, H)
        if pos_bias is not None:
            bias = pos_bias[:, t, 0].to(sd)  # (H,) or (H, B)
            logits = logits + p * (bias.transpose(0, 1) if bias.dim() == 2 else bias)
        pi = torch.softmax(logits * temp.to(sd)[:, 0], dim=1)  # (B, H)
        sum_pi = state.sum_pi.to(sd) + pi
        sum_sq_pi = state.sum_sq_pi.to(sd) + x2 * pi.unsqueeze(-1)
        gain = (1.0 + sum_sq_pi / (sum_pi + PI_EPS).unsqueeze(-1)).reciprocal()
        if training and attn_drop > 0.0:
            gain = F.dropout(gain, p=float(attn_drop), training=True)
        out = -(x * pi.unsqueeze(-1)) * gain
    new_state = CausalTSSAState(sum_sq, sum_pi, sum_sq_pi, t + 1)
    if return_pi:
        return out.to(w_t.dtype), pi.to(w_t.dtype), new_state
    return out.to(w_t.dtype), new_state
