"""How close ``tssa`` and ``causal_tssa`` run to the memory-traffic floor, as a multiple of ``w.clone()``.

``w.clone()`` reads and writes ``w`` once; TSSA needs three dependent passes over ``w`` (feature
energies; logits, softmax over heads and Pi-weighted moments; output) and one write, so its
traffic floor is about 2x a clone from DRAM (less where a head's ``w`` stays in cache).

Measured in one process, float32 on CPU, at each ``torch.set_num_threads`` value of ``--threads``:

* forward of :func:`whiteformer.ops.tssa` and :func:`whiteformer.ops.causal_tssa` at each
  (B, H, N, p) of ``--sizes`` (w of shape (B, H, N, p));
* forward + backward (``out.backward(g)``) of both at the sizes with the largest N;
* the bare C++ kernel of each forward (the extension's ``tssa_fwd`` / ``causal_fwd``, called
  directly), where the default call takes it: each forward row records its ratio to the clone
  (``kernel_ratio``) and the median of time(call) - time(kernel) (``call_overhead_us``: argument
  checks at the door, the layout, dispatch), from rounds of their own in which every timed call
  follows the same untimed clone (:func:`kernel_share`), which splits a miss into the kernel's
  share and the rest;
* the overflow guard: the time of :func:`whiteformer.ops.scaling.rows_beyond_kernel_range` (the pass
  over ``w`` that finds rows with some |w| past the kernels' range) as a share of the ``tssa``
  forward. The C++ kernels flag such rows from their own sums, so on their path the guard is no
  separate pass (share 0; the standalone share of the pass is recorded for information).

Each row also records the minor page faults per call of the op and of the clone (a few calls after
the timed rounds): a clone that faults (glibc hands the block back to the system once the heap's
free top passes its trim threshold, e.g. after a backward's temporaries) takes several times its
copy, so a ratio against it reads better than the op is. The forward + backward rows also carry
the clone time of the forward rounds of the same size.

Allocator. Every op returns new tensors of ``w``'s size, as does the clone; with glibc's default
settings a freed block of several MB is often handed back to the system, so the next allocation
page-faults on first touch (the kernel zeroes every page), which can cost more than the op's
passes. ``--allocator both`` (the default) measures everything twice, tagging each row: first
``default`` (as a user process runs), then ``keep`` (``mallopt`` raises the mmap and trim
thresholds, so freed blocks are reused: the ratios compare computation and memory traffic only;
the same as ``GLIBC_TUNABLES=glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=1073741824``
or a caching allocator such as jemalloc / tcmalloc preloaded).

Timing: ``--rounds`` round-robin rounds over the candidates (clone, tssa, causal_tssa, guard) after
one untimed call of each, so that a change of machine load affects all alike; the ratio is the
median over rounds of time(op) / time(clone) of the same round. Each row names the target it is
compared with (``TARGETS``) and whether it is met; a row that misses its target carries a short
profile of one call (``torch.profiler``: the top 3 ops by self CPU time; the C++ kernels record
each of their passes as a range of its own, so the entries name the passes).

Usage::

    python -m benchmarks.op_floor [--threads 1,2] [--rounds 21] [--allocator both] [--quick] [--out PATH]

Writes ``benchmarks/results/op_floor.json`` (``--quick``: tiny sizes, ``op_floor_quick.json``) and
prints a markdown table.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import common

SIZES = [(1, 8, 16384, 48)] + [(4, 8, n, 48) for n in (256, 1024, 4096, 16384)]
QUICK_SIZES = [(1, 2, 64, 8), (2, 2, 128, 8)]
GUARD_TARGET = 0.05


def target_for(op: str, b: int, n: int, threads: int) -> Optional[Tuple[float, str]]:
    """(ratio to clone, description) of the target a row is compared with, or None."""
    if op == "tssa_fwd" and n == 16384:
        return 1.7, "tssa forward <= 1.7x clone at N 16k"
    if op == "tssa_fwd" and n == 1024 and b == 4 and threads == 1:
        return 2.5, "tssa forward <= 2.5x clone at N 1k (B 4, 1 thread)"
    if op == "causal_fwd" and n == 16384:
        return 1.9, "causal_tssa forward <= 1.9x clone at N 16k"
    if op.endswith("_fwdbwd") and n == 16384:
        return 4.0, "forward + backward <= 4.0x clone at N 16k"
    return None


def top_ops(fn: Callable[[], Any], k: int = 3) -> List[Dict[str, Any]]:
    """The ``k`` ops with the most self CPU time in one call of ``fn`` (name, self time, share)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [{"op": e.key, "self_cpu_us": round(e.self_cpu_time_total, 1),
             "share": round(e.self_cpu_time_total / total, 3), "calls": e.count} for e in events[:k]]


