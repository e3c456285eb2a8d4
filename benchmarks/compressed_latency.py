"""Measured latency of compressed ViTs next to their FLOPs ratio (TruncAtt, CP SlimAtt, IrrAtt).

DeiT-T and DeiT-S (224 px, N = 197 tokens, random initialisation) are compressed by
``compress(model, qk=METHOD, qk_flops_ratio=0.5)`` (VO and MLP kept). For each batch size and CPU
thread count, the original and the three compressed models run *interleaved* (orig, TruncAtt, CP,
IrrAtt, orig, ...) after one warm-up round, and each compressed model is compared with the original
by :func:`whiteformer.compress.latency.summarize_pair`: medians, interquartile ranges (IQR), the
median and IQR of the per-round ratios, and "no measured speed-up" when the IQRs overlap.

The weights do not change the time of a forward pass, so the CP SlimAtt model is built from a
short CP-ALS (5 iterations, no EPC); TruncAtt and IrrAtt are the real decompositions.

Usage::

    python -m benchmarks.compressed_latency [--models deit_t_p16,deit_s_p16] [--batches 1,32]
        [--threads 1,2] [--runs 7] [--runs-large 3] [--quick] [--out DIR]

Batches of ``LARGE_BATCH`` images or more run ``--runs-large`` rounds (a DeiT-S forward at batch 32
takes seconds on a CPU), the others ``--runs``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from . import common
from .common import log

METHODS = {"truncatt": {}, "cp": dict(cp_kwargs=dict(n_iter_max=5, epc=False)), "irratt": {}}
LABELS = {"truncatt": "TruncAtt", "cp": "CP SlimAtt", "irratt": "IrrAtt"}
LARGE_BATCH = 8
QUICK = dict(models=("deit_t_p16",), batches=(1,), threads=(1,), runs=3, runs_large=3,
             model_args=dict(depth=2, img_size=64))


def run_model(name: str, batches: Sequence[int], threads: Sequence[int], runs: int, runs_large: int, ratio: float,
              model_args: Optional[dict] = None) -> List[Dict[str, Any]]:
    """Child-process body: compress one model three ways, then time all four per batch and thread count."""
    import torch

    from whiteformer import create_model
    from whiteformer.compress import compress
    from whiteformer.compress.latency import example_images, summarize_pair

    common.setup_torch(1, 0)
    model = create_model(name, **(model_args or {})).eval()
    models, reports = {"original": model}, {}
    for method, kw in METHODS.items():
        t0 = time.perf_counter()
        models[method], reports[method] = compress(model, qk=method, qk_flops_ratio=ratio, progress=False, **kw)
        models[method].eval()
        log(f"  {name}: {LABELS[method]} compressed in {time.perf_counter() - t0:.1f} s")
    rows = []
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        for batch in batches:
            x = example_images(model, batch)
            rounds = runs_large if batch >= LARGE_BATCH else runs
            times: Dict[str, List[float]] = {k: [] for k in models}
            with torch.inference_mode():
                for k in range(rounds + 1):  # round 0 is the warm-up
                    for key, m in models.items():
                        t0 = time.perf_counter()
                        m(x)
                        if k:
                            times[key].append(time.perf_counter() - t0)
            for method in METHODS:
                st = summarize_pair(times["original"], times[method])
                rep = reports[method]
                rows.append(dict(model=name, method=method, batch=batch, threads=n_threads, runs=rounds,
                                 flops_ratio=rep.flops_ratio, mhsa_flops_ratio=rep.mhsa_flops_ratio,
                                 qk_macs_ratio=rep.qk_macs_ratio, params_ratio=rep.params_ratio,
                                 original_ms=st["a_ms"], original_iqr_ms=st["a_iqr_ms"],
                                 compressed_ms=st["b_ms"], compressed_iqr_ms=st["b_iqr_ms"],
                                 time_ratio=1.0 / st["ratio"],
                                 time_ratio_iqr=[1.0 / st["ratio_iqr"][1], 1.0 / st["ratio_iqr"][0]],
                                 overlap=st["overlap"], speedup=st["speedup"], loadavg=common.loadavg(),
                                 samples_ms={"original": [1e3 * t for t in times["original"]],
                                             "compressed": [1e3 * t for t in times[method]]}))
                r = rows[-1]
                verdict = _verdict(r)
                log(f"  {name} b{batch} t{n_threads} {LABELS[method]:10s}: {r['original_ms']:.1f} -> "
                    f"{r['compressed_ms']:.1f} ms, time ratio {r['time_ratio']:.3f} vs FLOPs ratio "
                    f"{r['flops_ratio']:.3f} ({verdict})")
    return rows


def _verdict(r: Dict[str, Any]) -> str:
    if r["overlap"]:
        return "no measured speed-up"
    return f"x{r['speedup']:.2f} speed-up" if r["speedup"] > 1 else f"slower (x{r['speedup']:.2f})"


def tables(rows: List[Dict[str, Any]]) -> str:
    head = ["model", "batch", "threads", "QK block", "FLOPs ratio", "MHSA FLOPs ratio", "original", "compressed",
            "time ratio (IQR)", "verdict"]

    def ms(v, iqr):
        return f"{v:.1f} ms ({iqr[0]:.1f}-{iqr[1]:.1f})"

    body = [[r["model"], str(r["batch"]), str(r["threads"]), LABELS[r["method"]], f"{r['flops_ratio']:.3f}",
             f"{r['mhsa_flops_ratio']:.3f}", ms(r["original_ms"], r["original_iqr_ms"]),
             ms(r["compressed_ms"], r["compressed_iqr_ms"]),
             f"{r['time_ratio']:.3f} ({r['time_ratio_iqr'][0]:.3f}-{r['time_ratio_iqr'][1]:.3f})",
             _verdict(r)] for r in rows]
    return common.markdown_table(head, body) + "\n"


def section(result: Optional[Dict[str, Any]]) -> List[str]:
    """The docs/benchmarks.md section (:mod:`benchmarks.report`)."""
    out = ["## Compressed models: measured latency next to the FLOPs ratio", ""]
    if not result or not result.get("rows"):
        return out + ["Not run yet: `python -m benchmarks.compressed_latency`.", ""]
    rows = result["rows"]
    loads = [r["loadavg"][0] for r in rows if r.get("loadavg")]
    n_speed = sum(1 for r in rows if not r["overlap"] and r["speedup"] > 1)
    return out + [
        "Whole DeiT models compressed by `compress(model, qk=METHOD, qk_flops_ratio="
        f"{result['qk_flops_ratio']})` and timed against the original *interleaved* (original, TruncAtt, CP "
        f"SlimAtt, IrrAtt, original, ...; one warm-up round, then {_rounds(result)}) in one process. "
        "Time ratio = compressed / original (the median of the per-round ratios, IQR in brackets); the verdict "
        "gives a speed-up only when the interquartile ranges of the two models do not overlap. FLOPs ratio: "
        "whole model, counted by `torch.utils.flop_counter`. The machine was shared (1-minute load "
        f"{min(loads):.1f}-{max(loads):.1f} on {result['machine']['logical_cpus']} CPUs): the spreads show it, and "
        "rows with as many threads as the machine has CPUs compete with the other jobs for every core, so they "
        "are the noisiest.",
        "",
        "```",
        result.get("command") or "python -m benchmarks.compressed_latency",
        "```",
        "",
        tables(rows),
        f"A measured speed-up in {n_speed} of {len(rows)} cells." + _few_rounds_note(rows),
        "",
    ]


def _few_rounds_note(rows: List[Dict[str, Any]]) -> str:
    few = min(r["runs"] for r in rows)
    if few >= 5:
        return ""
    return (f" Cells with {few} rounds have an IQR computed from {few} samples per model, so their "
            "verdicts (either way) are weak evidence.")


def _rounds(result: Dict[str, Any]) -> str:
    """'7 rounds', or '7 rounds at batch 1, 3 at batch 32' when the batch sizes ran different counts."""
    by_batch = {r["batch"]: r["runs"] for r in result["rows"]}
    if len(set(by_batch.values())) == 1:
        return f"{next(iter(by_batch.values()))} rounds"
    return ", ".join(f"{n} rounds at batch {b}" if i == 0 else f"{n} at batch {b}"
                     for i, (b, n) in enumerate(sorted(by_batch.items())))


def run(*, quick: bool = False, models: Sequence[str] = ("deit_t_p16", "deit_s_p16"), batches: Sequence[int] = (1, 32),
        threads: Sequence[int] = (1, 2), runs: int = 7, runs_large: int = 3, ratio: float = 0.5,
        out_dir: Optional[Path] = None, command: str = "", write: bool = True) -> Dict[str, Any]:
    model_args = None
    if quick:
        models, batches, threads, runs, runs_large, model_args = (
            QUICK[k] for k in ("models", "batches", "threads", "runs", "runs_large", "model_args"))
    out_dir = Path(out_dir) if out_dir is not None else common.default_out_dir(quick)
    info = common.machine_info("cpu")
    log(f"compressed latency ({'quick' if quick else 'full'}): {common.machine_string(info)}, load {info['loadavg']}")
    rows: List[Dict[str, Any]] = []
    result: Dict[str, Any] = {}
    for name in models:
        res = common.run_isolated(run_model, name, batches, threads, runs, runs_large, ratio, model_args,
                                  timeout=4 * 3600)
        env = common.row_env(command, "cpu", None)
        for r in res:
            r["env"] = env
        rows += res
        result = {"benchmark": "compressed_latency", "quick": quick, "qk_flops_ratio": ratio, "runs": runs,
                  "runs_large": runs_large, "machine": info, "command": command, "loadavg_end": common.loadavg(),
                  "rows": rows}
        if write and rows:  # written after each model: a long run leaves what it measured
            common.write_results(out_dir, "compressed_latency", quick, result, tables(rows))
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m benchmarks.compressed_latency")
    p.add_argument("--quick", action="store_true", help="a 2-block 64 px DeiT-T, batch 1, 1 thread (a smoke test)")
    p.add_argument("--models", default="deit_t_p16,deit_s_p16")
    p.add_argument("--batches", type=common.int_list, default=[1, 32])
    p.add_argument("--threads", type=common.int_list, default=[1, 2])
    p.add_argument("--runs", type=int, default=7, help="timed rounds (each model once per round)")
    p.add_argument("--runs-large", type=int, default=3,
                   help=f"timed rounds at batch sizes of {LARGE_BATCH} or more")
    p.add_argument("--ratio", type=float, default=0.5, help="QK FLOPs ratio of the compression")
    p.add_argument("--out", type=Path, default=None)
    return p


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    return run(quick=a.quick, models=[m for m in a.models.split(",") if m], batches=a.batches, threads=a.threads,
               runs=a.runs, runs_large=a.runs_large, ratio=a.ratio, out_dir=a.out,
               command=common.command_string("benchmarks.compressed_latency", argv))


if __name__ == "__main__":
    main()
