"""GPU benchmark of the TSSA operators: the Triton kernels vs the PyTorch path vs
``torch.compile`` of the PyTorch path, and a 12-layer TSSA stack vs MHSA through
``F.scaled_dot_product_attention`` (FlashAttention on a recent GPU). Needs a CUDA GPU.

1. **Operators** (w of shape (B, H, n, p), ``--dtype``): time of ``tssa`` forward, forward +
   backward, ``causal_tssa`` forward, forward + backward, each as a multiple of ``w.clone()``
   (one read and one write of w), timed with CUDA events in ``--repeats`` rounds of the pair
   (clone, op) after ``--warmup`` calls; the ratio is the median over rounds of
   time(op) / time(clone). Per op also the peak memory (``torch.cuda.max_memory_allocated``
   minus the memory allocated before the call) and, for the differentiable calls, the bytes
   autograd saves for backward (distinct storages seen by ``saved_tensors_hooks``).
   Implementations are chosen through ``WHITEFORMER_BACKEND`` (``triton`` / ``torch``) around
   the public ops; ``compile`` is ``torch.compile`` of the public op with the PyTorch path.
2. **Stack**: 12 residual layers of TSSA (Triton), TSSA (PyTorch path) and MHSA (SDPA) at
   d = H * p, forward and forward + backward at n = ``--stack-n`` (4k ... 64k tokens), batch 1:
   time and peak memory. A configuration that runs out of memory is recorded as such.

Targets (H100-class GPU, float16/bfloat16, B=1, H=8, p=64): tssa forward <= 2x clone,
forward + backward <= 6x, causal forward + backward <= 8x, saved for backward <= 1.1x w plus
O(B H N) (checked as <= 1.1 * bytes(w) + 8 float32 values per (b, h, token)).

Usage::

    python -m benchmarks.gpu [--n 16384] [--batch 1] [--heads 8] [--head-dim 64] [--dtype bfloat16]
                             [--stack-n 4096,8192,16384,32768,65536] [--depth 12] [--repeats 20]
                             [--warmup 3] [--out benchmarks/results/gpu.json]

Writes ``benchmarks/results/gpu.json`` (``--out``) and prints markdown tables; the GPU section of
docs/benchmarks.md is generated from that file (:mod:`benchmarks.report`). Without a CUDA GPU
the command refuses with one error line (exit code 2).

``python -m benchmarks.gpu --model`` needs no GPU: the memory-traffic model of the kernels
(:mod:`benchmarks.kernels.traffic`; launches recorded, nothing runs) per op and head
dim at B=``--batch`` H=``--heads`` n=``--n`` in ``--dtype``: bytes moved per call / the op's minimum
and the time that traffic takes at H100's 3.35 TB/s, written to ``benchmarks/results/gpu_model.json``
(``--model-out``). Goals: forward <= 2x and backward <= 3x the minimum (tssa, causal_tssa at head
dims 64 and 128).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from . import common

TARGETS = {"tssa_fwd": 2.0, "tssa_fwdbwd": 6.0, "causal_fwdbwd": 8.0, "saved_x_w": 1.1}
SAVED_PER_TOKEN_FLOATS = 8  # the O(B H N) allowance of the saved-for-backward target
OPS = ["tssa_fwd", "tssa_fwdbwd", "causal_fwd", "causal_fwdbwd"]
IMPLS = ["triton", "torch", "compile"]
STACK_METHODS = {"tssa (triton)": ("tssa", "triton"), "tssa (torch)": ("tssa", "torch"),
                 "mhsa (sdpa)": ("mhsa_sdpa", "torch")}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ENV = "WHITEFORMER_BACKEND"


class NoGPU(RuntimeError):
    pass


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """``WHITEFORMER_BACKEND=name`` inside the block (the ops read it at each call)."""
    old = os.environ.get(ENV)
    os.environ[ENV] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


def cuda_time(fn: Callable[[], Any], device: str = "cuda") -> float:
    """Seconds of one call, measured with CUDA events (wall clock on a CPU, for dry runs)."""
    if not device.startswith("cuda"):
        return common.time_call(fn, device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def clone_ratio(op: Callable[[], Any], base: Callable[[], Any], repeats: int, warmup: int,
                device: str = "cuda") -> Dict[str, Any]:
    for _ in range(warmup):
        base()
        op()
    t_op: List[float] = []
    t_base: List[float] = []
    for _ in range(repeats):
        t_base.append(cuda_time(base, device))
        t_op.append(cuda_time(op, device))
    return {"time_s": statistics.median(t_op), "clone_s": statistics.median(t_base),
            "ratio": statistics.median(a / b for a, b in zip(t_op, t_base)), "ratio_min": min(t_op) / min(t_base),
            "runs": repeats}


def peak_bytes(fn: Callable[[], Any], device: str = "cuda") -> int:
    with common.PeakMemory(device) as mem:
        fn()
    return int(mem.delta)


def op_functions(impl: str) -> Dict[str, Callable]:
    """kind -> f(w, temp) -> out for one implementation."""
    from whiteformer.ops import causal_tssa, tssa

    name = "triton" if impl == "triton" else "torch"

    def wrap(f):
        def call(w, temp):
            with backend(name):
                return f(w, temp)
        return call

    fns = {"tssa": wrap(tssa), "causal": wrap(causal_tssa)}
    if impl == "compile":
        with backend("torch"):
            fns = {k: wrap(torch.compile(v)) for k, v in {"tssa": tssa, "causal": causal_tssa}.items()}
    return fns


def bench_ops(args, dtype: torch.dtype, device: str = "cuda", impls: Sequence[str] = IMPLS) -> List[Dict[str, Any]]:
    from .tssa_fused import saved_bytes

    b, h, n, p = args.batch, args.heads, args.n, args.head_dim
    dev = device
    w = torch.randn(b, h, n, p, device=dev, dtype=dtype)
    temp = torch.rand(h, 1, device=dev) + 0.5
    g = torch.randn_like(w)
    wg, tg = w.clone().requires_grad_(True), temp.clone().requires_grad_(True)
    allowance = SAVED_PER_TOKEN_FLOATS * 4 * b * h * n
    rows = []
    for impl in impls:
        row: Dict[str, Any] = {"impl": impl, "status": "ok"}
        if impl == "triton" and importlib.util.find_spec("triton") is None:
            rows.append({"impl": impl, "status": "unavailable (triton is not installed)"})
            continue
        try:
            fns = op_functions(impl)

            def fwdbwd(f):
                def call():
                    wg.grad = None
                    tg.grad = None
                    f(wg, tg).backward(g)
                return call

            ops = {"tssa_fwd": lambda: fns["tssa"](w, temp), "tssa_fwdbwd": fwdbwd(fns["tssa"]),
                   "causal_fwd": lambda: fns["causal"](w, temp), "causal_fwdbwd": fwdbwd(fns["causal"])}
            for op in OPS:
                common.log(f"  {impl} {op}")
                with torch.no_grad() if op.endswith("_fwd") else torch.enable_grad():
                    row[op] = clone_ratio(ops[op], lambda: w.clone(), args.repeats, args.warmup, dev)
                    row[op]["peak_bytes"] = peak_bytes(ops[op], dev)
            for kind in ("tssa", "causal"):
                saved = saved_bytes(lambda f=fns[kind]: f(wg, tg))
                row[f"{kind}_saved_bytes"] = saved
                row[f"{kind}_saved_x_w"] = saved / w.nbytes
                row[f"{kind}_saved_ok"] = saved <= TARGETS["saved_x_w"] * w.nbytes + allowance
        except Exception as e:  # noqa: BLE001 - e.g. triton missing, compile failure: record, go on
            row = {"impl": impl, "status": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        rows.append(row)
        empty_cache(dev)
    return rows


def empty_cache(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def bench_stack(args, dtype: torch.dtype, device: str = "cuda",
                methods: Sequence[str] = tuple(STACK_METHODS)) -> List[Dict[str, Any]]:
    from .attention_scaling import build_stack

    dim = args.heads * args.head_dim
    rows = []
    for label in methods:
        method, impl = STACK_METHODS[label]
        if impl == "triton" and importlib.util.find_spec("triton") is None:
            rows += [{"method": label, "n": n, "fwd_status": "triton not installed", "fwdbwd_status": "triton not installed"}
                     for n in args.stack_n]
            continue
        model = build_stack(method, dim, args.heads, args.depth).to(device, dtype)
        for n in args.stack_n:
            row: Dict[str, Any] = {"method": label, "n": n, "dim": dim, "depth": args.depth}
            for mode in ("fwd", "fwdbwd"):
                x = torch.randn(1, n, dim, device=device, dtype=dtype, requires_grad=mode == "fwdbwd")

                def call(x=x, mode=mode, model=model):
                    with backend(impl):
                        if mode == "fwd":
                            with torch.no_grad():
                                model(x)
                        else:
                            model(x).float().square().mean().backward()

                common.log(f"  stack {label} n={n} {mode}")
                try:
                    call()  # warm-up at this size
                    times = [cuda_time(call, device) for _ in range(max(1, args.stack_repeats))]
                    row[f"{mode}_s"] = statistics.median(times)
                    row[f"{mode}_peak_bytes"] = peak_bytes(call, device)
                except torch.cuda.OutOfMemoryError:
                    row[f"{mode}_s"] = None
                    row[f"{mode}_status"] = "out of memory"
                model.zero_grad(set_to_none=True)
                del x
                empty_cache(device)
            rows.append(row)
        del model
        empty_cache(device)
    return rows


def ops_table(rows: List[Dict[str, Any]]) -> str:
    header = ["impl", "tssa fwd", "tssa fwd+bwd", "causal fwd", "causal fwd+bwd", "saved for bwd (tssa / causal)"]
    lines = []
    for r in rows:
        if r["status"] != "ok":
            lines.append([r["impl"], r["status"], "", "", "", ""])
            continue
        cells = [f"{r[op]['ratio']:.2f}x ({common.fmt_bytes(r[op]['peak_bytes'])})" for op in OPS]
        lines.append([r["impl"], *cells, f"{r['tssa_saved_x_w']:.2f}x w / {r['causal_saved_x_w']:.2f}x w"])
    lines.append(["target", "<= 2x", "<= 6x", "-", "<= 8x", "<= 1.1x w + O(BHN)"])
    return common.markdown_table(header, lines)


def stack_table(rows: List[Dict[str, Any]]) -> str:
    header = ["method", "n", "fwd", "fwd peak", "fwd+bwd", "fwd+bwd peak"]
    lines = []
    for r in rows:
        cells = []
        for mode in ("fwd", "fwdbwd"):
            if r.get(f"{mode}_s") is None:
                cells += [r.get(f"{mode}_status", "-"), "-"]
            else:
                cells += [common.fmt_time(r[f"{mode}_s"]), common.fmt_bytes(r[f"{mode}_peak_bytes"])]
        lines.append([r["method"], common.fmt_tokens(r["n"]), *cells])
    return common.markdown_table(header, lines)


def _sizes(text: str) -> List[int]:
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token counts, got {text!r}")
    return sizes


MODEL_OPS = ("tssa", "causal_tssa", "causal_tssa_step")
MODEL_HEAD_DIMS = (16, 32, 64, 128, 256)
MODEL_GOALS = {"fwd": 2.0, "bwd": 3.0}
MODEL_GOAL_OPS, MODEL_GOAL_DIMS = ("tssa", "causal_tssa"), (64, 128)


def traffic_model(args) -> Dict[str, Any]:
    """The traffic model's rows (no GPU; needs ``triton`` for the launch recorder)."""
    if importlib.util.find_spec("triton") is None:
        raise NoGPU("benchmarks.gpu --model needs the 'triton' package (pip install 'whiteformer[triton]')")
    from whiteformer.ops._kernels.triton import _tiles

    from .kernels.traffic import H100_BYTES_PER_S, op_traffic

    dtype = DTYPES[args.dtype]
    rows = []
    for op in MODEL_OPS:
        for p in MODEL_HEAD_DIMS:
            t = _tiles.tiles(args.heads, p, dtype)
            row: Dict[str, Any] = {"op": op, "head_dim": p, "block_n": t.block_n, "chunk": t.chunk,
                                   "num_warps": t.num_warps}
            for res in op_traffic(op, batch=args.batch, heads=args.heads, tokens=args.n, head_dim=p, dtype=dtype):
                row[res.direction] = {
                    "bytes": res.total, "min_bytes": res.minimum, "ratio": res.ratio,
                    "time_s": res.seconds(H100_BYTES_PER_S), "min_time_s": res.minimum / H100_BYTES_PER_S,
                    "launches": [{"kernel": k, "bytes": b} for k, b in res.launches],
                    "host_bytes": sum(b for _, b in res.host)}
                goal = MODEL_GOALS[res.direction]
                if op in MODEL_GOAL_OPS and p in MODEL_GOAL_DIMS:
                    row[res.direction]["goal"] = goal
                    row[res.direction]["goal_met"] = res.ratio <= goal
            rows.append(row)
    return {"config": {"batch": args.batch, "heads": args.heads, "n": args.n, "dtype": args.dtype},
            "bandwidth_bytes_per_s": H100_BYTES_PER_S, "tile_budget": {
                "tile_elems": _tiles.TILE_ELEMS, "thread_elems": _tiles.THREAD_ELEMS, "chunk": _tiles.CHUNK},
            "goals": MODEL_GOALS, "rows": rows}


