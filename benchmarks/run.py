"""Benchmark runner: ``python -m benchmarks.run [attention|target|generation|compression|latency|irratt|fused|all]
[--quick]``.

* ``attention``: time and peak memory of 12 stacked attention layers vs n and d
  (:mod:`benchmarks.attention_scaling`);
* ``target``: the 50x target (TSSA vs MHSA (SDPA) stacks at n = 16384, forward) measured on its
  own, alternating the two stacks in one process, under both allocator settings
  (:mod:`benchmarks.attention_target`);
* ``generation``: per-token latency and memory of causal ToST vs GPT with a KV cache
  (:mod:`benchmarks.generation`);
* ``compression``: TruncAtt / CP SlimAtt / IrrAtt vs MHSA at the same QK FLOPs ratio
  (:mod:`benchmarks.compressed_attention`);
* ``latency``: whole compressed DeiT-T / DeiT-S against the original, interleaved, at batch 1 and 32
  on 1 and 2 threads, next to the FLOPs ratio (:mod:`benchmarks.compressed_latency`; it sets its
  own thread counts);
* ``irratt``: IrrAtt's decomposition per block, fast path against the reference, time and error
  (:mod:`benchmarks.irratt_decomposition`; 1 thread unless ``--threads`` says otherwise);
* ``fused``: the fused TSSA kernel benchmark (:mod:`benchmarks.tssa_fused`), when present;
* ``lm``: ToST Table 4 (right), the 12-layer base LMs' training step / forward time and memory
  (:mod:`benchmarks.lm_model`; slow on a CPU: not part of ``all``);
* ``all`` (default): all of the above but ``lm``.

``--quick`` runs tiny versions (1-2 minutes in all), written with a ``_quick`` suffix to
``benchmarks/results/quick/``. Full results go to ``benchmarks/results/`` (JSON, PNG, markdown
tables; ``--out`` to change), after which ``docs/benchmarks.md`` is regenerated from them
(:mod:`benchmarks.report`). :func:`main` takes an argv list so that a ``whiteformer bench`` entry point can
forward to it.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from . import common

TARGETS = ("attention", "target", "generation", "compression", "latency", "irratt", "fused")


def _fused_available() -> bool:
    try:
        return importlib.util.find_spec("benchmarks.tssa_fused") is not None
    except (ImportError, ValueError):
        return False


# Quick arguments for benchmarks.tssa_fused (its CLI has no --quick); it may define QUICK_ARGV itself.
FUSED_QUICK_ARGV = ["--n", "2048", "--repeats", "3", "--warmup", "1", "--allocator", "default"]


def _run_fused(quick: bool, out: Optional[Path]) -> Dict[str, Any]:
    """Forward to ``benchmarks.tssa_fused.main(argv)`` (the fused TSSA kernel benchmark, a separate
    module with its own CLI), when that module exists. Quick: small sizes, written to
    ``tssa_fused_quick.json``."""
    if not _fused_available():
        common.log("fused TSSA benchmark: benchmarks/tssa_fused.py not present, skipped")
        return {"skipped": "benchmarks/tssa_fused.py not present"}
    mod = importlib.import_module("benchmarks.tssa_fused")
    if not hasattr(mod, "main"):
        return {"skipped": "benchmarks.tssa_fused has no main(argv)"}
    argv: List[str] = list(getattr(mod, "QUICK_ARGV", FUSED_QUICK_ARGV)) if quick else []
    if quick or out is not None:
        base = Path(out) if out is not None else common.RESULTS_DIR / "quick"
        argv += ["--out", str(base / ("tssa_fused_quick.json" if quick else "tssa_fused.json"))]
    try:
        res = mod.main(argv)
    except SystemExit as e:  # an argparse error
        res = {"exit_code": e.code}
    except Exception as e:  # noqa: BLE001 - a failing optional benchmark must not stop the others
        common.log(f"fused TSSA benchmark failed: {type(e).__name__}: {e}")
        res = {"error": f"{type(e).__name__}: {e}"}
    return res if isinstance(res, dict) else {"result": res, "argv": argv}


def _target_kwargs(quick: bool, out: Optional[Path], threads: Optional[int], device: str, command: str):
    """Arguments of :func:`benchmarks.attention_target.run`; quick: 2 layers at n = 1024."""
    kw: Dict[str, Any] = dict(threads=threads, device=device, command=command)
    if quick:
        kw.update(n=1024, depth=2, rounds=1, allocators=("default",))
    if quick or out is not None:
        base = Path(out) if out is not None else common.RESULTS_DIR / "quick"
        kw["out"] = base / ("attention_target_quick.json" if quick else "attention_target.json")
    return kw


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run",
                                description="whiteformer benchmarks (see docs/benchmarks.md)")
    p.add_argument("what", nargs="?", default="all", choices=TARGETS + ("lm", "all"),
                   help="which benchmark (default all)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a 1-2 minute smoke run")
    p.add_argument("--out", type=Path, default=None, help="output directory (default benchmarks/results)")
    p.add_argument("--threads", default="auto",
                   help="torch threads in each measuring process: a number, or auto (default: 1 on a busy machine, "
                        "else torch's default)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    return p


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run the selected benchmarks; returns {target: result}."""
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    command = common.command_string("benchmarks.run", argv)
    targets = TARGETS if a.what == "all" else (a.what,)
    from . import attention_scaling, attention_target, compressed_attention, generation

    results: Dict[str, Any] = {}
    t0 = time.perf_counter()
    load0 = common.loadavg()
    threads, why = common.resolve_threads(a.threads)
    common.log(f"threads: {why}")
    for t in targets:
        t1 = time.perf_counter()
        kw = dict(quick=a.quick, out_dir=a.out, threads=threads, device=a.device, command=command)
        if t == "attention":
            results[t] = attention_scaling.run(**kw)
        elif t == "target":
            results[t] = attention_target.run(**_target_kwargs(a.quick, a.out, threads, a.device, command))
        elif t == "generation":
            results[t] = generation.run(**kw)
        elif t == "compression":
            results[t] = compressed_attention.run(**kw)
        elif t == "latency":
            from . import compressed_latency

            results[t] = compressed_latency.run(quick=a.quick, out_dir=a.out, command=command)
        elif t == "irratt":
            from . import irratt_decomposition

            results[t] = irratt_decomposition.run(quick=a.quick, out_dir=a.out, threads=threads or 1,
                                                  command=command)
        elif t == "fused":
            results[t] = _run_fused(a.quick, a.out)
        elif t == "lm":
            from . import lm_model

            results[t] = lm_model.run(**kw)
        common.log(f"[{t}] done in {time.perf_counter() - t1:.0f} s")
    common.log(f"total {time.perf_counter() - t0:.0f} s; load average at start {load0}, at end {common.loadavg()}")
    if not a.quick and a.out is None:  # full results in benchmarks/results: refresh docs/benchmarks.md
        from . import report

        try:
            report.main([])
        except Exception as e:  # noqa: BLE001 - the measurements are saved; the page can be redone
            common.log(f"docs/benchmarks.md not regenerated ({type(e).__name__}: {e}); run python -m benchmarks.report")
    return results


if __name__ == "__main__":
    main()
