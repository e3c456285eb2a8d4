"""Measured inference latency of a model (wall clock), alone or against another model.

``measure_latency(model, x)`` runs ``model(x)`` under ``torch.inference_mode`` in eval mode (the
mode is restored afterwards): ``warmup`` untimed runs, then ``runs`` timed ones; CUDA work is
synchronised around each timed run. The median is robust to the odd slow run on a shared machine.

``compare_latency(a, b, x)`` times two models *interleaved* (a, b, a, b, ...) after warming both
up, on a fixed number of CPU threads, so that both see the same machine load. It reports the
median and interquartile range (IQR) of each, and the speed-up a/b as the median and IQR of the
per-pair ratios. When the two IQRs overlap, no speed-up was measured: ``speedup`` is then None and
the verdict says so (:func:`latency_verdict`), rather than printing a ratio that noise can produce.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .._checks import check_instance, check_int
from .._utils import eval_mode  # noqa: F401  (re-exported: whiteformer.compress.latency.eval_mode)

__all__ = ["measure_latency", "compare_latency", "summarize_pair", "latency_verdict", "image_input_shape",
           "example_images", "eval_mode"]


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
    check_int(batch_size, "batch_size", 1)
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
    check_int(runs, "runs", 1)
    check_int(warmup, "warmup", 0)
    if x is None:
        ref = next(model.parameters())
        shape = tuple(input_shape) if input_shape is not None else image_input_shape(model)
        x = torch.randn((check_int(batch_size, "batch_size", 1), *shape), device=ref.device, dtype=ref.dtype)
    check_instance(x, "x", torch.Tensor, "a torch.Tensor")
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


def _quartiles(values: Sequence[float]) -> Tuple[float, float, float]:
    """(q1, median, q3) with linear interpolation (``statistics.quantiles`` "inclusive")."""
    v = sorted(values)
    if len(v) == 1:
        return v[0], v[0], v[0]
    q1, med, q3 = statistics.quantiles(v, n=4, method="inclusive")
    return q1, med, q3


def summarize_pair(times_a: Sequence[float], times_b: Sequence[float]) -> dict:
    """Statistics of paired timings (seconds) of two models run interleaved, in milliseconds.

    Returns ``{"a_ms", "a_iqr_ms", "b_ms", "b_iqr_ms", "ratio", "ratio_iqr", "overlap", "speedup"}``:
    medians, interquartile ranges ``[q1, q3]``, the median and IQR of the per-pair ratios a_i / b_i,
    whether the two IQRs overlap, and ``speedup`` = the ratio's median, or None when they overlap
    (no speed-up, nor slow-down, was measured).
    """
    if len(times_a) != len(times_b) or not times_a:
        raise ValueError(f"need the same non-zero number of timings of both models, got {len(times_a)} and "
                         f"{len(times_b)}")
    qa, qb = _quartiles([1e3 * t for t in times_a]), _quartiles([1e3 * t for t in times_b])
    qr = _quartiles([a / max(b, 1e-12) for a, b in zip(times_a, times_b)])
    overlap = qa[0] <= qb[2] and qb[0] <= qa[2]
    return {"a_ms": qa[1], "a_iqr_ms": [qa[0], qa[2]], "b_ms": qb[1], "b_iqr_ms": [qb[0], qb[2]],
            "ratio": qr[1], "ratio_iqr": [qr[0], qr[2]], "overlap": overlap,
            "speedup": None if overlap else qr[1]}


def latency_verdict(lat: dict) -> str:
    """One line for a :func:`compare_latency` result: the speed-up with its IQR, or that none was measured."""
    if lat.get("speedup") is None:
        return "no measured speed-up (the interquartile ranges of the two models overlap)"
    lo, hi = lat["speedup_iqr"]
    word = "speed-up" if lat["speedup"] > 1 else "slow-down (the compressed model is slower)"
    return f"measured {word}: x{lat['speedup']:.2f} (IQR {lo:.2f}-{hi:.2f})"


@contextmanager
def _num_threads(threads: Optional[int]):
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(old)


def compare_latency(model_a: nn.Module, model_b: nn.Module, x: torch.Tensor, *, runs: int = 10, warmup: int = 2,
                    threads: Optional[int] = None, timer: Callable[[], float] = time.perf_counter) -> dict:
    """Wall-clock time of ``model_a(x)`` and ``model_b(x)`` measured interleaved (a, b, a, b, ...).

    Args:
        model_a, model_b: e.g. the original and the compressed model (each in eval mode, restored after).
        x: the input both models take.
        runs: timed runs of each (>= 1, paired); warmup: untimed runs of each first (>= 0), also
            interleaved.
        threads: CPU threads for the measurement (``torch.set_num_threads``, restored after);
            default: the current count, recorded.
        timer: the clock (seconds), e.g. a fake one in tests.
    Returns:
        :func:`summarize_pair` of the timings with a = ``before`` and b = ``after``, as
        ``{"before_ms", "before_iqr_ms", "after_ms", "after_iqr_ms", "speedup", "speedup_iqr",
        "ratio", "overlap", "runs", "warmup", "threads", "batch_size", "device", "order"}``
        (``speedup`` None when the IQRs overlap, see :func:`latency_verdict`).
    """
    check_int(runs, "runs", 1)
    check_int(warmup, "warmup", 0)
    if threads is not None:
        check_int(threads, "threads", 1)
    check_instance(x, "x", torch.Tensor, "a torch.Tensor")
    device = x.device
    times = ([], [])
    with _num_threads(threads) as n_threads, eval_mode(model_a), eval_mode(model_b), torch.inference_mode():
        for _ in range(warmup):
            model_a(x)
            model_b(x)
        for _ in range(runs):
            for model, out in ((model_a, times[0]), (model_b, times[1])):
                _sync(device)
                t0 = timer()
                model(x)
                _sync(device)
                out.append(timer() - t0)
    st = summarize_pair(*times)
    return {"before_ms": st["a_ms"], "before_iqr_ms": st["a_iqr_ms"], "after_ms": st["b_ms"],
            "after_iqr_ms": st["b_iqr_ms"], "ratio": st["ratio"], "speedup": st["speedup"],
            "speedup_iqr": st["ratio_iqr"], "overlap": st["overlap"], "runs": runs, "warmup": warmup,
            "threads": n_threads, "batch_size": int(x.shape[0]), "device": str(device), "order": "interleaved"}
