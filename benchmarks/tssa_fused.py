"""Fused TSSA kernels vs the plain implementations.

Measures, side by side in one process, the time of ``tssa`` forward, forward+backward and
``causal_tssa`` forward (and forward+backward, for information) as a ratio to ``w.clone()``
(the cost of one read and one write of ``w``), for three implementations:

* ``reference``: :func:`whiteformer.ops.reference.tssa_reference` (the literal formula),
* ``torch``: the pure-PyTorch path of :func:`whiteformer.ops.tssa` (``whiteformer.ops.tssa.parallel``),
* ``fused``: :func:`whiteformer.ops.tssa` with the fused C++/OpenMP kernel (the default path
  when the kernel is available; recorded as unavailable otherwise).

Each op is timed in ``--repeats`` rounds of the pair (``w.clone()``, op) after ``--warmup`` calls;
the ratio reported is the median over rounds of time(op) / time(clone) of the same round, so
both see the same machine load (the ratio of the medians and of the minima are stored too; on
a busy shared machine the per-round ratio is the stable one). The memory kept for backward is the total size of the distinct storages
saved by autograd (``torch.autograd.graph.saved_tensors_hooks``), as a multiple of ``w``'s size.

Allocator. Every op returns new tensors of ``w``'s size (so does ``w.clone()``); with glibc's
default settings a freed 25 MB block is often returned to the OS, so the next allocation
page-faults on first touch, which on a VM can cost more than the computation. The suite runs
twice: ``default`` (as a user process would), then ``keep`` (``mallopt`` raises the mmap and
trim thresholds to 1 GiB, so freed blocks are reused: the ratios then compare the computation
and memory traffic only). ``--allocator`` picks one.

Targets (2 threads, float32, B=1, H=8, p=48, n=16384): tssa forward <= 3x clone, forward+backward
<= 8x, saved for backward <= 2x w (+ O(B H p) statistics), causal forward <= 4x.

Usage::

    python -m benchmarks.tssa_fused [--n 16384] [--heads 8] [--head-dim 48] [--batch 1]
                                    [--threads 2] [--repeats 30] [--warmup 3]

Writes ``benchmarks/results/tssa_fused.json`` (``--out``) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from . import common

TARGETS = {"tssa_fwd": 3.0, "tssa_fwdbwd": 8.0, "causal_fwd": 4.0, "saved_for_backward": 2.0}
OPS = ["tssa_fwd", "tssa_fwdbwd", "causal_fwd", "causal_fwdbwd"]


def implementations() -> Dict[str, Dict[str, Callable]]:
    """impl -> {"tssa": f(w, temp) -> out, "causal": f(w, temp) -> out}."""
    from whiteformer.ops import causal_tssa, tssa
    from whiteformer.ops.causal_tssa.parallel import causal_tssa_parallel
    from whiteformer.ops.reference import causal_tssa_reference, tssa_reference
    from whiteformer.ops.tssa.parallel import tssa_parallel

    return {
        "reference": {"tssa": tssa_reference, "causal": causal_tssa_reference},
        "torch": {
            "tssa": lambda w, t: tssa_parallel(w, t)[0],
            "causal": lambda w, t: causal_tssa_parallel(w, t)[0],
        },
        "fused": {"tssa": tssa, "causal": causal_tssa},
    }


def saved_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """Total size of the distinct storages autograd saves for backward while running ``fn``."""
    storages: Dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


def paired_times(op: Callable[[], Any], base: Callable[[], Any], repeats: int, warmup: int) -> Dict[str, Any]:
    for _ in range(warmup):
        base()
        op()
    t_op: List[float] = []
    t_base: List[float] = []
    for _ in range(repeats):
        t_base.append(common.time_call(base))
        t_op.append(common.time_call(op))
    med_op, med_base = statistics.median(t_op), statistics.median(t_base)
    return {
        "time_s": med_op,
        "time_min_s": min(t_op),
        "clone_s": med_base,
        "clone_min_s": min(t_base),
        "ratio": statistics.median(a / b for a, b in zip(t_op, t_base)),
        "ratio_of_medians": med_op / med_base,
        "ratio_min": min(t_op) / min(t_base),
        "runs": repeats,
    }


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


def run(args) -> Dict[str, Any]:
    from whiteformer.ops._kernels import fused_supported
    from whiteformer.ops._kernels.build import build_error

    b, h, n, p = args.batch, args.heads, args.n, args.head_dim
    w = torch.randn(b, h, n, p)
    temp = torch.rand(h, 1) + 0.5
    g = torch.randn_like(w)
    impls = implementations()
    fused_ok = fused_supported(w)
    rows: List[Dict[str, Any]] = []
    for name, fns in impls.items():
        if name == "fused" and not fused_ok:
            rows.append({"impl": name, "status": f"unavailable ({build_error() or 'disabled'})"})
            continue
        row: Dict[str, Any] = {"impl": name, "status": "ok"}
        wg = w.clone().requires_grad_(True)
        tg = temp.clone().requires_grad_(True)

        def fwdbwd(f, wg=wg, tg=tg):
            def call():
                wg.grad = None
                tg.grad = None
                f(wg, tg).backward(g)
            return call

        ops = {
            "tssa_fwd": lambda f=fns["tssa"]: f(w, temp),
            "tssa_fwdbwd": fwdbwd(fns["tssa"]),
            "causal_fwd": lambda f=fns["causal"]: f(w, temp),
            "causal_fwdbwd": fwdbwd(fns["causal"]),
        }
        for op in OPS:
            common.log(f"  {name} {op}")
            with torch.no_grad() if op.endswith("_fwd") else torch.enable_grad():
                row[op] = paired_times(ops[op], lambda: w.clone(), args.repeats, args.warmup)
        for kind in ("tssa", "causal"):
            row[f"{kind}_saved_bytes"] = saved_bytes(lambda f=fns[kind], wg=wg, tg=tg: f(wg, tg))
            row[f"{kind}_saved_x_w"] = row[f"{kind}_saved_bytes"] / w.nbytes
        rows.append(row)
    # agreement of the fused kernel with the reference on this input (float32)
    check: Dict[str, Any] = {}
    if fused_ok:
        for kind in ("tssa", "causal"):
            ref = impls["reference"][kind](w, temp)
            check[kind] = max_rel_diff(impls["fused"][kind](w, temp), ref)
    return {"rows": rows, "fused_vs_reference_max_rel_diff": check}


def table(results: Dict[str, Any]) -> str:
    header = ["allocator", "impl", "tssa fwd", "tssa fwd+bwd", "causal fwd", "causal fwd+bwd",
              "saved for bwd (tssa / causal)"]
    lines = []
    for mode, result in results.items():
        for r in result["rows"]:
            if r["status"] != "ok":
                lines.append([mode, r["impl"], r["status"], "", "", "", ""])
                continue
            cells = [f"{r[op]['ratio']:.2f}x ({r[op]['ratio_min']:.2f}x)" for op in OPS]
            lines.append([mode, r["impl"], *cells, f"{r['tssa_saved_x_w']:.2f}x w / {r['causal_saved_x_w']:.2f}x w"])
    lines.append(["", "target", "<= 3x", "<= 8x", "<= 4x", "-", "<= 2x w"])
    return common.markdown_table(header, lines)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Run the benchmark (command-line ``argv``), write the JSON and print the table; returns the
    JSON content."""
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=48)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--allocator", choices=["both", "default", "keep"], default="both",
                    help="glibc allocator settings to measure under (see the module docstring)")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "tssa_fused.json")
    args = ap.parse_args(argv)
    command = common.command_string("benchmarks.tssa_fused", argv)
    t0 = time.time()
    common.setup_torch(args.threads, seed=0)
    env_start = common.row_env(command, threads=args.threads)
    results: Dict[str, Any] = {}
    for mode in (["default", "keep"] if args.allocator == "both" else [args.allocator]):
        if mode == "keep" and not common.keep_freed_memory():
            results[mode] = {"rows": [], "fused_vs_reference_max_rel_diff": {}, "status": "mallopt unavailable"}
            continue
        common.log(f"allocator: {mode}")
        results[mode] = run(args)
    out = {
        **env_start,
        "loadavg_end": common.loadavg(),
        "config": {"batch": args.batch, "heads": args.heads, "n": args.n, "head_dim": args.head_dim,
                   "dtype": "float32", "repeats": args.repeats, "warmup": args.warmup},
        "timing": "rounds of the pair (w.clone(), op); ratio = median over rounds of time(op) / time(clone)",
        "targets": TARGETS,
        "wall_s": round(time.time() - t0, 1),
        "results": results,
    }
    path = common.write_json(args.out, out)
    print(f"machine: {out['machine']}; threads {out['threads']}; torch {out['torch']}; "
          f"load {out['loadavg']} -> {out['loadavg_end']}")
    print(f"command: {command}")
    print(f"B={args.batch} H={args.heads} p={args.head_dim} n={args.n}, float32; time / time of w.clone(): "
          f"median of per-round ratios (ratio of minima in brackets)\n")
    print(table(results))
    for mode, result in results.items():
        if result["fused_vs_reference_max_rel_diff"]:
            print(f"\nfused vs reference, max rel diff (float32, {mode}): {result['fused_vs_reference_max_rel_diff']}")
    print(f"\nwrote {path}")
    return out


if __name__ == "__main__":
    main()
