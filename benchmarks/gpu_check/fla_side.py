"""Part (c) of the GPU check: flash-linear-attention's chunked kernels beside TSSA at the same
shapes. Per shape (B, T, H, D) in bfloat16: ``chunk_simple_gla`` (q, k, v and a per-head log
forget gate) and ``chunk_retention`` (q, k, v), both in fla's (B, T, H, D) layout, against
``tssa`` and ``causal_tssa`` on w of shape (B, H, T, D) (Triton path), forward and forward +
backward: median time over CUDA-event-timed calls after one warm-up call (fla autotunes there),
and peak memory. fla runs only on CUDA; a dry run records why it was skipped and times TSSA."""
from __future__ import annotations

import statistics
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from .. import gpu
from .record import describe

FULL_SHAPES = [(4, 16384, 8, 64), (4, 16384, 8, 128), (4, 16384, 8, 256), (1, 8192, 96, 128), (2, 16384, 16, 128)]
DRY_SHAPES = [(1, 16, 2, 8)]


def fla_ops() -> Optional[Dict[str, Callable]]:
    from fla.ops.retention import chunk_retention
    from fla.ops.simple_gla import chunk_simple_gla

    return {"chunk_simple_gla": chunk_simple_gla, "chunk_retention": chunk_retention}


def _fla_calls(name: str, fn: Callable, shape, dtype, device) -> Dict[str, Callable[[], Any]]:
    b, t, h, d = shape
    q, k, v = (torch.randn(b, t, h, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    extra = {}
    if name == "chunk_simple_gla":
        extra["g"] = F.logsigmoid(torch.randn(b, t, h, device=device, dtype=torch.float32)).requires_grad_(True)
    do = torch.randn(b, t, h, d, device=device, dtype=dtype)
    params = [q, k, v, *extra.values()]

    def fwd():
        with torch.no_grad():
            return fn(q, k, v, **extra)

    def fwdbwd():
        for x in params:
            x.grad = None
        o = fn(q, k, v, **extra)[0]
        o.backward(do)

    return {"fwd": fwd, "fwdbwd": fwdbwd}


def _tssa_calls(name: str, shape, dtype, device) -> Dict[str, Callable[[], Any]]:
    from whiteformer.ops import causal_tssa, tssa

    b, t, h, d = shape
    w = torch.randn(b, h, t, d, device=device, dtype=dtype, requires_grad=True)
    temp = (torch.rand(h, 1, device=device) + 0.5).requires_grad_(True)
    g = torch.randn_like(w)
    fn = tssa if name == "tssa" else causal_tssa

    def fwd():
        with torch.no_grad(), gpu.backend("triton"):
            return fn(w, temp)

    def fwdbwd():
        w.grad = temp.grad = None
        with gpu.backend("triton"):
            fn(w, temp).backward(g)

    return {"fwd": fwd, "fwdbwd": fwdbwd}


def _measure(call: Callable[[], Any], repeats: int, device: str) -> Dict[str, Any]:
    call()  # warm-up: compile, autotune
    times = [gpu.cuda_time(call, device) for _ in range(repeats)]
    return {"time_s": statistics.median(times), "time_min_s": min(times), "runs": repeats,
            "peak_bytes": gpu.peak_bytes(call, device)}


def run(cfg: Dict[str, Any], rec) -> None:
    device, dry = cfg["device"], cfg["dry_run"]
    dtype = torch.bfloat16
    repeats = 2 if dry else 10
    fla: Optional[Dict[str, Callable]] = None
    if not device.startswith("cuda"):
        reason = "skipped: fla's kernels need a CUDA GPU (dry run on CPU)"
    else:
        try:
            fla, reason = fla_ops(), ""
        except Exception as e:  # noqa: BLE001 - not installed / broken: record, still time TSSA
            reason = f"skipped: cannot import fla: {describe(e)}"
    rec.set(dtype="bfloat16", repeats=repeats, fla=reason or "ok")
    for shape in (DRY_SHAPES if dry else FULL_SHAPES):
        impls: List[tuple] = [(n, lambda n=n: _tssa_calls(n, shape, dtype, device)) for n in ("tssa", "causal_tssa")]
        if fla is not None:
            impls += [(n, lambda n=n, f=f: _fla_calls(n, f, shape, dtype, device)) for n, f in fla.items()]
        for name, make in impls:
            row: Dict[str, Any] = {"impl": name, "shape": dict(zip("BTHD", shape))}
            calls: Dict[str, Callable[[], Any]] = {}
            try:
                calls = make()
                for mode, call in calls.items():
                    row[mode] = _measure(call, repeats, device)
            except torch.cuda.OutOfMemoryError:
                row["status"] = "out of memory"
            except Exception as e:  # noqa: BLE001 - one implementation failing must not lose the others
                row["status"] = f"failed: {describe(e)}"
            del make, calls
            gpu.empty_cache(device)
            rec.add(row)
        if fla is None:
            for name in ("chunk_simple_gla", "chunk_retention"):
                rec.add({"impl": name, "shape": dict(zip("BTHD", shape)), "status": reason})
