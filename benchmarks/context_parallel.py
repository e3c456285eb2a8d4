"""Context parallelism: what a sequence split over processes costs in communication and
what it buys in memory.

1. **Bytes per layer against sequence length.** One ``TSSA`` and one ``CausalTSSA`` layer (GPT-2
   base width: D 768, 12 heads) run forward and backward on a sequence of N tokens split over
   R = 2 gloo processes. Every collective of :mod:`whiteformer.ops.context_parallel` is recorded
   (:func:`~whiteformer.ops.context_parallel.count_communication` wraps them: the bytes are
   counted from the tensors handed to torch.distributed, not typed in): the payload a rank hands
   over and the bytes it sends under ring algorithms (all-reduce ``2 (R-1)/R n``, all-gather
   ``(R-1) n``). Beside them, what **ring attention** (Liu et al., 2023) sends for the softmax
   layer of the same width: in each of its R - 1 steps a rank passes its key and value block
   (B x N/R x 2D numbers) on, so ``(R-1)/R x 2 B N D`` numbers forward; the backward passes the
   key/value blocks and their gradient accumulators around again, twice that.
2. **A length one process cannot hold.** A ToST language model (depth 4, D 256, 4 heads) runs a
   training forward (autograd recording, what a step holds before its backward) on N tokens: in
   one process (with the fused kernel, the default, and with the PyTorch path that the split
   runs) and split over 2. Each run is a fresh process; its peak resident memory above the
   baseline is measured (``benchmarks.common.peak_rss``), with glibc's mmap threshold fixed at
   64 KiB (``MALLOC_MMAP_THRESHOLD_``) so that freed blocks go back to the OS and the peak is
   that of live memory. The budget (``--budget-gib``, default 2.0
   GiB per process) is set between the two: the one-process forward exceeds it, each of the
   two split processes stays under it. Reported: wall time of the split forward (the slower rank)
   and of the one-process forward, both measured here.

Usage::

    python -m benchmarks.context_parallel [--quick] [--out DIR] [--budget-gib G]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from . import common
from .common import fmt_bytes, fmt_time, fmt_tokens, log

WORLD = 2
LAYER = dict(dim=768, num_heads=12, batch=1)
MODEL = dict(vocab_size=256, dim=256, depth=4, num_heads=4)
FULL = dict(lengths=[1024, 4096, 16384, 32768], memory_tokens=32768, budget_gib=2.0, repeats=3)
QUICK = dict(lengths=[64, 256], memory_tokens=2048, budget_gib=0.05, repeats=1)


def ring_attention_bytes(n: int, dim: int, world: int, batch: int = 1, itemsize: int = 4) -> Dict[str, int]:
    """Bytes one rank sends per softmax-attention layer under ring attention (module docstring)."""
    forward = (world - 1) * batch * (n // world) * 2 * dim * itemsize
    return {"forward": forward, "backward": 2 * forward}


# ------------------------------------------------------------------------------ worker processes
def _init(rank: int, store: str, threads: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)


def _bytes_worker(rank: int, store: str, lengths: List[int], out: str, threads: int) -> None:
    import torch.distributed as dist

    from whiteformer.app.train.distributed import cleanup
    from whiteformer.attention import TSSA, CausalTSSA
    from whiteformer.ops.context_parallel import count_communication

    _init(rank, store, threads)
    torch.manual_seed(0)
    rows = []
    d, h, b = LAYER["dim"], LAYER["num_heads"], LAYER["batch"]
    for n in lengths:
        for name, layer in (("tssa", TSSA(d, num_heads=h)), ("causal_tssa", CausalTSSA(d, num_heads=h, max_len=n))):
            layer.set_context_parallel(dist.group.WORLD)
            x = torch.randn(b, n // WORLD, d, requires_grad=True)
            with count_communication() as fwd:
                y = layer(x)
            with count_communication() as bwd:
                y.square().sum().backward()
            rows.append({"layer": name, "n": n, "world": WORLD, "dim": d, "heads": h, "batch": b,
                         "forward_payload": fwd.payload_bytes, "forward_wire": fwd.wire_bytes,
                         "backward_payload": bwd.payload_bytes, "backward_wire": bwd.wire_bytes,
                         "collectives_forward": [r.op for r in fwd.records],
                         "collectives_backward": [r.op for r in bwd.records],
                         "ring_attention": ring_attention_bytes(n, d, WORLD, b)})
    if rank == 0:
        common.write_text(out, json.dumps(rows))
    dist.barrier()
    cleanup()


def _model():
    from whiteformer import create_model

    torch.manual_seed(0)
    return create_model("tost_lm_base", pos_emb=False, pos_bias=False, **MODEL)


def _forward_stats(model, idx) -> Dict[str, float]:
    common.trim_heap()
    base = common.current_rss()
    exact = common.reset_peak_rss()
    t0 = time.perf_counter()
    _, loss = model(idx, targets=idx)
    wall = time.perf_counter() - t0
    peak = common.peak_rss() - base
    del loss
    return {"wall_s": wall, "peak_bytes": peak, "peak_exact": exact}


def _memory_worker(rank: int, world: int, store: Optional[str], n: int, repeats: int, out: str,
                   threads: int, kernels: bool = True) -> None:
    """One process on all n tokens (world 1; ``kernels=False``: the PyTorch path, which the split
    runs, instead of the fused kernel) or one of ``world`` ranks on its n / world."""
    if not kernels:
        os.environ["WHITEFORMER_DISABLE_KERNELS"] = "1"
    if world > 1:
        import torch.distributed as dist

        from whiteformer.app.train.distributed import cleanup

        _init(rank, store, threads)
    else:
        torch.set_num_threads(threads)
    model = _model()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, MODEL["vocab_size"], (1, n), generator=g)
    if world > 1:
        model.set_context_parallel(dist.group.WORLD)
        idx = idx[:, rank * (n // world):(rank + 1) * (n // world)]
    runs = []
    for _ in range(repeats):
        if world > 1:
            dist.barrier()
        runs.append(_forward_stats(model, idx))
    res = {"rank": rank, "world": world, "tokens_here": idx.shape[1], "runs": runs}
    common.write_text(f"{out}.{rank}", json.dumps(res))
    if world > 1:
        del model
        dist.barrier()
        cleanup()


# ------------------------------------------------------------------------------ driver
def _spawn(fn, nprocs: int, args: tuple) -> None:
    import torch.multiprocessing as mp

    mp.spawn(fn, args=args, nprocs=nprocs, join=True)


def measure_bytes(lengths: Sequence[int], threads: int) -> List[Dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bytes.json"
        _spawn(_bytes_worker, WORLD, (str(Path(tmp) / "store"), list(lengths), str(out), threads))
        return json.loads(out.read_text())


#: the runs of part 2: (key, processes, fused kernels allowed, label)
MEMORY_RUNS = (("one_fused", 1, True, "1 (fused kernel: the default path)"),
               ("one_torch", 1, False, "1 (PyTorch path, as the split)"),
               ("split", WORLD, True, f"{WORLD} (split, PyTorch path)"))


#: glibc's mmap threshold in the measuring processes: fixed (not adapted upwards after frees), so
#: every block of 64 KiB or more is mapped and returned to the OS when freed, and the peak RSS is
#: the peak of live memory rather than of a heap that keeps freed blocks
MMAP_THRESHOLD = "65536"


def measure_memory(n: int, repeats: int, threads: int) -> Dict[str, Any]:
    res = {}
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # read by the spawned processes at start
    try:
        return _measure_memory(n, repeats, threads, res)
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


def _measure_memory(n: int, repeats: int, threads: int, res: Dict[str, Any]) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        for key, world, kernels, label in MEMORY_RUNS:
            out = Path(tmp) / key
            _spawn(_memory_worker, world, (world, str(Path(tmp) / f"store_{key}"), n, repeats, str(out), threads,
                                           kernels))
            ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
            # per repeat: the slowest rank's wall time; per rank: its largest peak
            walls = [max(rk["runs"][i]["wall_s"] for rk in ranks) for i in range(repeats)]
            res[key] = {"label": label, "processes": world, "tokens_per_process": n // world, "ranks": ranks,
                        "wall_s": min(walls), "wall_s_all": walls,
                        "peak_bytes_per_process": max(max(r["peak_bytes"] for r in rk["runs"]) for rk in ranks)}
    return res


def run(quick: bool = False, out_dir: Optional[Path] = None, budget_gib: Optional[float] = None,
        threads: int = 1, command: str = "") -> Dict[str, Any]:
    cfg = dict(QUICK if quick else FULL)
    if budget_gib is not None:
        cfg["budget_gib"] = budget_gib
    log(f"context parallelism: bytes per layer at N = {cfg['lengths']} over {WORLD} processes")
    rows = measure_bytes(cfg["lengths"], threads)
    n = cfg["memory_tokens"]
    log(f"context parallelism: training forward of a ToST LM on {n} tokens, 1 process vs {WORLD}")
    mem = measure_memory(n, cfg["repeats"], threads)
    budget = int(cfg["budget_gib"] * common.GiB)
    for row in mem.values():
        row["fits"] = row["peak_bytes_per_process"] <= budget
    result = {
        "benchmark": "context_parallel", "quick": quick, "command": command, "env": common.row_env(command,
                                                                                                  threads=threads),
        "layer": LAYER, "model": MODEL, "world": WORLD, "bytes": rows,
        "memory": {"tokens": n, "budget_bytes": budget, "malloc_mmap_threshold": int(MMAP_THRESHOLD), "runs": mem},
    }
    out_dir = Path(out_dir) if out_dir is not None else common.default_out_dir(quick)
    path = common.write_json(out_dir / f"context_parallel{'_quick' if quick else ''}.json", result)
    log(f"wrote {path}")
    return result


# ------------------------------------------------------------------------------ report
def section(res: Optional[Dict[str, Any]]) -> List[str]:
    """The docs/benchmarks.md section for a result of :func:`run` (None: not run yet)."""
    out = ["## 6. Context parallelism: one sequence split over processes", ""]
    if not res:
        return out + ["`python -m benchmarks.context_parallel` has not written "
                      "`benchmarks/results/context_parallel.json` yet.", ""]
    lay, world = res["layer"], res["world"]
    out += [f"Written by `{res['command']}` on {res['env']['machine']} (load {res['env']['loadavg']}, "
            f"{res['env']['threads']} thread(s) per process, gloo). Method: `benchmarks/context_parallel.py` "
            "(module docstring).", "",
            f"**Bytes one rank sends per layer** (D {lay['dim']}, {lay['num_heads']} heads, batch {lay['batch']}, "
            f"float32, split over R = {world} processes), counted by wrapping the collectives; ring attention "
            "for a softmax layer of the same width from its algorithm (R - 1 passes of the key/value block, "
            "the backward twice that):", ""]
    table = []
    for r in res["bytes"]:
        ring = r["ring_attention"]
        table.append([r["layer"], fmt_tokens(r["n"]), f"{r['forward_wire']:,} B", f"{r['backward_wire']:,} B",
                      f"{len(r['collectives_forward'])} + {len(r['collectives_backward'])}",
                      fmt_bytes(ring["forward"]), fmt_bytes(ring["backward"]),
                      f"{(ring['forward'] + ring['backward']) / max(r['forward_wire'] + r['backward_wire'], 1):.0f}x"])
    out += [common.markdown_table(["layer", "N", "TSSA fwd", "TSSA bwd", "collectives fwd + bwd",
                                   "ring attn fwd", "ring attn bwd", "ring / TSSA"], table), ""]
    per_layer = sorted({r["forward_wire"] + r["backward_wire"] for r in res["bytes"] if r["layer"] == "causal_tssa"})
    out += [f"The TSSA bytes do not depend on N (causal layer: {', '.join(f'{b:,} B' for b in per_layer)} "
            "forward + backward at every length): per call a header of a few integers per rank (the chunk's "
            "shape and dtype, the arguments that must agree on every rank), the (B, H, p) feature "
            "energies and the (B, H, p + 1) membership moments (all-reduced, or all-gathered for the causal "
            "prefix); ring attention's grow linearly with N. A language model adds per forward one shape header "
            "(its positions) and all-reduces of the loss and of its target count.", ""]
    mem = res["memory"]
    m = res["model"]
    out += [f"**A length one process cannot hold**: training forward (autograd recording) of a ToST LM (depth "
            f"{m['depth']}, D {m['dim']}, {m['num_heads']} heads, vocabulary {m['vocab_size']}) on "
            f"{fmt_tokens(mem['tokens'])} tokens, memory budget {fmt_bytes(mem['budget_bytes'])} per process (peak "
            "RSS above the baseline, glibc mmap threshold fixed at "
            f"{mem.get('malloc_mmap_threshold', 'its default')} bytes):", ""]
    out += [common.markdown_table(
        ["processes", "tokens per process", "peak memory per process", "within budget", "wall time (best)"],
        [[r["label"], fmt_tokens(r["tokens_per_process"]), fmt_bytes(r["peak_bytes_per_process"]),
          "yes" if r["fits"] else "no", fmt_time(r["wall_s"])] for r in mem["runs"].values()]), ""]
    out += ["The split forward's time is the slower rank's (best of the repeats; the two processes share this "
            "machine's two cores with other jobs, so it is no speed-up measurement); its result is exact "
            "(tests/ops/test_context_parallel.py checks split == unsplit in float64 for outputs and every gradient). "
            "The split runs the PyTorch path, which keeps more for the backward than the fused kernel (its prefix "
            "sums over (B, H, N, p)), hence the PyTorch-path row for a like-for-like comparison.", ""]
    return out


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.context_parallel", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default benchmarks/results)")
    p.add_argument("--budget-gib", type=float, default=None, help="memory budget per process")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    a = p.parse_args(argv)
    return run(a.quick, a.out, a.budget_gib, a.threads, common.command_string("benchmarks.context_parallel", argv))


if __name__ == "__main__":
    main()
