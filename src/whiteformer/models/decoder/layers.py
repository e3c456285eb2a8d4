"""Building blocks of the Llama-style decoder: RMSNorm, the SwiGLU MLP and rotary position
embedding in the half-split layout with the source's ``rope_theta`` / ``rope_scaling``.

- RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019):
  ``y = w * x / sqrt(mean(x^2) + eps)``, the statistic in float32 (as transformers' ``LlamaRMSNorm``).
- SwiGLU (Shazeer, "GLU Variants Improve Transformer", arXiv:2002.05202, Eq. (6)):
  ``down(silu(gate(x)) * up(x))``.
- RoPE (Su et al., "RoFormer", arXiv:2104.09864, Eq. (34)) as Llama's transformers implementation
  lays it out: channel i of a head is paired with channel i + p/2 (``rotate_half``), rotated by
  ``pos * inv_freq[i]``. ``inv_freq[i] = theta**(-2i/p)``, rescaled by ``rope_scaling``:
  ``"linear"`` divides every frequency by ``factor``; ``"llama3"`` (Llama 3.1) divides the low
  frequencies (wavelength above ``original_max_position_embeddings / low_freq_factor``) by
  ``factor``, keeps the high ones (below ``... / high_freq_factor``) and interpolates between.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..._dtypes import stats_dtype

__all__ = ["RMSNorm", "SwiGLU", "ROPE_TYPES", "check_rope_scaling", "rope_inv_freq", "rope_cos_sin", "apply_rope"]

#: the ``rope_scaling`` types the decoder honours (None: none), each with the keys it needs
ROPE_TYPES: Dict[Optional[str], Tuple[str, ...]] = {
    None: (),
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2, -1) + eps)`` over the last dimension of (..., D); the
    statistic and the normalisation in float32 under half precision, cast back before the gain."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(stats_dtype(x))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``: (..., D) -> (..., D) through ``hidden``
    channels (transformers' ``LlamaMLP``, its names), then dropout."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, drop: float = 0.0):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


def check_rope_scaling(rope_scaling: Any, name: str = "rope_scaling") -> Optional[Dict[str, Any]]:
    """A ``rope_scaling`` dict (``{"rope_type": ..., <its parameters>}``; transformers' older key
    ``"type"`` is read too) or None -> a plain dict or None; an unsupported type or a missing
    parameter is a ValueError naming ``name`` and the supported types."""
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, dict):
        raise TypeError(f"{name} must be a dict with a 'rope_type' or None, got {type(rope_scaling).__name__}")
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    supported = [k for k in ROPE_TYPES if k is not None]
    if kind not in ROPE_TYPES:
        raise ValueError(f"{name} type {kind!r} is not supported; supported: {supported} (or no {name})")
    missing = [k for k in ROPE_TYPES[kind] if not isinstance(rope_scaling.get(k), (int, float))
               or isinstance(rope_scaling.get(k), bool)]
    if missing:
        raise ValueError(f"{name} of type {kind!r} needs the numbers {list(ROPE_TYPES[kind])}; missing or not a "
                         f"number: {missing}")
    out = {"rope_type": kind}
    out.update({k: rope_scaling[k] for k in ROPE_TYPES[kind]})
    return out


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: Optional[Dict[str, Any]] = None,
                  device: Optional[torch.device] = None) -> torch.Tensor:
    """(head_dim / 2,) float32 inverse frequencies ``theta**(-2i/head_dim)``, rescaled by a checked
    ``rope_scaling`` (:func:`check_rope_scaling`; see the module docstring)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    kind = None if rope_scaling is None else rope_scaling["rope_type"]
    if kind == "linear":
        return inv / rope_scaling["factor"]
    if kind != "llama3":
        return inv
    factor, low, high = rope_scaling["factor"], rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    old_len = rope_scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """positions (...,) integer -> ``(cos, sin)`` (..., p) float32 of the angles ``pos * inv_freq``,
    each frequency twice (channels i and i + p/2)."""
    ang = positions.float()[..., None] * inv_freq
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads x (B, H, N, p) by ``(cos, sin)`` of shape (N, p) or (B, N, p):
    ``x cos + rotate_half(x) sin`` with ``rotate_half(x) = (-x[p/2:], x[:p/2])``, in float32 (float64
    for float64 x), returned in x's dtype."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(cd)
    half = h.shape[-1] // 2
    rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
    return (h * cos.to(cd) + rotated * sin.to(cd)).to(x.dtype)
