"""TSSA on packed documents without a padded layout (the native varlen PyTorch path).

The formula of :func:`.parallel.tssa_parallel` (ToST Eq. (11), memberships Eqs. (32)-(34)) with
every sum over tokens taken per document: for a row of ``total`` tokens from S documents
(:mod:`whiteformer.ops.layout`), per head and document d(n) of token n::

    R_n    = sum_p x_np^2 / max(sum_{m in d(n)} x_mp^2, NORM_EPS^2)
    Pi     = softmax_heads(temp * R)
    dots_p = sum_{m in d(n)} Pi_m x_mp^2 / (sum_{m in d(n)} Pi_m + PI_EPS)
    out_np = -x_np Pi_n / (1 + dots_p)

The document sums are (H, S, p) ``index_add`` reductions gathered back per token: memory and
time follow ``total``, not S times the longest document. Large inputs are rescaled per document
and feature (:func:`whiteformer.ops.scaling.document_scale`), so a document's result never depends
on another's scale.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from ..._dtypes import autocast_off, stats_dtype
from ..constants import NORM_EPS, PI_EPS
from ..layout import Segments, segment_sum
from ..scaling import document_scale, scaled_eps

__all__ = ["tssa_varlen"]


def tssa_varlen(
    w: torch.Tensor, temp: torch.Tensor, seg: Segments, drop_p: float = 0.0, normalize: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """TSSA on validated inputs: w (1, H, total, p), temp (H, 1), the documents ``seg``.

    Returns (out (1, H, total, p), pi (1, H, total)) in ``w``'s dtype, statistics in float32 for
    half inputs. ``drop_p`` is dropout on each document's gain 1 / (1 + dots) (H, S, p);
    ``normalize=False`` drops the l2 normalisation over tokens (ToST Table 8 ablation).
    """
    sd = stats_dtype(w)
    with autocast_off(w):
        x = w[0].to(sd)  # (H, total, p)
        c = document_scale(x, seg)  # (H, S, p): each document's own per feature, see whiteformer.ops.scaling
        c_tok = c.index_select(1, seg.ids)  # (H, total, p)
        x = x / c_tok
        x2 = x * x
        if normalize:
            inv_energy = segment_sum(x2, seg).clamp_min(scaled_eps(NORM_EPS * NORM_EPS, c)).reciprocal()  # (H, S, p)
            logits = (x2 * inv_energy.index_select(1, seg.ids)).sum(dim=-1)  # (H, total)
        else:
            logits = (x2 * (c_tok * c_tok)).sum(dim=-1)
        pi = torch.softmax(logits * temp.to(sd), dim=0)  # over heads
        mass = segment_sum(pi, seg)  # (H, S)
        dots = segment_sum(x2 * pi.unsqueeze(-1), seg) / (mass + PI_EPS).unsqueeze(-1)  # (H, S, p)
        gain = (c.reciprocal() + c * dots).reciprocal()  # c_p / (1 + dots_p in w's units)
        if drop_p > 0.0:
            gain = F.dropout(gain, p=drop_p, training=True)
        out = -(x * pi.unsqueeze(-1)) * gain.index_select(1, seg.ids)
    return out.unsqueeze(0).to(w.dtype), pi.unsqueeze(0).to(w.dtype)
