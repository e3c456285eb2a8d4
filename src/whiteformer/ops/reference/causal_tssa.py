"""Reference causal TSSA (ToST, Wu et al., ICLR 2025, Eq. (28) with Pi from Eq. (39)):
the official causal computation (Algorithm 2 / ``tost_lang``) written literally, for clarity.

Oracle for :func:`whiteformer.ops.causal_tssa`. A padding mask is handled by the definition
itself: each sequence's real tokens are run alone (positions 0..n_real-1) and padded outputs
are 0.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..._dtypes import stats_dtype
from ..constants import PI_EPS, RATIO_EPS
from ._masking import per_segment, per_sequence

__all__ = ["causal_tssa_reference"]


def _causal_tssa_literal(w, temp, pos_bias, attn_drop: float, training: bool):
    """Official formula on w (B, H, T, p), temp (H, 1), pos_bias (H, T_max, 1) or None."""
    T = w.shape[-2]
    w_sq = w**2
    denom = torch.cumsum(w_sq, dim=-2).clamp_min(RATIO_EPS)
    w_normed = w_sq / denom
    if pos_bias is not None:
        w_normed = w_normed + pos_bias[:, :T, :]  # broadcast over p: adds p * bias after the sum
    Pi = torch.softmax(torch.sum(w_normed, dim=-1) * temp, dim=1)  # (B, H, T), over heads
    dots = torch.cumsum(w_sq * Pi.unsqueeze(-1), dim=-2) / (Pi.cumsum(dim=-1) + PI_EPS).unsqueeze(-1)
    attn = 1.0 / (1 + dots)
    attn = F.dropout(attn, p=attn_drop, training=training)
    y = -torch.mul(w.mul(Pi.unsqueeze(-1)), attn)
    return y, Pi


def causal_tssa_reference(
    w: torch.Tensor,
    temp: torch.Tensor,
    pos_bias: Optional[torch.Tensor] = None,
    attn_mask: Optional[torch.Tensor] = None,
    return_pi: bool = False,
    *,
    attn_drop: float = 0.0,
    training: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
):
    """Reference causal TSSA. w (B, H, N, p), temp (H, 1), pos_bias (H, T_max, 1) or None,
    attn_mask (B, N) bool keep-mask or None; ``cu_seqlens`` (S + 1,): packed documents in
    w (1, H, total, p), each run alone (positions from 0). Returns out (B, H, N, p) (and Pi (B, H, N)).
    Half inputs are computed in float32 and cast back. No input validation."""
    sd = stats_dtype(w)
    x, tp = w.to(sd), temp.to(sd)
    pb = None if pos_bias is None else pos_bias.to(sd)

    def run(z):
        return _causal_tssa_literal(z, tp, pb, attn_drop, training)

    out, Pi = per_segment(lambda y: per_sequence(run, y, attn_mask), x, cu_seqlens)
    out, Pi = out.to(w.dtype), Pi.to(w.dtype)
    return (out, Pi) if return_pi else out
