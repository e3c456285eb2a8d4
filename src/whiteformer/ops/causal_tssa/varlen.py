"""Causal TSSA on packed documents without a padded layout (the native varlen PyTorch path).

The formula of :func:`.parallel.causal_tssa_parallel` (ToST Eq. (28), memberships Eq. (39))
with every prefix sum restarting at each document start (:func:`whiteformer.ops.layout.
segment_cumsum`, a segmented scan) and positions (for ``pos_bias``) counted from each document's
first token::

    E_t    = sum_{s<=t, s in d(t)} x_s^2,   ratio_t = x_t^2 / max(E_t, RATIO_EPS)
    Pi_t   = softmax_heads(temp * (sum_p ratio_t + p * b_{pos(t)}))
    dots_t = sum_{s<=t, s in d(t)} Pi_s x_s^2 / (sum_{s<=t, s in d(t)} Pi_s + PI_EPS)
    out_t  = -x_t Pi_t / (1 + dots_t)

Memory and time follow ``total``, not S times the longest document. Large inputs are rescaled per
document and feature (:func:`whiteformer.ops.scaling.document_scale`), so a document's result
never depends on another's scale.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..._dtypes import autocast_off, stats_dtype
from ..constants import PI_EPS, RATIO_EPS
from ..layout import Segments, segment_cumsum, segment_gather, segment_sum
from ..scaling import document_scale, scaled_eps
from .parallel import prefix_ratio

__all__ = ["causal_tssa_varlen"]


def causal_tssa_varlen(
    w: torch.Tensor, temp: torch.Tensor, seg: Segments, pos_bias: Optional[torch.Tensor] = None,
    drop_p: float = 0.0,
) -> Tuple[torch.Tensor, ...]:
    """Causal TSSA on validated inputs.

    Args:
        w: (1, H, total, p); temp: (H, 1); seg: the documents; pos_bias: (H, T_max, 1) with
            T_max >= the longest document (checked by the caller), or None; drop_p: dropout on
            the gain 1 / (1 + dots).

    Returns:
        out (1, H, total, p) and pi (1, H, total) in ``w``'s dtype, and each document's final
        sums sum_sq (S, H, p), sum_pi (S, H), sum_sq_pi (S, H, p) in the statistics dtype
        (float32 for half inputs; zeros for an empty document), in units of their scale (S, H, p)
        (per feature j: ``sum_sq[..., j] * scale[..., j]^2`` in w's units).
    """
    sd = stats_dtype(w)
    p = w.shape[-1]
    with autocast_off(w):
        x = w[0].to(sd)  # (H, total, p)
        c = document_scale(x, seg)  # (H, S, p): each document's own per feature, see whiteformer.ops.scaling
        c_tok = c.index_select(1, seg.ids)  # (H, total, p)
        x = x / c_tok
        x2 = x * x
        logits = prefix_ratio(x2, segment_cumsum(x2, seg, exclusive=True), scaled_eps(RATIO_EPS, c_tok)).sum(dim=-1)
        if pos_bias is not None:
            logits = logits + p * segment_gather(pos_bias[:, :, 0], seg).to(sd)
        pi = torch.softmax(logits * temp.to(sd), dim=0)  # over heads
        sq = x2 * pi.unsqueeze(-1)
        mass = segment_cumsum(pi, seg)  # (H, total)
        gain = (c_tok.reciprocal() + c_tok * (segment_cumsum(sq, seg) / (mass + PI_EPS).unsqueeze(-1))).reciprocal()
        if drop_p > 0.0:
            gain = F.dropout(gain, p=drop_p, training=True)
        out = -(x * pi.unsqueeze(-1)) * gain
        sums = tuple(v.transpose(0, 1) for v in (segment_sum(x2, seg), segment_sum(pi, seg), segment_sum(sq, seg)))
        scale = c.transpose(0, 1).contiguous()  # (S, H, p): each document's own
    return (out.unsqueeze(0).to(w.dtype), pi.unsqueeze(0).to(w.dtype)) + sums + (scale,)
