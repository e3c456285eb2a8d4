"""IrrAtt decomposition time and error per block: the fast path against the reference.

For each attention block of DeiT-T and DeiT-S (random initialisation, as ``create_model`` gives it;
224 px, N = 197 tokens), the query-key tensor (F + 1 bias row, F, H) is decomposed by
``btd_ll1(Y, R, max_rank=p)`` (CPD-EPC initialisation, then BTD-(L, L, 1) refinement) at the total
rank ``R`` that ``compress(model, qk="irratt", qk_flops_ratio=0.5)`` gives it, twice:

* ``reference``: ``impl="reference"``, the plain CP-ALS (100 iterations) + CPD-EPC (50) loops and
  Algorithm 3 as written (eigenvector restarts, 3 inner iterations, stop at a 1e-3 gain);
* ``fast``: the default, ``impl="fast"``: an early-stopped CP, then the blocks of both the ALS model
  and its EPC correction refined by warm single-block sweeps, the better kept (its CP iterations
  and sweeps are those of the start kept).

The two run back to back on the same block, in alternating order (reference first on even blocks),
so that both see the same machine load. Each row records both times and both relative errors
||Y - Yhat|| / ||Y||.

Usage::

    python -m benchmarks.irratt_decomposition [--models deit_t_p16,deit_s_p16] [--blocks 0,6]
        [--threads 1] [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from . import common
from .common import log

MODELS = ("deit_t_p16", "deit_s_p16")
QUICK = dict(models=("deit_t_p16",), blocks=(0,), model_args=dict(depth=1, embed_dim=96, num_heads=3))


def measure_block(attn, ratio: float, order: Sequence[str]) -> Dict[str, Any]:
    """Time and error of both implementations on one block's query-key tensor."""
    from whiteformer.compress import btd_ll1, qk_factors, qk_rank_for_budget

    F, H = attn.qkv.in_features, attn.num_heads
    Y = qk_factors(attn)
    Y = type(Y)(Y.P.double(), Y.K.double())
    R = qk_rank_for_budget("irratt", ratio, num_tokens=197, dim=F, num_heads=H, fusion="general")
    row: Dict[str, Any] = {"dim": F, "heads": H, "rank": R}
    for impl in order:
        t0 = time.perf_counter()
        res = btd_ll1(Y, R, max_rank=F // H, impl=impl)
        row[f"{impl}_s"] = time.perf_counter() - t0
        row[f"{impl}_rel_error"] = res.rel_error
        row[f"{impl}_cp_iterations"] = res.cp_result.n_iter
        row[f"{impl}_sweeps"] = len(res.history) - 1
        row[f"{impl}_ranks"] = list(res.ranks)
    row["speedup"] = row["reference_s"] / row["fast_s"]
    row["error_change"] = row["fast_rel_error"] / row["reference_rel_error"] - 1.0
    return row


def run_model(name: str, blocks: Optional[Sequence[int]], threads: Optional[int], ratio: float,
              model_args: Optional[dict] = None) -> List[Dict[str, Any]]:
    """Child-process body: every selected block of one model."""
    from whiteformer import create_model

    common.setup_torch(threads, 0)
    model = create_model(name, **(model_args or {}))
    idx = list(range(len(model.blocks))) if blocks is None else list(blocks)
    rows = []
    for k, i in enumerate(idx):
        order = ("reference", "fast") if k % 2 == 0 else ("fast", "reference")
        row = measure_block(model.blocks[i].attn, ratio, order)
        row.update(model=name, block=i, order=list(order), loadavg=common.loadavg())
        rows.append(row)
        log(f"  {name} block {i}: rank {row['rank']}, reference {row['reference_s']:.2f} s "
            f"(error {row['reference_rel_error']:.6f}), fast {row['fast_s']:.2f} s (error "
            f"{row['fast_rel_error']:.6f}): x{row['speedup']:.2f}, load {row['loadavg']}")
    return rows


def summary(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    for name in dict.fromkeys(r["model"] for r in rows):
        sel = [r for r in rows if r["model"] == name]
        ref, fast = sum(r["reference_s"] for r in sel), sum(r["fast_s"] for r in sel)
        out.append(dict(model=name, blocks=len(sel), reference_s=ref, fast_s=fast, speedup=ref / fast,
                        reference_mean_error=statistics.fmean(r["reference_rel_error"] for r in sel),
                        fast_mean_error=statistics.fmean(r["fast_rel_error"] for r in sel),
                        blocks_fast_error_not_worse=sum(r["fast_rel_error"] <= r["reference_rel_error"] for r in sel),
                        worst_error_change=max(r["error_change"] for r in sel)))
    return out


def tables(result: Dict[str, Any]) -> str:
    head = ["model", "blocks", "reference (sum)", "fast (sum)", "speed-up", "mean error reference", "mean error fast",
            "blocks with fast error <= reference", "worst relative error change"]
    body = [[s["model"], str(s["blocks"]), common.fmt_time(s["reference_s"]), common.fmt_time(s["fast_s"]),
             f"x{s['speedup']:.2f}", f"{s['reference_mean_error']:.6f}", f"{s['fast_mean_error']:.6f}",
             f"{s['blocks_fast_error_not_worse']} of {s['blocks']}", f"{100 * s['worst_error_change']:+.4f} %"]
            for s in result["summary"]]
    parts = [common.markdown_table(head, body), ""]
    head = ["model", "block", "rank", "reference", "fast", "speed-up", "error reference", "error fast",
            "CP iterations ref / fast", "sweeps ref / fast", "load"]
    body = [[r["model"], str(r["block"]), str(r["rank"]), common.fmt_time(r["reference_s"]), common.fmt_time(r["fast_s"]),
             f"x{r['speedup']:.2f}", f"{r['reference_rel_error']:.6f}", f"{r['fast_rel_error']:.6f}",
             f"{r['reference_cp_iterations']} / {r['fast_cp_iterations']}",
             f"{r['reference_sweeps']} / {r['fast_sweeps']}", str(r["loadavg"][0] if r["loadavg"] else "-")]
            for r in result["rows"]]
    parts.append(common.markdown_table(head, body))
    return "\n".join(parts) + "\n"


def section(result: Optional[Dict[str, Any]]) -> List[str]:
    """The docs/benchmarks.md section (:mod:`benchmarks.report`)."""
    out = ["## IrrAtt decomposition: time and error per block, fast path against the reference", ""]
    if not result or not result.get("rows"):
        return out + ["Not run yet: `python -m benchmarks.irratt_decomposition`.", ""]
    loads = [r["loadavg"][0] for r in result["rows"] if r.get("loadavg")]
    return out + [
        "The query-key tensor of each attention block of DeiT-T / DeiT-S (random initialisation, N = 197) "
        "decomposed by `btd_ll1` (CPD-EPC initialisation, then BTD-(L, L, 1) refinement) at the rank "
        f"`compress(..., qk=\"irratt\", qk_flops_ratio={result['qk_flops_ratio']})` gives it, with "
        "`impl=\"reference\"` (the plain loops: 100 CP-ALS + 50 EPC iterations, Algorithm 3 as written) and "
        "the default fast path (an early-stopped CP, both the ALS and the EPC-corrected start refined by "
        "warm single-block sweeps, the better kept), back to back on the same block in alternating order, "
        f"{result['threads']} thread(s). Relative error ||Y - Yhat|| / ||Y||. The machine was shared: 1-minute "
        f"load {min(loads):.1f}-{max(loads):.1f} on {result['machine']['logical_cpus']} CPUs during the run, so "
        "absolute times are several times those of an idle machine; the ratios are measured side by side.",
        "",
        "```",
        result.get("command") or "python -m benchmarks.irratt_decomposition",
        "```",
        "",
        tables(result),
    ]


def run(*, quick: bool = False, models: Sequence[str] = MODELS, blocks: Optional[Sequence[int]] = None,
        threads: Optional[int] = 1, ratio: float = 0.5, out_dir: Optional[Path] = None, command: str = "",
        write: bool = True) -> Dict[str, Any]:
    model_args = None
    if quick:
        models, blocks, model_args = QUICK["models"], QUICK["blocks"], QUICK["model_args"]
    out_dir = Path(out_dir) if out_dir is not None else common.default_out_dir(quick)
    info = common.machine_info("cpu")
    log(f"IrrAtt decomposition ({'quick' if quick else 'full'}): {common.machine_string(info)}, load {info['loadavg']}, "
        f"{threads} threads")
    rows: List[Dict[str, Any]] = []
    for name in models:
        res = common.run_isolated(run_model, name, blocks, threads, ratio, model_args, timeout=4 * 3600)
        env = common.row_env(command, "cpu", threads)
        for r in res:
            r["env"] = env
        rows += res
    result = {"benchmark": "irratt_decomposition", "quick": quick, "qk_flops_ratio": ratio, "threads": threads,
              "machine": info, "command": command, "loadavg_end": common.loadavg(), "rows": rows,
              "summary": summary(rows)}
    if write and rows:
        common.write_results(out_dir, "irratt_decomposition", quick, result, tables(result))
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m benchmarks.irratt_decomposition")
    p.add_argument("--quick", action="store_true", help="one block of a small DeiT (F 96, a smoke test)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--blocks", type=common.int_list, default=None, help="block indices (default: all)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ratio", type=float, default=0.5, help="QK FLOPs ratio that sets the rank")
    p.add_argument("--out", type=Path, default=None)
    return p


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    return run(quick=a.quick, models=[m for m in a.models.split(",") if m], blocks=a.blocks, threads=a.threads,
               ratio=a.ratio, out_dir=a.out, command=common.command_string("benchmarks.irratt_decomposition", argv))


if __name__ == "__main__":
    main()
