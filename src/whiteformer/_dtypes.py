"""The dtypes statistics are computed in under bf16/fp16, and autocast kept off around them."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["stats_dtype", "autocast_off"]


def stats_dtype(x: torch.Tensor) -> torch.dtype:
    """dtype in which statistics are computed: float32 for half types, else the input dtype."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def autocast_off(x: torch.Tensor):
    """Context with autocast disabled on ``x``'s device, so that statistics and reductions stay in
    the dtype they are computed in (``stats_dtype``) under bf16/fp16 autocast; a no-op context
    on devices without autocast."""
    dev = x.device.type
    # cpu and cuda first: torch.compile of torch 2.11 cannot trace is_autocast_available
    if dev in ("cpu", "cuda") or torch.amp.is_autocast_available(dev):
        return torch.autocast(device_type=dev, enabled=False)
    return contextlib.nullcontext()
