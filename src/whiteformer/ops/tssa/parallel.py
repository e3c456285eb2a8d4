"""TSSA in differentiable PyTorch ops: the one PyTorch implementation of ToST Eq. (11).

It is the fallback path of :func:`whiteformer.ops.tssa` (any device and dtype, dropout,
``normalize=False``) and the recomputation behind the fused kernels' double backward
(:mod:`whiteformer.ops._kernels.fused`). Per head, with x = w (padded tokens zeroed)::

    R_n    = sum_p x_np^2 / max(sum_n x_np^2, NORM_EPS^2)    (= sum_p (x / ||x||_tokens)^2, Eq. 32)
    Pi     = softmax_heads(temp * R)                          (Eqs. 33-34)
    dots_p = sum_n Pi_n x_np^2 / (sum_n Pi_n + PI_EPS)
    out_np = -x_np Pi_n / (1 + dots_p)                        (Eq. 31, grad f = 1 / (1 + x))

With a process ``group`` (context parallelism, :mod:`whiteformer.ops.context_parallel`) the
tokens are split over its ranks and the token sums ``sum_n x^2``, ``sum_n Pi x^2``, ``sum_n Pi``
are all-reduced (autograd-aware), so every rank gets exactly its rows of the unsplit op.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..._dtypes import autocast_off, stats_dtype
from ..constants import NORM_EPS, PI_EPS
from ..context_parallel import all_reduce_sum, broadcast_from_first
from ..scaling import feature_scale, scaled_eps

__all__ = ["tssa_parallel"]


def tssa_parallel(
    w: torch.Tensor, temp: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, drop_p: float = 0.0,
    normalize: bool = True, group=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """TSSA on validated inputs: w (B, H, N, p), temp (H, 1), attn_mask (B, N) bool or None.

    Returns (out (B, H, N, p), pi (B, H, N)) in ``w``'s dtype, statistics in float32 for half
    inputs. ``drop_p`` is dropout on the gain 1 / (1 + dots); ``normalize=False`` drops the l2
    normalisation over tokens (ToST Table 8 ablation). Never materialises ``w_normed``: the
    logits are one matrix-vector product of w^2 with the inverse per-feature energies.
    ``group``: a process group over which the tokens are split (validated by the caller), or
    None; the dropout mask of the gain is then the group's first rank's.
    """
    sd = stats_dtype(w)
    with autocast_off(w):
        x = w.to(sd)
        if attn_mask is not None:
            # padded tokens: zero entries contribute nothing to any token sum below
            x = x.masked_fill(~attn_mask[:, None, :, None], 0.0)
        c = feature_scale(x, group=group)  # (B, H, 1, p): per feature, see whiteformer.ops.scaling
        x = x / c
        c = c.squeeze(-2)  # (B, H, p)
        x2 = x * x  # (B, H, N, p)
        if normalize:
            energy = x2.sum(dim=-2)  # (B, H, p)
            if group is not None:
                energy = all_reduce_sum(energy, group)
            inv_energy = energy.clamp_min(scaled_eps(NORM_EPS * NORM_EPS, c)).reciprocal()
            logits = torch.einsum("bhnp,bhp->bhn", x2, inv_energy)
        else:
            logits = torch.einsum("bhnp,bhp->bhn", x2, c * c)
        pi = torch.softmax(logits * temp.to(sd), dim=1)  # over heads
        if attn_mask is not None:
            pi = pi.masked_fill(~attn_mask[:, None, :], 0.0)
        if group is None:
            dots = torch.einsum("bhn,bhnp->bhp", pi / (pi.sum(dim=-1, keepdim=True) + PI_EPS), x2)  # (B, H, p)
        else:  # [sum_n Pi x^2, sum_n Pi] over the whole sequence: one all-reduce of (B, H, p + 1)
            moments = all_reduce_sum(torch.cat([torch.einsum("bhn,bhnp->bhp", pi, x2), pi.sum(-1, keepdim=True)],
                                               dim=-1), group)
            dots = moments[..., :-1] / (moments[..., -1:] + PI_EPS)
        gain = (c.reciprocal() + c * dots).reciprocal()  # c_p / (1 + dots_p in w's units)
        if drop_p > 0.0 and group is None:
            gain = F.dropout(gain, p=drop_p, training=True)
        elif drop_p > 0.0:  # one mask for the tokens of every rank, as the unsplit op
            keep = broadcast_from_first((torch.rand_like(gain) >= drop_p).to(gain.dtype), group)
            gain = gain * keep / (1.0 - drop_p)
        out = -(x * pi.unsqueeze(-1)) * gain.unsqueeze(-2)
    return out.to(w.dtype), pi.to(w.dtype)
