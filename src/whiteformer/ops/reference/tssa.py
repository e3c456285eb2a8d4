"""Reference TSSA (ToST, Wu et al., ICLR 2025, Eq. (11) with Pi from Eqs. (32)-(34)):
the official computation (Algorithm 1 / ``tost_vision``) written literally, for clarity.

Oracle for :func:`whiteformer.ops.tssa`. A padding mask is handled by the definition
itself: each sequence's real tokens are run alone and padded outputs are 0.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..._dtypes import stats_dtype
from ..constants import NORM_EPS, PI_EPS
from ._masking import per_segment, per_sequence

__all__ = ["tssa_reference"]


def _tssa_literal(w: torch.Tensor, temp: torch.Tensor, attn_drop: float, training: bool, normalize: bool = True):
    """Official formula on w (B, H, N, p), temp (H, 1); returns (out, Pi)."""
    w_normed = F.normalize(w, dim=-2, eps=NORM_EPS) if normalize else w  # l2 over tokens
    Pi = torch.softmax(torch.sum(w_normed**2, dim=-1) * temp, dim=1)  # (B, H, N), over heads
    dots = torch.matmul((Pi / (Pi.sum(dim=-1, keepdim=True) + PI_EPS)).unsqueeze(-2), w**2)  # (B, H, 1, p)
    attn = 1.0 / (1 + dots)
    attn = F.dropout(attn, p=attn_drop, training=training)
    out = -torch.mul(w.mul(Pi.unsqueeze(-1)), attn)
    return out, Pi


def tssa_reference(
    w: torch.Tensor,
    temp: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    return_pi: bool = False,
    *,
    attn_drop: float = 0.0,
    training: bool = False,
    normalize: bool = True,
    cu_seqlens: Optional[torch.Tensor] = None,
):
    """Reference TSSA. w (B, H, N, p), temp (H, 1), attn_mask (B, N) bool keep-mask or None.

    ``cu_seqlens`` (S + 1,): packed documents in w (1, H, total, p), each run alone.
    Returns out (B, H, N, p) (and Pi (B, H, N) with ``return_pi``). Half inputs are computed in
    float32 and cast back. No input validation (see :func:`whiteformer.ops.tssa`).
    """
    sd = stats_dtype(w)
    x, tp = w.to(sd), temp.to(sd)

    def run(z):
        return _tssa_literal(z, tp, attn_drop, training, normalize)

    out, Pi = per_segment(lambda y: per_sequence(run, y, attn_mask), x, cu_seqlens)
    out, Pi = out.to(w.dtype), Pi.to(w.dtype)
    return (out, Pi) if return_pi else out