def op_model_bytes(op: str, *, batch: int, heads: int, n: int, head_dim: int, dtype: torch.dtype) -> Dict[str, Any]:
    """The traffic model of one call of ``op`` (``tssa`` / ``causal_tssa``): bytes moved forward and
    backward and the op's minimum each way (needs ``triton``; nothing runs)."""
    from .kernels.traffic import op_traffic

    fwd, bwd = op_traffic(op, batch=batch, heads=heads, tokens=n, head_dim=head_dim, dtype=dtype)
    return {"fwd_bytes": fwd.total, "bwd_bytes": bwd.total, "fwd_min_bytes": fwd.minimum,
            "bwd_min_bytes": bwd.minimum}


def model_table(rows: List[Dict[str, Any]]) -> str:
    header = ["op", "p", "BLOCK_N / warps", "fwd traffic / min", "fwd at 3.35 TB/s (min)", "bwd traffic / min",
              "bwd at 3.35 TB/s (min)"]
    lines = []
    for r in rows:
        cells = []
        for d in ("fwd", "bwd"):
            x = r[d]
            mark = "" if "goal" not in x else (f" (goal <= {x['goal']:g}x: {'met' if x['goal_met'] else 'NOT met'})")
            times = f"{common.fmt_time(x['time_s'])} ({common.fmt_time(x['min_time_s'])})"
            cells += [f"{x['ratio']:.2f}x{mark}", times]
        tiles = "- (one token)" if r["op"] == "causal_tssa_step" else f"{r['block_n']} / {r['num_warps']}"
        lines.append([r["op"], str(r["head_dim"]), tiles, *cells])
    return common.markdown_table(header, lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=16384, help="tokens for the operator timings")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--stack-n", type=_sizes, default=[4096, 8192, 16384, 32768, 65536],
                    help="comma-separated token counts for the 12-layer stacks")
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--stack-repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skip-stack", action="store_true", help="operators only")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "gpu.json")
    ap.add_argument("--model", action="store_true",
                    help="the memory-traffic model only (no GPU needed): per op and head dim, traffic / minimum")
    ap.add_argument("--model-out", type=Path, default=common.RESULTS_DIR / "gpu_model.json")
    return ap


