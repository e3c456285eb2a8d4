"""The power-of-two scales of the Triton kernels (:mod:`whiteformer.ops.scaling`): the kernels read
``1 / c``, ``c`` and a clamp in units of ``c^2``, divide ``w`` by ``c`` before squaring and keep a
``1 / c`` term in the gain (``1 / (1 + dots) = c^-1 / (c^-2 + dots')`` with
``dots' = dots / c^2``, written ``c / (1 / c + c dots')`` times ``1 / c``), so that any finite
``w`` stays finite. TSSA's kernels take one ``c`` per (sequence, head, feature)
(:func:`chunk_feature_scale`, a (B, H, 3, p) table); the causal kernels and the step one per
(sequence, head) (:func:`chunk_scale`, :func:`kernel_scale`: the same ``c`` as the PyTorch paths,
a (B, H, 3) table)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ...constants import RATIO_EPS
from ...scaling import head_scale, scaled_eps
from ._tiles import acc_dtype

__all__ = ["chunk_feature_scale", "chunk_scale", "kernel_scale"]


def kernel_scale(x: torch.Tensor, trailing: int, earlier: Optional[torch.Tensor] = None, eps: float = RATIO_EPS,
                 mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``c`` (B, H) of ``x`` (B, H, ...) over its last ``trailing`` dims (the kept tokens of
    ``mask`` (B, N) only, if given), at least ``earlier`` (B, H) (a state's scale), in the
    statistics dtype, and the (B, H, 3) ``[1 / c, c, eps / c^2]`` the kernels read
    (:func:`~whiteformer.ops.scaling.scaled_eps`, as the PyTorch paths)."""
    acc = acc_dtype(x.dtype)
    if mask is not None:  # padded tokens take no part in the scale
        x = x.masked_fill(~mask[:, None, :, None], 0.0)
    floor = torch.ones(x.shape[:2], dtype=acc, device=x.device) if earlier is None else earlier.to(acc)
    c = head_scale(x, trailing, floor.reshape(*floor.shape, *([1] * trailing)))  # floor: max in acc's dtype
    c = c.reshape(x.shape[:2])
    return c, torch.stack([c.reciprocal(), c, scaled_eps(eps, c)], dim=-1).contiguous()


def chunk_scale(part: torch.Tensor, amax: torch.Tensor, acc: torch.dtype, eps: float = RATIO_EPS
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From :func:`._tiles.chunk_energy`'s float64 per-chunk sums of w^2 ``part`` (B, H, NC, p) and
    per-chunk largest |w| per head ``amax`` (B, H, NC): the scale c (B, H) (as :func:`kernel_scale`
    of the kept tokens), its (B, H, 3) ``[1 / c, c, eps / c^2]`` and the sums in units of c^2 in
    ``acc`` (exact divisions by a power of two, then one rounding)."""
    c = head_scale(amax.to(acc), 1).reshape(amax.shape[:2])
    c2 = c.to(torch.float64).square()[..., None, None]
    return c, torch.stack([c.reciprocal(), c, scaled_eps(eps, c)], dim=-1).contiguous(), (part / c2).to(acc)


def chunk_feature_scale(part: torch.Tensor, amax: torch.Tensor, acc: torch.dtype, eps: float = RATIO_EPS
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`chunk_scale` per feature: from the per-chunk sums ``part`` (B, H, NC, p) and largest
    |w| ``amax`` (B, H, NC, p), the scale c (B, H, p) of each feature over the kept tokens, its
    (B, H, 3, p) ``[1 / c, c, eps / c^2]`` and the sums in units of c^2 in ``acc``. One huge
    feature of a head leaves the others unscaled: divided by one scale per head, their squares
    would underflow (w = 1e30 beside O(1) values: 1e-60 is 0 in float32) and their gains
    1 / (1 + dots) would be wrong. Exact for TSSA, whose ratios w_j^2 / s_j and gains are per
    feature over all tokens."""
    c = head_scale(amax.to(acc).transpose(-1, -2), 1)[..., 0]
    c2 = c.to(torch.float64).square().unsqueeze(-2)
    table = torch.stack([c.reciprocal(), c, scaled_eps(eps, c)], dim=-2).contiguous()
    return c, table, (part / c2).to(acc)
