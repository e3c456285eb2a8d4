"""Rotary position encoding (RoPE; Su et al., "RoFormer", 2024), LLaMA layout over the full width.

DMSA (Liu et al., Sec. III-B and Appendix B, ``apply_rotary_emb``) rotates the input of the
membership projection so that memberships depend on token positions. Each pair of channels
(2i, 2i+1) of token ``pos`` is rotated by the angle ``pos * base**(-2i/C)``:

    y[2i]   = x[2i] cos(a) - x[2i+1] sin(a)
    y[2i+1] = x[2i] sin(a) + x[2i+1] cos(a)

(the complex product ``(x[2i] + i x[2i+1]) * exp(i a)``). Real arithmetic only, so it compiles.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import check_positive_real, check_same_device, check_tensor, check_tokens_input

__all__ = ["rotary", "rotary_angles"]


def rotary_angles(positions: torch.Tensor, dim: int, base: float = 10000.0,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Angles ``positions[..., None] * base**(-2i/dim)``, i = 0..dim/2-1, in ``dtype``.

    As LLaMA's ``precompute_freqs_cis``: the frequencies are ``1 / base**(arange(0, dim, 2)/dim)``.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=positions.device, dtype=dtype) / dim))
    return positions.to(dtype).unsqueeze(-1) * inv_freq


def rotary(x: torch.Tensor, base: float = 10000.0, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of x (B, N, C) by ``pos * base**(-2i/C)``.

    Args:
        x: (B, N, C) with even C.
        base: RoPE base (10000 in LLaMA and DMSA).
        positions: optional token positions, (N,) or (B, N) (integer or floating); default
            ``0..N-1``. The DMSA layer passes the rank of each real token under a padding mask.

    Returns:
        (B, N, C) in x's dtype; computed in float32 for half inputs and for float32, in float64
        for float64 (angles in float32 as LLaMA computes them). Position 0 is the identity; the
        map preserves norms and ``<rot(q, m), rot(k, n)>`` depends only on ``m - n``.
    """
    check_tokens_input(x)
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"rotary needs an even channel dimension (pairs (2i, 2i+1)), got C = {x.shape[-1]}")
    base = check_positive_real(base, "base")
    B, N = x.shape[0], x.shape[1]
    if positions is not None:
        check_tensor(positions, "positions", floating=False)
        if positions.shape not in ((N,), (B, N)):
            raise ValueError(f"positions must have shape (N,) = ({N},) or (B, N) = ({B}, {N}), got {tuple(positions.shape)}")
        check_same_device(x, "x", positions=positions)
    return _rotary(x, base, positions)


def _rotary(x: torch.Tensor, base: float, positions: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`rotary` on checked arguments."""
    C = x.shape[-1]
    if positions is None:
        positions = torch.arange(x.shape[1], device=x.device)
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    ang = rotary_angles(positions, C, float(base), cd)  # (N, C/2) or (B, N, C/2)
    cos, sin = torch.cos(ang), torch.sin(ang)
    xp = x.to(cd).unflatten(-1, (C // 2, 2))
    x0, x1 = xp[..., 0], xp[..., 1]
    y = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return y.to(x.dtype)
