"""Packed documents (``cu_seqlens``) on the PyTorch path: the native varlen path against the
padded layout (S, H, L, p) it replaced (and, with ``--kernel``, the C++ CPU kernel, which keeps
that layout), for one long document and many short ones.

One forward + backward (float32, ``WHITEFORMER_BACKEND=torch``) of ``causal_tssa`` and ``tssa``
on a packed row, each cell in a separate process: peak memory is the RSS high-water mark minus
the RSS before (``benchmarks.common.PeakMemory``), time the wall time of that one call. The
padded cell is the former route: :func:`whiteformer.ops.packing.to_padded`, the masked op,
:func:`whiteformer.ops.packing.from_padded`. Usage::

    python -m benchmarks.packed_varlen [--lengths 4096,8x100] [--heads 8] [--p 64] [--kernel]
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional

import torch

from . import common
from .common import fmt_bytes, fmt_time, log


def _lengths(spec: str) -> List[int]:
    out: List[int] = []
    for part in spec.split(","):
        n, _, times = part.partition("x")
        out += [int(n)] * (int(times) if times else 1)
    return out


def cell(op: str, route: str, lengths: List[int], heads: int, p: int) -> Dict[str, Any]:
    """Peak memory and time of one forward + backward of ``op`` by ``route``, alone in this process."""
    os.environ["WHITEFORMER_BACKEND"] = "cpu" if route == "C++ kernel (padded)" else "torch"
    common.setup_torch(None)
    from whiteformer.ops import causal_tssa, tssa
    from whiteformer.ops.packing import from_padded, packed_layout, to_padded

    fn = causal_tssa if op == "causal_tssa" else tssa
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    w = torch.randn(1, heads, sum(lengths), p, requires_grad=True)
    temp = torch.ones(heads, 1)

    def run():
        if route != "padded":
            out = fn(w, temp, cu_seqlens=cu)
        else:
            pk = packed_layout(w, None, cu)
            out = from_padded(fn(to_padded(w, pk), temp, attn_mask=pk.mask), pk)
        out.square().sum().backward()

    run()  # warm-up
    w.grad = None
    with common.PeakMemory("cpu") as pm:
        t = common.time_call(run, "cpu")
    return dict(op=op, route=route, peak_bytes=pm.delta, mem_method=pm.method, time_s=t)


def table(result: Dict[str, Any]) -> str:
    body = [[r["op"], r["route"], fmt_bytes(r["peak_bytes"]), fmt_time(r["time_s"])] for r in result["rows"]]
    return common.markdown_table(["op", "route", "peak memory", "forward + backward"], body)


def section(result: Optional[Dict[str, Any]]) -> List[str]:
    """The docs/benchmarks.md section (:mod:`benchmarks.report`)."""
    out = ["## Packed documents (cu_seqlens): native path against the padded layout", ""]
    if not result:
        return out + ["Not run yet: `python -m benchmarks.packed_varlen --kernel`.", ""]
    lengths = _lengths(result["lengths"])
    return out + [
        f"One forward + backward (float32) of `causal_tssa` and `tssa` on one packed row of {len(lengths)} "
        f"documents (lengths {result['lengths']}: {sum(lengths)} tokens, {len(lengths) * max(lengths)} slots in "
        f"the padded layout), H = {result['heads']}, p = {result['p']}. \"padded\": the former PyTorch route "
        "(documents laid out as (S, H, L, p) with a mask); \"native\": per-document sums and prefix sums on the "
        "packed tokens; \"C++ kernel (padded)\": the fused CPU kernel on the padded layout. Peak memory: a "
        "separate process per cell, RSS high-water mark minus RSS before; time: that one call "
        f"({result['machine']['logical_cpus']} shared CPUs, load {result['machine']['loadavg'][0]:.1f}).",
        "",
        "```",
        result.get("command") or "python -m benchmarks.packed_varlen --kernel",
        "```",
        "",
        table(result),
        "",
        "Hence the fused kernels keep the padded layout only while it has at most `PADDED_WASTE_MAX` (2) times "
        "the packed tokens (`whiteformer.ops.packing`); not measured on GPU.",
        "",
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,8x100", help="document lengths, N or NxCOUNT, comma-separated")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--p", type=int, default=64)
    ap.add_argument("--kernel", action="store_true", help="also the C++ CPU kernel's route (its padded layout)")
    args = ap.parse_args(argv)
    lengths = _lengths(args.lengths)
    log(f"packed_varlen: {len(lengths)} documents, {sum(lengths)} tokens, padded layout "
        f"{len(lengths) * max(lengths)} slots, H={args.heads}, p={args.p}")
    routes = ["padded", "native"]
    if args.kernel:
        routes.append("C++ kernel (padded)")
    rows = [common.run_isolated(cell, op, route, lengths, args.heads, args.p, timeout=1800)
            for op in ("causal_tssa", "tssa") for route in routes]
    result = dict(lengths=args.lengths, heads=args.heads, p=args.p, rows=rows, machine=common.machine_info("cpu"),
                  command=common.command_string("benchmarks.packed_varlen", sys.argv[1:] if argv is None else argv))
    print(table(result))
    common.write_json(common.RESULTS_DIR / "packed_varlen.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
