"""Input validation shared by ops and layers.

Every public operator validates its arguments with these helpers so that bad input
raises a ``ValueError``/``TypeError`` that names the argument and what was expected,
instead of failing deep inside torch or silently producing NaN.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(x, name: str, ndim: int | Sequence[int] | None = None, *, floating: bool = True) -> None:
    """Check that ``x`` is a tensor with the given number of dims and a floating dtype."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.dim() not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(x.shape)}")
    if floating and x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating tensor (float16/bfloat16/float32/float64), got {x.dtype}"
        )


def check_nonempty(x: torch.Tensor, name: str, dim: int, what: str = "tokens") -> None:
    """Raise if ``x.shape[dim] == 0`` (e.g. a sequence of zero tokens)."""
    if x.shape[dim] == 0:
        raise ValueError(f"{name} has no {what} (size 0 along dim {dim}, shape {tuple(x.shape)})")


def check_divisible(dim: int, num_heads: int, dim_name: str = "dim") -> int:
    """Return the head dimension ``dim // num_heads`` or raise a clear error."""
    if not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}")
    if not isinstance(dim, int) or dim <= 0:
        raise ValueError(f"{dim_name} must be a positive integer, got {dim!r}")
    if dim % num_heads != 0:
        raise ValueError(f"{dim_name} ({dim}) must be divisible by num_heads ({num_heads})")
    return dim // num_heads


def check_mask(attn_mask, batch: int, tokens: int, name: str = "attn_mask") -> torch.Tensor | None:
    """Validate a (B, N) boolean keep-mask (True = real token); returns it or None."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"{name} must be a bool tensor of shape (B, N), got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool:
        raise TypeError(f"{name} must have dtype torch.bool (True = real token), got {attn_mask.dtype}")
    if attn_mask.shape != (batch, tokens):
        raise ValueError(
            f"{name} must have shape (B, N) = ({batch}, {tokens}), got {tuple(attn_mask.shape)}"
        )
    return attn_mask


def check_tokens_input(x, name: str = "x", dim: int | None = None) -> None:
    """Check a layer input of shape (B, N, C) (and C == dim when given)."""
    check_tensor(x, name, 3)
    check_nonempty(x, name, 1)
    if dim is not None and x.shape[-1] != dim:
        raise ValueError(f"{name} must have last dimension {dim} (the layer's dim), got shape {tuple(x.shape)}")


def stats_dtype(x: torch.Tensor) -> torch.dtype:
    """dtype in which statistics are computed: float32 for half types, else the input dtype."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def autocast_off(x: torch.Tensor):
    """Context with autocast disabled on ``x``'s device, so that statistics and reductions stay in
    the dtype they are computed in (``stats_dtype``) under bf16/fp16 autocast; a no-op context
    on devices without autocast."""
    dev = x.device.type
    if torch.amp.is_autocast_available(dev):
        return torch.autocast(device_type=dev, enabled=False)
    return contextlib.nullcontext()

