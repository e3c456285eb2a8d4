"""Measured inference latency of a model (wall clock, median of a few runs).

``measure_latency(model, x)`` runs ``model(x)`` under ``torch.inference_mode`` in eval mode (the
mode is restored afterwards): ``warmup`` untimed runs, then ``runs`` timed ones; CUDA work is
synchronised around each timed run. The median is robust to the odd slow run on a shared machine.
"""
from __future__ import annotations

import statistics
import time
from typing import Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .._checks import is_int
from .._utils import eval_mode  # noqa: F401  (re-exported: whiteformer.compress.latency.eval_mode)

__all__ = ["measure_latency", "image_input_shape", "example_images", "eval_mode"]


def _int(v, name: str, minimum: int) -> int:
    if not is_int(v) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return v


def image_input_shape(model: nn.Module) -> Tuple[int, int, int]:
    """(C, H, W) of the images a patch-embedding model takes (``model.patch_embed.img_size`` and
    ``in_chans``, or the conv's ``in_channels``)."""
    pe = getattr(model, "patch_embed", None)
    size = getattr(pe, "img_size", None)
    if pe is None or size is None:
        raise ValueError(f"{type(model).__name__} has no patch_embed with an img_size: cannot build an example "
                         "image batch; pass the input explicitly")
    chans = getattr(pe, "in_chans", None)
    if chans is None:
        chans = getattr(getattr(pe, "proj", None), "in_channels", None)
    if chans is None:
        raise ValueError(f"cannot tell the number of input channels of {type(model).__name__}.patch_embed")
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    return int(chans), int(h), int(w)


def example_images(model: nn.Module, batch_size: int = 1, seed: int = 0) -> torch.Tensor:
    """A (B, C, H, W) standard-normal batch on the model's device and dtype."""
    _int(batch_size, "batch_size", 1)
    ref = next(model.parameters())
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((batch_size, *image_input_shape(model)), generator=g)
    return x.to(device=ref.device, dtype=ref.dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_latency(model: nn.Module, x: Optional[torch.Tensor] = None, *, batch_size: int = 1, runs: int = 10,
                    warmup: int = 2, input_shape: Optional[Sequence[int]] = None) -> dict:
    """Median wall-clock time of ``model(x)``.

    Args:
        model: the module (run in eval mode, restored afterwards).
        x: the input; default a random batch of ``batch_size`` images of ``input_shape`` (C, H, W)
            (default :func:`image_input_shape`) on the model's device and dtype.
        runs: timed runs (>= 1); warmup: untimed runs first (>= 0).
    Returns:
        ``{"median_ms", "min_ms", "runs", "batch_size", "device"}``.
    """
    _int(runs, "runs", 1)
    _int(warmup, "warmup", 0)
    if x is None:
        ref = next(model.parameters())
        shape = tuple(input_shape) if input_shape is not None else image_input_shape(model)
        x = torch.randn((_int(batch_size, "batch_size", 1), *shape), device=ref.device, dtype=ref.dtype)
    elif not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    device = x.device
    times = []
    with eval_mode(model), torch.inference_mode():
        for _ in range(warmup):
            model(x)
        for _ in range(runs):
            _sync(device)
            t0 = time.perf_counter()
            model(x)
            _sync(device)
            times.append(time.perf_counter() - t0)
    return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "runs": runs,
            "batch_size": int(x.shape[0]), "device": str(device)}
