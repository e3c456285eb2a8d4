"""Part (a) of the GPU check: the Triton kernels against the PyTorch path and the float64
reference, forward and gradients.

Per case (op, shape, mask / ``cu_seqlens``, dtype): the output and the gradients of
``sum(out * g)`` (g fixed random) with respect to ``w``, ``temp`` (and ``pos_bias`` for the causal
op) through ``WHITEFORMER_BACKEND=triton`` and ``=torch``, and through the reference
(``whiteformer.ops.reference``, the paper's formulas) in float64 on the same rounded inputs. The
error is ``max |got - ref| / max |ref|`` per tensor; a case passes when every tensor of both
paths is finite and within :data:`TOL` of the reference, and masked-out tokens get exactly 0.
The causal step (the decoding kernel) is stepped through a short sequence on both paths.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Sequence

import torch

from ..gpu import backend
from .record import describe

# relative to the largest reference entry: float32 to its accumulation order, half types to a few
# units of their rounding (outputs and gradients come back in that dtype)
TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}  # the training dtype first

# (op, (B, H, N, p), layout): odd N, a padding mask, packed documents (one of length 1), at the head dims
# of real models; p 32 and 256 (more kernel specialisations to compile) in bfloat16 only
FULL_CASES = [(op, shape, layout) for op in ("tssa", "causal_tssa")
              for shape, layout in (((2, 8, 1000, 64), "mask"), ((1, 12, 4097, 128), "dense"),
                                    ((1, 8, 3001, 64), "cu_seqlens"))]
WIDE_CASES = [(op, shape, "mask") for op in ("tssa", "causal_tssa") for shape in ((3, 4, 333, 32), (1, 2, 515, 256))]
DRY_CASES = [("tssa", (2, 2, 7, 4), "mask"), ("tssa", (1, 2, 9, 4), "cu_seqlens"),
             ("causal_tssa", (2, 2, 7, 4), "mask"), ("causal_tssa", (1, 2, 9, 4), "cu_seqlens")]


def _cu_seqlens(n: int, device) -> torch.Tensor:
    """Four documents, the first of one token, the others about equal (little padding)."""
    rest = n - 1
    cuts = [0, 1, 1 + rest // 3, 1 + 2 * rest // 3, n]
    return torch.tensor(cuts, dtype=torch.int32, device=device)


def _mask(b: int, n: int, device, gen: torch.Generator) -> torch.Tensor:
    m = torch.rand(b, n, generator=gen) > 0.3
    m[:, 0] = True
    m[-1, n // 2:] = False  # right padding
    if b > 1:
        m[0, :2] = False  # left padding
        m[0, 2] = True
    return m.to(device)


def _call(op: str, w, temp, bias, mask, cu):
    from whiteformer.ops import causal_tssa, tssa

    if op == "tssa":
        return tssa(w, temp, mask, cu_seqlens=cu)
    return causal_tssa(w, temp, bias, mask, cu_seqlens=cu)


def _reference(op: str, w, temp, bias, mask, cu):
    from whiteformer.ops.reference import causal_tssa_reference, tssa_reference

    if op == "tssa":
        return tssa_reference(w, temp, mask, cu_seqlens=cu)
    return causal_tssa_reference(w, temp, bias, mask, cu_seqlens=cu)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    err = float((got.double() - ref).abs().max()) if ref.numel() else 0.0
    return err / scale if scale > 0 else err


def _run_path(fn: Callable, params: Sequence[torch.Tensor], g: torch.Tensor) -> List[torch.Tensor]:
    out = fn(*params)
    grads = torch.autograd.grad((out.double() * g).sum(), params)
    return [out.detach(), *grads]


def check_case(op: str, shape, layout: str, dtype_name: str, device: str, seed: int = 0) -> Dict[str, Any]:
    b, h, n, p = shape
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(b, h, n, p, generator=gen).to(device, dtype)
    temp0 = (torch.rand(h, 1, generator=gen) * 8 / p + 0.5 / p).to(device, dtype)  # logits O(1) at any p
    bias0 = (torch.randn(h, n + 8, 1, generator=gen) * 0.3).to(device, dtype) if op == "causal_tssa" else None
    mask = _mask(b, n, device, gen) if layout == "mask" else None
    cu = _cu_seqlens(n, device) if layout == "cu_seqlens" else None
    g = torch.randn(b, h, n, p, generator=gen, dtype=torch.float64).to(device)
    names = ["out", "grad_w", "grad_temp"] + (["grad_pos_bias"] if bias0 is not None else [])
    base = [t for t in (w0, temp0, bias0) if t is not None]

    def params(dt=None):
        return [t.detach().to(dt or t.dtype).requires_grad_(True) for t in base]

    def fn(w, temp, bias=None):
        return _call(op, w, temp, bias, mask, cu)

    ref = _run_path(lambda w, temp, bias=None: _reference(op, w, temp, bias, mask, cu), params(torch.float64), g)
    row: Dict[str, Any] = {"op": op, "shape": list(shape), "layout": layout, "dtype": dtype_name,
                           "tol": TOL[dtype_name]}
    ok, results = True, {}
    for path in ("triton", "torch"):
        with backend(path):
            got = results[path] = _run_path(fn, params(), g)
        errs = {k: _rel_err(t, r) for k, t, r in zip(names, got, ref)}
        finite = all(bool(torch.isfinite(t).all()) for t in got)
        row[path] = {"rel_err": errs, "finite": finite}
        ok = ok and finite and max(errs.values()) <= TOL[dtype_name]
        if mask is not None:
            zero = not got[0][~mask[:, None, :, None].expand_as(got[0])].any()
            row[path]["masked_tokens_zero"] = zero
            ok = ok and zero
    row["triton_vs_torch"] = {k: _rel_err(a, b.double()) for k, a, b in zip(names, results["triton"], results["torch"])}
    row["passed"] = ok
    return row


def check_step(dtype_name: str, device: str, shape=(2, 8, 6, 64), seed: int = 0) -> Dict[str, Any]:
    """The decoding step on both paths vs the chunked reference over the same tokens."""
    from whiteformer.ops import causal_tssa_step
    from whiteformer.ops.reference import causal_tssa_reference

    b, h, n, p = shape
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(b, h, n, p, generator=gen).to(device, dtype)
    temp = (torch.rand(h, 1, generator=gen) * 8 / p + 0.5 / p).to(device, dtype)
    bias = (torch.randn(h, n, 1, generator=gen) * 0.3).to(device, dtype)
    ref = causal_tssa_reference(w.double(), temp.double(), bias.double())
    row: Dict[str, Any] = {"op": "causal_tssa_step", "shape": list(shape), "layout": "steps", "dtype": dtype_name,
                           "tol": TOL[dtype_name]}
    ok = True
    for path in ("triton", "torch"):
        state, outs = None, []
        with backend(path), torch.no_grad():
            for t in range(n):
                o, state = causal_tssa_step(w[:, :, t], state, temp, bias)
                outs.append(o)
        err = _rel_err(torch.stack(outs, 2), ref)
        finite = all(bool(torch.isfinite(o).all()) for o in outs)
        row[path] = {"rel_err": {"out": err}, "finite": finite}
        ok = ok and finite and err <= TOL[dtype_name]
    row["passed"] = ok
    return row


def run(cfg: Dict[str, Any], rec) -> None:
    """All cases of ``cfg`` (``dry_run``: tiny ones), one row each, saved as they finish."""
    device = cfg["device"]
    cases = DRY_CASES if cfg["dry_run"] else FULL_CASES
    dtypes: List[str] = list(DTYPES)
    for dtype_name in dtypes:
        wide = WIDE_CASES if dtype_name == "bfloat16" and not cfg["dry_run"] else []
        for op, shape, layout in cases + wide:
            rec.add(_guarded(lambda: check_case(op, shape, layout, dtype_name, device),
                             {"op": op, "shape": list(shape), "layout": layout, "dtype": dtype_name}))
        step_shape = (2, 2, 3, 4) if cfg["dry_run"] else (2, 8, 6, 64)
        rec.add(_guarded(lambda: check_step(dtype_name, device, step_shape),
                         {"op": "causal_tssa_step", "dtype": dtype_name}))
    rows = rec.rows
    rec.set(passed=sum(r.get("passed", False) for r in rows), failed=sum(not r.get("passed", False) for r in rows))


def _guarded(fn: Callable[[], Dict[str, Any]], key: Dict[str, Any]) -> Dict[str, Any]:
    """One case, timed (its first kernels compile): an exception is a failed row naming it, the
    other cases still run."""
    t0 = time.time()
    try:
        row = fn()
    except Exception as e:  # noqa: BLE001 - record and go on
        row = {**key, "passed": False, "error": describe(e)}
    row["seconds"] = round(time.time() - t0, 2)
    return row
