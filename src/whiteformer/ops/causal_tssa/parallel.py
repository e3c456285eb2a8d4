"""Causal TSSA in differentiable PyTorch ops: the one PyTorch implementation of ToST Eq. (28)
with the memberships of Eq. (39), in prefix-sum form.

It is the fallback path of :func:`whiteformer.ops.causal_tssa` and of
:func:`whiteformer.ops.causal_tssa_step` (a sequence of one token continuing from a state,
:mod:`.recurrent`), and the recomputation behind the fused kernels' double backward
(:mod:`whiteformer.ops._kernels.fused`). Per head, with x = w (padded tokens zeroed), sums over
s <= t (plus the state of earlier tokens), and lb_t the logit bias (``p * pos_bias[t]``)::

    E_t    = sum_s x_s^2,   ratio_t = x_t^2 / max(E_t, RATIO_EPS)                   (Eq. 35, squared)
    Pi_t   = softmax_heads(temp * (sum_p ratio_t + lb_t))                           (Eq. 39)
    dots_t = sum_s Pi_s x_s^2 / (sum_s Pi_s + PI_EPS)
    out_t  = -x_t Pi_t / (1 + dots_t)                                               (Eq. 28)

With a process ``group`` (context parallelism, :mod:`whiteformer.ops.context_parallel`) each rank
holds a contiguous chunk of the tokens; the sums over the tokens of the earlier ranks (the
exclusive prefix over ranks of the per-rank totals of x^2, then of Pi and Pi x^2) start this
rank's prefix sums, so every rank gets exactly its rows of the unsplit op.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from ..._dtypes import autocast_off, stats_dtype
from ..constants import PI_EPS, RATIO_EPS
from ..context_parallel import exclusive_prefix_sum
from ..scaling import feature_scale, scaled_eps

__all__ = ["causal_tssa_parallel", "prefix_ratio"]


def prefix_ratio(x2: torch.Tensor, before: torch.Tensor, eps: Union[float, torch.Tensor] = RATIO_EPS) -> torch.Tensor:
    """``x2 / max(E, eps)`` with ``E = before + x2`` the inclusive prefix energy, ``before``
    the exclusive one (the sum over the earlier tokens, an exclusive scan, not ``E - x2``).

    Written as ``1 - before / E``: the same value, but its gradient has no cancellation. In
    ``x2 / E`` the gradient of a token's own x2 is ``1 / E - x2 / E^2``, two terms of size
    ``1 / x2`` that cancel exactly at a sequence's first token (E = x2), leaving a rounding
    error of that size: 1e-3 of the gradient in float32 for |w| ~ 1e-3 at any document start.
    Here a token's own x2 gets ``before / E^2`` (0 at the first token) and the earlier tokens
    ``-x2 / E^2`` through ``before``.
    """
    energy = before + x2
    ratio = 1.0 - before / energy.clamp_min(eps)
    return torch.where(energy >= eps, ratio, x2 / eps)


def causal_tssa_parallel(
    w: torch.Tensor,
    temp: torch.Tensor,
    logit_bias: Optional[torch.Tensor] = None,
    attn_mask: Optional[torch.Tensor] = None,
    drop_p: float = 0.0,
    initial: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    group=None,
) -> Tuple[torch.Tensor, ...]:
    """Causal TSSA on validated inputs.

    Args:
        w: (B, H, N, p); temp: (H, 1); logit_bias: (H, N) or (B, H, N) added to ``sum_p ratio``
            (see :func:`.state.position_logit_bias`) or None; attn_mask: (B, N) bool or None;
            drop_p: dropout on the gain 1 / (1 + dots);
        initial: the sums (sum_sq (B, H, p), sum_pi (B, H), sum_sq_pi (B, H, p)) of earlier
            tokens in units of their ``scale`` (B, H, p) (a power of two per feature, or None for 1): the tuple
            ``(sum_sq, sum_pi, sum_sq_pi, scale)``, or None to start from zero;
        group: a process group over which the tokens are split (validated by the caller; rank
            order = sequence order), or None. ``logit_bias`` must then hold the global positions.

    Returns:
        out (B, H, N, p) and pi (B, H, N) in ``w``'s dtype, the final sums sum_sq, sum_pi,
        sum_sq_pi (float32 for half inputs) in units of the returned ``scale`` (B, H, p) (the power
        of two ``c_j`` per feature of the computation, :mod:`whiteformer.ops.scaling`; the earlier
        tokens' scale included); with a group, the sums up to this rank's last token.
    """
    if group is not None and w.shape[-2] == 0:
        # a rank without tokens still takes part in the collectives: it runs one padded token, which
        # adds nothing to any sum, so its final sums are those of the earlier ranks
        pad = w.new_zeros(*w.shape[:-2], 1, w.shape[-1])
        none = torch.zeros(w.shape[0], 1, dtype=torch.bool, device=w.device)
        if logit_bias is not None:
            logit_bias = torch.cat([logit_bias, logit_bias.new_zeros(*logit_bias.shape[:-1], 1)], dim=-1)
        out, pi, *sums = causal_tssa_parallel(torch.cat([w, pad], dim=-2), temp, logit_bias, none, drop_p, initial,
                                              group)
        return (out[..., :0, :], pi[..., :0], *sums)
    sd = stats_dtype(w)
    with autocast_off(w):
        x = w.to(sd)
        if attn_mask is not None:
            x = x.masked_fill(~attn_mask[:, None, :, None], 0.0)
        # scaled by c (B, H, 1, p) per feature (whiteformer.ops.scaling), at least the earlier tokens'
        # scale: the power of two at or below the largest |w_j| of all the tokens so far, whatever the split
        earlier = None if initial is None or initial[3] is None else initial[3].to(sd).unsqueeze(-2)
        c = feature_scale(x, earlier, group)
        x = x / c
        if initial is not None:  # the earlier sums in units of c: times r^2, r = scale / c (a power of two <= 1)
            r = (c if earlier is None else c / earlier).reciprocal().squeeze(-2)  # (B, H, p), exact
            initial = (initial[0].to(sd) * r * r, initial[1].to(sd), initial[2].to(sd) * r * r)  # r^2 may underflow
        x2 = x * x
        # exclusive prefix (each token's sum of the earlier ones) with no (N - 1)-long tensor, which would
        # tie an exported graph's dynamic N to N - 1 != 1
        before = torch.cat([torch.zeros_like(x2[:, :, :1]), x2], dim=-2).cumsum(dim=-2)[:, :, :-1]  # (B, H, N, p)
        if group is not None:
            before = before + exclusive_prefix_sum(before[:, :, -1] + x2[:, :, -1], group).unsqueeze(-2)
        if initial is not None:
            before = before + initial[0].unsqueeze(-2)
        logits = prefix_ratio(x2, before, scaled_eps(RATIO_EPS, c)).sum(dim=-1)  # (B, H, N)
        if logit_bias is not None:
            logits = logits + logit_bias.to(sd)
        pi = torch.softmax(logits * temp.to(sd), dim=1)  # over heads
        if attn_mask is not None:
            pi = pi.masked_fill(~attn_mask[:, None, :], 0.0)
        mass = pi.cumsum(dim=-1)  # (B, H, N)
        sq_pi = (x2 * pi.unsqueeze(-1)).cumsum(dim=-2)  # (B, H, N, p)
        if group is not None:  # one exclusive prefix of the (B, H, 1 + p) totals [sum Pi, sum Pi x^2]
            prior = exclusive_prefix_sum(torch.cat([mass[..., -1:], sq_pi[:, :, -1]], dim=-1), group)
            mass = mass + prior[..., :1]
            sq_pi = sq_pi + prior[..., 1:].unsqueeze(-2)
        if initial is not None:
            mass = mass + initial[1].unsqueeze(-1)
            sq_pi = sq_pi + initial[2].unsqueeze(-2)
        gain = (c.reciprocal() + c * (sq_pi / (mass + PI_EPS).unsqueeze(-1))).reciprocal()  # c_p / (1 + dots_p)
        if drop_p > 0.0:
            gain = F.dropout(gain, p=drop_p, training=True)
        out = -(x * pi.unsqueeze(-1)) * gain
    return (out.to(w.dtype), pi.to(w.dtype), before[:, :, -1] + x2[:, :, -1], mass[:, :, -1], sq_pi[:, :, -1],
            c.squeeze(-2))