def run(args, command: str) -> Dict[str, Any]:
    if not torch.cuda.is_available():
        raise NoGPU("benchmarks.gpu needs a CUDA GPU (torch.cuda.is_available() is False on this machine)")
    dtype = DTYPES[args.dtype]
    t0 = time.time()
    torch.manual_seed(0)
    env = common.row_env(command, device="cuda")
    common.log(f"operators: B={args.batch} H={args.heads} n={args.n} p={args.head_dim} {args.dtype}")
    ops = bench_ops(args, dtype)
    stack = [] if args.skip_stack else bench_stack(args, dtype)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        **env,
        "gpu": torch.cuda.get_device_name(),
        "triton": triton_version,
        "config": {"batch": args.batch, "heads": args.heads, "n": args.n, "head_dim": args.head_dim,
                   "dtype": args.dtype, "repeats": args.repeats, "warmup": args.warmup, "depth": args.depth,
                   "stack_n": args.stack_n},
        "timing": "CUDA events; rounds of the pair (w.clone(), op); ratio = median of per-round time(op)/time(clone)",
        "targets": TARGETS,
        "saved_allowance": f"{SAVED_PER_TOKEN_FLOATS} float32 per (b, h, token)",
        "ops": ops,
        "stack": stack,
        "wall_s": round(time.time() - t0, 1),
    }


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    command = common.command_string("benchmarks.gpu", argv)
    if args.model:
        try:
            model = traffic_model(args)
        except NoGPU as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        model["command"] = command
        path = common.write_json(args.model_out, model)
        print(f"traffic model: B={args.batch} H={args.heads} n={args.n} {args.dtype}; bytes per call / the op's "
              "minimum, and the time at H100's 3.35 TB/s\n")
        print(model_table(model["rows"]))
        print(f"\nwrote {path}")
        return model
    try:
        out = run(args, command)
    except NoGPU as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    path = common.write_json(args.out, out)
    print(f"GPU: {out['gpu']}; torch {out['torch']}; triton {out['triton']}")
    print(f"command: {command}\n")
    print(ops_table(out["ops"]))
    if out["stack"]:
        print()
        print(stack_table(out["stack"]))
    print(f"\nwrote {path}")
    return out


if __name__ == "__main__":
    main()
