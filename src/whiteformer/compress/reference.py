"""Plain reference of a compressed attention block from its dense QK / VO tensors (the oracle).

``logits_h = [x, 1] Y_QK[:, :, h] x^T`` (IrrAtt paper, Sec. 2.3; the trailing 1 multiplies the
query-bias row), ``A_h = softmax(logits_h)`` over the keys, ``y = sum_h A_h x Y_VO[:, :, h] + bias``
(Eq. 2 with ``Y_VO[:, :, h] = W_h^V W_h^O^T``). With a (B, N) keep-mask, padded keys are excluded
and outputs at padded positions are 0.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["attention_from_tensors"]


def attention_from_tensors(x: torch.Tensor, y_qk: torch.Tensor, y_vo: torch.Tensor,
                           out_bias: Optional[torch.Tensor] = None,
                           attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (B, N, F), y_qk (F or F+1, F, H) with the softmax scale included, y_vo (F, F, H),
    out_bias (F,) -> (B, N, F)."""
    B, N, F = x.shape
    xq = torch.cat([x, x.new_ones(B, N, 1)], dim=-1) if y_qk.shape[0] == F + 1 else x
    logits = torch.einsum("bni,ijh,bmj->bhnm", xq, y_qk, x)
    if attn_mask is not None:
        allowed = attn_mask[:, None, None, :] | ~attn_mask[:, None, :, None]
        logits = logits.masked_fill(~allowed, float("-inf"))
    attn = logits.softmax(dim=-1)
    y = torch.einsum("bhnm,bmi,ijh->bnj", attn, x, y_vo)
    if out_bias is not None:
        y = y + out_bias
    if attn_mask is not None:
        y = y.masked_fill(~attn_mask[..., None], 0.0)
    return y