def minor_faults(fn: Callable[[], Any], calls: int = 3) -> float:
    """Minor page faults per call of ``fn`` (the memory the allocator maps afresh and the kernel
    zeroes on first touch: a clone of a block that glibc returned to the system costs several times
    its copy), over ``calls`` calls after the timed rounds."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def path_of(w: torch.Tensor) -> Dict[str, Any]:
    """Which kernel the default call takes on ``w`` and whether the guard is a separate pass there."""
    from whiteformer.ops._kernels import fused_supported, kernel_for

    if kernel_for("tssa", w) is not None:
        return {"kernel": "registered backend", "guard_separate_pass": True}
    if fused_supported(w):
        return {"kernel": "C++ fused", "guard_separate_pass": False}
    return {"kernel": "PyTorch", "guard_separate_pass": False}


def bare_kernels(w: torch.Tensor, temp: torch.Tensor, path: Dict[str, Any]) -> Dict[str, Callable[[], Any]]:
    """The forwards' bare C++ kernels (keyed ``<op>_kernel``) with the arguments the default call
    passes them, where the default call takes them on ``w`` (``path``: :func:`path_of`); else none."""
    from whiteformer.ops._kernels import fused

    if path["kernel"] != "C++ fused":
        return {}
    ext = fused._ext()
    return {"tssa_fwd_kernel": lambda: ext.tssa_fwd(w, temp, None, fused.CHUNK),
            "causal_fwd_kernel": lambda: ext.causal_fwd(w, temp, None, None, fused.CAUSAL_MODE, fused.CHUNK)}


def kernel_share(op_fn: Callable[[], Any], kernel_fn: Callable[[], Any], clone_fn: Callable[[], Any],
                 rounds: int) -> Dict[str, Any]:
    """The bare kernel's ratio to the clone and the call's time beyond the kernel, from rounds of
    (clone, call, kernel) in which each timed call follows the same untimed clone of ``w``: in the
    main rounds a candidate's predecessor decides how much of ``w`` is still in cache (the guard's
    pass leaves it warm for whatever follows), which at 16k tokens moves a call by more than its
    Python work costs."""
    times: Dict[str, List[float]] = {"clone": [], "op": [], "kernel": []}
    for _ in range(rounds):
        for key, fn in (("clone", clone_fn), ("op", op_fn), ("kernel", kernel_fn)):
            clone_fn()
            times[key].append(common.time_call(fn))
    return {"kernel_ratio": statistics.median(a / b for a, b in zip(times["kernel"], times["clone"])),
            "call_overhead_us": statistics.median(a - b for a, b in zip(times["op"], times["kernel"])) * 1e6}


def _ratios(times: Dict[str, List[float]], op: str) -> Dict[str, Any]:
    t_op, t_base = times[op], times["clone"]
    return {
        "ratio": statistics.median(a / b for a, b in zip(t_op, t_base)),
        "ratio_of_medians": statistics.median(t_op) / statistics.median(t_base),
        "time_s": statistics.median(t_op),
        "clone_s": statistics.median(t_base),
    }


def _row(op: str, size, threads: int, stats: Dict[str, Any], fn: Callable[[], Any]) -> Dict[str, Any]:
    b, h, n, p = size
    row: Dict[str, Any] = {"op": op, "batch": b, "heads": h, "n": n, "head_dim": p, "threads": threads, **stats}
    tgt = target_for(op, b, n, threads)
    row["target"] = tgt[0] if tgt else None
    row["target_text"] = tgt[1] if tgt else None
    row["met"] = None if tgt is None else bool(stats["ratio"] <= tgt[0])
    row["minor_faults_per_call"] = minor_faults(fn)
    if row["met"] is False:
        row["profile_top3"] = top_ops(fn)
    return row


def measure(size, threads: int, rounds: int, backward: bool) -> List[Dict[str, Any]]:
    """The rows of one (size, thread count): forward ratios, the guard's share, and (``backward``)
    forward + backward ratios."""
    from whiteformer.ops import causal_tssa, tssa
    from whiteformer.ops.scaling import rows_beyond_kernel_range

    torch.set_num_threads(threads)
    b, h, n, p = size
    w = torch.randn(b, h, n, p)
    temp = torch.rand(h, 1) + 0.5
    load = common.loadavg()
    fwd = {"clone": lambda: w.clone(), "tssa_fwd": lambda: tssa(w, temp), "causal_fwd": lambda: causal_tssa(w, temp),
           "guard": lambda: rows_beyond_kernel_range(w)}
    with torch.no_grad():
        times = common.interleaved_runs(fwd, rounds=rounds)
        path = path_of(w)
        kernels = bare_kernels(w, temp, path)
        rows = [_row(op, size, threads, {**_ratios(times, op), **(kernel_share(
            fwd[op], kernels[f"{op}_kernel"], fwd["clone"], rounds) if kernels else {})}, fwd[op])
                for op in ("tssa_fwd", "causal_fwd")]
        clone_faults = minor_faults(fwd["clone"])
        for r in rows:
            _set_clone_faults(r, clone_faults, fwd[r["op"]])
        alone = statistics.median(a / b for a, b in zip(times["guard"], times["tssa_fwd"]))
        share = alone if path["guard_separate_pass"] else 0.0
        rows.append({"op": "overflow_guard", "batch": b, "heads": h, "n": n, "head_dim": p, "threads": threads,
                     **path, "share_of_fwd": share, "standalone_share_of_fwd": alone,
                     "guard_s": statistics.median(times["guard"]), "target": GUARD_TARGET,
                     "target_text": "overflow guard <= 5 % of the tssa forward", "met": bool(share <= GUARD_TARGET)})
    if backward:
        wg = w.clone().requires_grad_(True)
        tg = temp.clone().requires_grad_(True)
        g = torch.randn_like(w)

        def fwdbwd(f):
            def call():
                wg.grad = tg.grad = None
                f(wg, tg).backward(g)
            return call

        bwd = {"clone": lambda: w.clone(), "tssa_fwdbwd": fwdbwd(tssa), "causal_fwdbwd": fwdbwd(causal_tssa)}
        times = common.interleaved_runs(bwd, rounds=rounds)
        extra = [_row(op, size, threads, _ratios(times, op), bwd[op]) for op in ("tssa_fwdbwd", "causal_fwdbwd")]
        clone_faults = minor_faults(bwd["clone"])
        for r in extra:  # the clone of these rounds may fault where the forward rounds' did not
            _set_clone_faults(r, clone_faults, bwd[r["op"]])
            r["clone_s_forward_rounds"] = rows[0]["clone_s"]
        rows += extra
    for r in rows:
        r["loadavg"] = load
    return rows


def run(sizes: Sequence[Tuple[int, int, int, int]], threads: Sequence[int], rounds: int,
        allocator: str = "default") -> List[Dict[str, Any]]:
    """The rows of every (thread count, size), each tagged with ``allocator`` (the caller has set it)."""
    top_n = max(s[2] for s in sizes)
    rows: List[Dict[str, Any]] = []
    before = torch.get_num_threads()
    try:
        for t in threads:
            for size in sizes:
                common.log(f"  allocator {allocator}, threads {t}, (B, H, N, p) = {size}")
                rows += [{"allocator": allocator, **r} for r in measure(size, t, rounds, backward=size[2] == top_n)]
    finally:
        torch.set_num_threads(before)
    return rows


def _set_clone_faults(row: Dict[str, Any], faults: float, fn: Callable[[], Any]) -> None:
    """Record the clone's page faults per call; where it faulted, its time is mostly first touch,
    not a copy, so the row's target is not judged (``met`` None, ``not_judged`` says why; the
    row's call is profiled as a miss's is)."""
    row["clone_minor_faults_per_call"] = faults
    if faults > 0 and row.get("target") is not None:
        row["met"] = None
        row["not_judged"] = f"the clone page-faulted ({faults:.0f} per call): its time is not a copy's"
        row.setdefault("profile_top3", top_ops(fn))


def _fmt_met(r: Dict[str, Any]) -> str:
    if r.get("not_judged"):
        return "n/a (clone faulted)"
    return "-" if r.get("met") is None else ("yes" if r["met"] else "**no**")


def table(result: Dict[str, Any]) -> str:
    header = ["allocator", "threads", "B", "N", "op", "time / clone", "bare kernel", "call - kernel", "clone",
              "target", "met", "top op by self CPU (missed, not judged)"]
    lines = []
    for r in result["rows"]:
        head = [r.get("allocator", "default"), r["threads"], r["batch"], common.fmt_tokens(r["n"])]
        if r["op"] == "overflow_guard":
            cell = (f"{r['share_of_fwd']:.1%} of fwd" if r["guard_separate_pass"]
                    else f"no separate pass ({r['kernel']}; alone {r['standalone_share_of_fwd']:.1%})")
            lines.append(head + ["overflow guard", cell, "-", "-", "-", "<= 5 %", _fmt_met(r), ""])
            continue
        prof = r.get("profile_top3") or []
        top = f"`{prof[0]['op']}` {prof[0]['share']:.0%}" if prof else ""
        target = f"<= {r['target']}x" if r["target"] is not None else "-"
        kernel = f"{r['kernel_ratio']:.2f}x" if "kernel_ratio" in r else "-"
        extra = f"{r['call_overhead_us']:.0f} µs" if "call_overhead_us" in r else "-"
        lines.append(head + [r["op"], f"{r['ratio']:.2f}x", kernel, extra, common.fmt_time(r["clone_s"]), target,
                             _fmt_met(r), top])
    return common.markdown_table(header, lines)


def _span(values: Sequence[float], fmt: str, unit: str = "") -> str:
    """"lo-hi unit" of ``values`` in ``fmt`` (one value alone; "n/a" for none)."""
    if not values:
        return "n/a"
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return (lo if lo == hi else f"{lo}-{hi}") + unit


def reading_values(result: Dict[str, Any]) -> Dict[str, str]:
    """The figures that the reading of the table (docs/templates/benchmarks/op_floor.md) quotes, taken
    from the same results, so that prose and table agree after every rerun: the call's time beyond
    the bare kernel and the clone at the smallest N, the profile shares of the forward's passes,
    the bare kernel at N 1k, the page faults of the forward + backward at B 1, N 16k, 1 thread, and
    the clone's at the largest batch under the default allocator."""
    rows = [r for r in result.get("rows", []) if r["op"] != "overflow_guard"]
    small = min((r["n"] for r in rows), default=0)
    fwd = [r for r in rows if r["op"] == "tssa_fwd"]

    def share(name: str) -> List[float]:
        return [100 * p["share"] for r in fwd for p in r.get("profile_top3", []) if p["op"].startswith(name)]

    def where(op: str, **kw: Any) -> List[Dict[str, Any]]:
        return [r for r in rows if r["op"] == op and all(r.get(k) == v for k, v in kw.items())]

    big_b = max((r["batch"] for r in rows), default=0)
    return {
        "small_n": common.fmt_tokens(small) if small else "n/a",
        "overhead_small": _span([r["call_overhead_us"] for r in rows if r["n"] == small and "call_overhead_us" in r],
                                "{:.0f}", " µs"),
        "clone_small": _span([1e6 * r["clone_s"] for r in rows if r["n"] == small], "{:.0f}", " µs"),
        "middle_share": _span(share("tssa_fwd: logits"), "{:.0f}", " %"),
        "out_share": _span(share("tssa_fwd: out"), "{:.0f}", " %"),
        "kernel_1k": _span([r["kernel_ratio"] for r in where("tssa_fwd", n=1024, batch=4, threads=1)
                            if "kernel_ratio" in r], "{:.2f}", "x"),
        "faults_default": _span([r["minor_faults_per_call"] for r in where(
            "tssa_fwdbwd", batch=1, n=16384, threads=1, allocator="default")], "{:.0f}"),
        "faults_keep": _span([r["minor_faults_per_call"] for r in where(
            "tssa_fwdbwd", batch=1, n=16384, threads=1, allocator="keep")], "{:.0f}"),
        "clone_faults_big": _span([r["clone_minor_faults_per_call"] for r in rows if r["batch"] == big_b
                                   and r.get("allocator", "default") == "default" and r["n"] == 16384], "{:,.0f}"),
    }


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Run the benchmark (command-line ``argv``), write the JSON and print the table; returns the
    JSON content."""
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m benchmarks.op_floor", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=common.int_list, default=[1, 2], help="comma-separated thread counts")
    ap.add_argument("--rounds", type=int, default=21, help="round-robin rounds (median over them)")
    ap.add_argument("--allocator", choices=["both", "default", "keep"], default="both",
                    help="glibc allocator settings to measure under, in this order (see the module docstring)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 3 rounds, into *_quick.json")
    ap.add_argument("--rounds-note", default="", help="why fewer rounds than the default were run (recorded)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1 or not args.threads or min(args.threads) < 1:
        ap.error("--rounds and every --threads value must be >= 1")
    sizes = QUICK_SIZES if args.quick else SIZES
    rounds = min(args.rounds, 3) if args.quick else args.rounds
    out_path = args.out or common.RESULTS_DIR / ("op_floor_quick.json" if args.quick else "op_floor.json")
    command = common.command_string("benchmarks.op_floor", argv)
    t0 = time.time()
    common.setup_torch(None, seed=0)
    env = common.row_env(command, threads=None)
    env.pop("threads")
    rows: List[Dict[str, Any]] = []
    allocators = ["default", "keep"] if args.allocator == "both" else [args.allocator]
    for mode in allocators:  # default first: keep cannot be undone in the process
        if mode == "keep" and not common.keep_freed_memory():
            common.log("allocator keep: mallopt unavailable, not measured")
            continue
        rows += run(sizes, args.threads, rounds, mode)
    out = {
        **env,
        "loadavg_end": common.loadavg(),
        "threads": list(args.threads),
        "config": {"sizes_bhnp": [list(s) for s in sizes], "dtype": "float32", "rounds": rounds,
                   "allocators": sorted({r["allocator"] for r in rows}, key=allocators.index),
                   "rounds_note": args.rounds_note, "quick": args.quick, "omp_num_threads": os.environ.get(
                       "OMP_NUM_THREADS"),
                   "allocator_env": {k: os.environ[k] for k in ("GLIBC_TUNABLES", "LD_PRELOAD") if k in os.environ}},
        "timing": "round-robin rounds over (w.clone(), ops); ratio = median over rounds of time(op) / time(clone)",
        "wall_s": round(time.time() - t0, 1),
        "rows": rows,
    }
    bad = [r for r in rows if "ratio" in r and not (math.isfinite(r["ratio"]) and r["ratio"] > 0)]
    if bad:
        raise RuntimeError(f"non-positive or non-finite ratio in {bad[0]}")
    path = common.write_json(out_path, out)
    print(f"machine: {out['machine']}; torch {out['torch']}; load {out['loadavg']} -> {out['loadavg_end']}")
    print(f"command: {command}\n")
    print(table(out))
    print(f"\nwrote {path}")
    return out


if __name__ == "__main__":
    main()
