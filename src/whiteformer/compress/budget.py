"""Rank selection from a QK FLOPs budget (IrrAtt paper, Sec. 3.4).

Each block gets the largest rank whose QK MACs are at most ``qk_flops_ratio`` times those of the
original MHSA QK part (local compression: the same ratio for every block):

    MACs_QK(R) / MACs_QK,orig <= CR.

Two ways to compare the methods at a ratio CR (``protocol``):

* ``"flops"`` (ours): every method gets its own largest rank within the budget, so they cost the
  same QK MACs (IrrAtt with general fusion pays ``N^2 H B`` for its fusion out of the budget,
  CP SlimAtt ``N H R`` for the head expansion);
* ``"rank"`` (the paper's Table 1: TruncAtt 16 vs CP 96 vs IrrAtt 96 on DeiT-S, H = 6): TruncAtt's
  per-head rank r at CR fixes the total QK rank ``H r``, which CP (R = H r) and IrrAtt (sum of the
  L_h = H r) get as well; their fusion costs come on top (IrrAtt paid ~1 % more MHSA FLOPs there).
"""
from __future__ import annotations

from typing import Callable

from .._checks import check_choice, check_int, is_int, is_real
from .flops import cp_qk_macs, irratt_qk_macs, mhsa_qk_macs, truncatt_qk_macs

__all__ = ["qk_rank_for_budget", "rank_for_method"]


def check_flops_ratio(qk_flops_ratio) -> None:
    """A QK FLOPs budget CR is a number in (0, 1]."""
    if not is_real(qk_flops_ratio) or not 0 < qk_flops_ratio <= 1:
        raise ValueError(f"qk_flops_ratio must be a number in (0, 1], got {qk_flops_ratio!r}")


def _largest(fn: Callable[[int], int], budget: float, upper: int) -> int:
    """Largest r in [0, upper] with fn(r) <= budget (fn non-decreasing); 0 if none."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fn(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def qk_rank_for_budget(method: str, qk_flops_ratio: float, *, num_tokens: int, dim: int, num_heads: int,
                       head_dim: int | None = None, fusion: str = "general", protocol: str = "flops") -> int:
    """Largest QK rank for ``method`` within ``qk_flops_ratio`` of the original QK MACs
    (``protocol="flops"``), or the rank that gives ``method`` TruncAtt's total rank at that ratio
    (``protocol="rank"``, see the module docstring).

    Args:
        method: "truncatt" (returns the per-head rank r, at most D), "cp" (the CP rank R) or "irratt"
            (the total rank sum_h L_h, at most H D). For "irratt" with ``fusion="general"`` the
            fusion cost is counted with B = H blocks (an upper bound).
        qk_flops_ratio: target CR in (0, 1].
        num_tokens, dim, num_heads, head_dim: N, F, H, D (D defaults to F / H).
        protocol: "flops" or "rank".
    Returns:
        the rank argument of ``method`` (truncatt: per head; cp: R; irratt: the total).
    Raises:
        ValueError if the ratio is out of range or leaves no rank >= 1.
    """
    check_choice(protocol, "protocol", ("flops", "rank"))
    check_choice(method, "method", ("truncatt", "cp", "irratt"))
    check_choice(fusion, "fusion", ("identity", "general"))
    check_flops_ratio(qk_flops_ratio)
    for name, value in (("num_tokens", num_tokens), ("dim", dim), ("num_heads", num_heads)):
        check_int(value, name, 1)
    if head_dim is not None:
        check_int(head_dim, "head_dim", 1)
    if protocol == "rank":
        r = qk_rank_for_budget("truncatt", qk_flops_ratio, num_tokens=num_tokens, dim=dim, num_heads=num_heads,
                               head_dim=head_dim)
        return rank_for_method(method, r * num_heads, num_heads)
    D = dim // num_heads if head_dim is None else head_dim
    N, F, H = num_tokens, dim, num_heads
    budget = float(qk_flops_ratio) * mhsa_qk_macs(N, F, H, D)
    if method == "truncatt":
        r = _largest(lambda r: truncatt_qk_macs(N, F, [r] * H), budget, D)
    elif method == "cp":
        r = _largest(lambda R: cp_qk_macs(N, F, H, R) if R else 0, budget, D * H)
    else:  # irratt

        def macs(total: int) -> int:
            if total == 0:
                return 0
            base = irratt_qk_macs(N, F, [total], 1, "identity")
            return base + (N * N * H * H if fusion == "general" else 0)

        r = _largest(macs, budget, H * D)
    if r < 1:
        raise ValueError(f"qk_flops_ratio={qk_flops_ratio} is too small for method {method!r}: "
                         "no rank >= 1 fits the budget")
    return r


def rank_for_method(method: str, total_rank: int, num_heads: int) -> int:
    """The rank argument that gives ``method`` the total QK rank ``total_rank``: truncatt
    ``total / H`` per head (must divide), cp R = total, irratt the total (split over the heads).
    ``method`` is one of those three, checked by the caller."""
    if not is_int(total_rank) or total_rank < 1:
        raise ValueError(f"the total QK rank must be a positive int with protocol='rank', got {total_rank!r}")
    if method == "truncatt":
        if total_rank % num_heads:
            raise ValueError(f"total QK rank {total_rank} is not a multiple of num_heads={num_heads}: TruncAtt "
                             "gives every head the same rank")
        return total_rank // num_heads
    return total_rank  # cp: R, irratt: the total
