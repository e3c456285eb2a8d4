"""Multiply-accumulate counts (MACs) of MHSA blocks and their compressed forms (IrrAtt paper, Sec. 2.2-3.4),
and the FLOPs of whole models and modules as ``torch.utils.flop_counter`` counts them (:func:`count_flops`).

Per block with N tokens, F features, H heads, head dim D (FLOPs = 2 MACs; softmax, GELU, biases and
other elementwise work are not counted, as in the paper's Table 1):

* MHSA: ``4 N F D H + 2 H N^2 D``; its QK part ``N D H (2F + N)``; its VO part ``2 N F D H + H N^2 D``.
* TruncAtt QK, ranks r_h: ``sum_h N r_h (2F + N)``.
* CP SlimAtt QK, rank R: ``2 N F R + N (N+1) H R`` (the N H R is the head expansion diag(S^H(h, :))).
* IrrAtt QK, block ranks L_b: ``2 N F sum L + N^2 sum L``, plus ``N^2 H B`` for a general head
  fusion C (H x B, B = number of non-empty blocks); nothing extra for C = I.
* VO TruncAtt, ranks r_h: ``sum_h r_h (2 N F + N^2)``.
* Linear (in -> out): ``N in out``; rank-r factorised: ``N r (in + out)``.

The formulas trust their callers (the layers and :func:`~.budget.qk_rank_for_budget`, which check
the sizes and ranks once). These are the counts of the explicit-matmul path of the layers in :mod:`whiteformer.compress.layers`,
which ``torch.utils.flop_counter.FlopCounterMode`` reproduces (:func:`count_flops`).
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

__all__ = ["mhsa_macs", "mhsa_qk_macs", "mhsa_vo_macs", "truncatt_qk_macs", "cp_qk_macs", "irratt_qk_macs",
           "vo_truncatt_macs", "linear_macs", "lowrank_linear_macs", "count_flops"]


def _ranks(ranks: Union[int, Sequence[int]], num_heads: int) -> Sequence[int]:
    """``ranks`` as a list: an int is that rank for each of ``num_heads``."""
    return [ranks] * num_heads if isinstance(ranks, int) else list(ranks)


def mhsa_macs(num_tokens: int, dim: int, num_heads: int, head_dim: int) -> int:
    """Whole MHSA block: ``4 N F D H + 2 H N^2 D``."""
    N, F, H, D = num_tokens, dim, num_heads, head_dim
    return 4 * N * F * D * H + 2 * H * N * N * D


def mhsa_qk_macs(num_tokens: int, dim: int, num_heads: int, head_dim: int) -> int:
    """QK part of MHSA: ``N D H (2F + N)``."""
    N, F, H, D = num_tokens, dim, num_heads, head_dim
    return N * D * H * (2 * F + N)


def mhsa_vo_macs(num_tokens: int, dim: int, num_heads: int, head_dim: int) -> int:
    """VO part of MHSA: ``2 N F D H + H N^2 D``."""
    return mhsa_macs(num_tokens, dim, num_heads, head_dim) - mhsa_qk_macs(num_tokens, dim, num_heads, head_dim)


def truncatt_qk_macs(num_tokens: int, dim: int, ranks: Union[int, Sequence[int]], num_heads: int = 1) -> int:
    """TruncAtt QK: ``sum_h N r_h (2F + N)``; an int ``ranks`` means that rank for each of ``num_heads``."""
    N, F = num_tokens, dim
    return sum(N * r * (2 * F + N) for r in _ranks(ranks, num_heads))


def cp_qk_macs(num_tokens: int, dim: int, num_heads: int, rank: int) -> int:
    """CP SlimAtt QK: ``2 N F R + N (N+1) H R``."""
    N, F, H, R = num_tokens, dim, num_heads, rank
    return 2 * N * F * R + N * (N + 1) * H * R


def irratt_qk_macs(num_tokens: int, dim: int, ranks: Sequence[int], num_heads: int = 1,
                   fusion: str = "identity") -> int:
    """IrrAtt QK: ``2 N F sum L + N^2 sum L`` (+ ``N^2 H B`` for ``fusion="general"``, B = number of
    non-empty blocks; any other ``fusion`` is the identity)."""
    N, F = num_tokens, dim
    rs = _ranks(ranks, 1)
    total = sum(rs)
    macs = 2 * N * F * total + N * N * total
    if fusion == "general":
        macs += N * N * num_heads * sum(1 for r in rs if r > 0)
    return macs


def vo_truncatt_macs(num_tokens: int, dim: int, ranks: Union[int, Sequence[int]], num_heads: int = 1) -> int:
    """VO TruncAtt: ``sum_h r_h (2 N F + N^2)``."""
    N, F = num_tokens, dim
    return sum(r * (2 * N * F + N * N) for r in _ranks(ranks, num_heads))


def linear_macs(num_tokens: int, in_features: int, out_features: int) -> int:
    """Dense linear layer: ``N in out``."""
    return num_tokens * in_features * out_features


def lowrank_linear_macs(num_tokens: int, in_features: int, out_features: int, rank: int) -> int:
    """Rank-r factorised linear layer (truncated SVD, two linears): ``N r (in + out)``."""
    return num_tokens * rank * (in_features + out_features)


def count_flops(module: torch.nn.Module, *args, **kwargs) -> int:
    """FLOPs of ``module(*args, **kwargs)`` counted by ``torch.utils.flop_counter.FlopCounterMode``.

    Modules with a ``fused_attn`` attribute (the compressed layers, timm-style attention) are
    switched to their explicit-matmul path for the count (the fused SDPA CPU kernel is invisible to
    the counter).
    """
    from torch.utils.flop_counter import FlopCounterMode

    saved = []
    for m in module.modules():
        if hasattr(m, "fused_attn"):
            saved.append((m, m.fused_attn))
            m.fused_attn = False
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            module(*args, **kwargs)
    finally:
        for m, v in saved:
            m.fused_attn = v
    return int(fc.get_total_flops())
