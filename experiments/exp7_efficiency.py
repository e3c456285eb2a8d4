"""Experiment 7: the benchmark suite's measurements next to the papers' efficiency figures.

Runs no benchmark (the suite is ``python -m benchmarks.run all``, see docs/benchmarks.md): reads
its result files and writes, for each paper figure, the numbers that test its claim:

* ToST Fig. 1 / Fig. 6 (time and memory vs n): the growth exponent of TSSA's and MHSA's
  forward time and peak memory (log-log slope between two token counts) and the TSSA vs MHSA
  (SDPA) speedup at n = 16k (the dedicated side-by-side run when present);
* DMSA Fig. 4 and ECA Fig. 2: the same slopes for DMSA and ECA, ECA with vs without Cholesky;
* ToST Fig. 8 (generation): per-token time at the last vs first position, and state memory;
* IrrAtt Table 1 (latency): compressed-attention block time relative to MHSA.

Writes ``experiments/results/exp7_efficiency/index.json`` (``figures``: one entry per claim with
the measured values and the file they come from; ``targets``: the result files per benchmark).
"""
from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

NAME = "exp7_efficiency"


def _fwd_rows(att: dict, method: str, key: str) -> Dict[int, float]:
    return {r["n"]: r[key] for r in att["rows"] if r["sweep"] == "tokens" and r["method"] == method
            and r["mode"] == "fwd" and r["status"] == "ok" and r.get(key)}


def slope(points: Dict[int, float], lo: int) -> Optional[dict]:
    """log-log slope of a quantity between the token count ``lo`` (or the smallest above it) and
    the largest measured one: 1 = linear, 2 = quadratic. With fewer than two counts from ``lo``
    on (a method over the budgets early), the two largest measured counts."""
    ns = sorted(n for n in points if n >= lo)
    if len(ns) < 2:
        ns = sorted(points)[-2:]
    if len(ns) < 2:
        return None
    a, b = ns[0], ns[-1]
    return {"from": a, "to": b, "slope": math.log(points[b] / points[a]) / math.log(b / a)}


def attention_figures(att: dict, target: Optional[dict], src: str, lo: int) -> List[Dict[str, Any]]:
    figs = []

    def growth(method):
        t, m = slope(_fwd_rows(att, method, "time_s"), lo), slope(_fwd_rows(att, method, "peak_mem_bytes"), lo)
        return {"time": t, "memory": m}

    tssa, mhsa = growth("tssa"), growth("mhsa_sdpa")
    expl = growth("mhsa_explicit")
    figs.append({"figure": "ToST Fig. 1 / Fig. 6", "claim": "TSSA's time and memory grow linearly in the number of "
                 "tokens n, softmax attention's quadratically", "source": src,
                 "measured": {"tssa": tssa, "mhsa_sdpa": mhsa, "mhsa_explicit": expl}})
    sp: Dict[str, Any] = {}
    if target is not None:
        sp = {r["allocator"]: r["speedup"] for r in target["runs"] if "speedup" in r}
        sp["source"] = "benchmarks/results/attention_target.json"
    elif att.get("target") and att["target"].get("speedup"):
        sp = {"default": att["target"]["speedup"], "source": src}
    if sp:
        n = target["n"] if target is not None else att["target"]["n"]
        mac_ratio = target["mac_ratio"] if target is not None else att["target"]["flop_ratio"]
        figs.append({"figure": "ToST Fig. 1 (speed)", "claim": f"a 12-layer TSSA stack is much faster than "
                     f"softmax attention at long n (target: >= 50x at n = {n}, forward)",
                     "source": sp.pop("source"), "measured": {"speedup_by_allocator": sp, "n": n,
                                                              "mac_ratio": mac_ratio}})
    figs.append({"figure": "DMSA Fig. 4", "claim": "DMST's memory (and time) grow linearly in n, like ToST's",
                 "source": src, "measured": {"dmsa": growth("dmsa"), "tssa": tssa}})
    e, enc = _fwd_rows(att, "eca", "time_s"), _fwd_rows(att, "eca_nochol", "time_s")
    common_n = sorted(set(e) & set(enc))
    figs.append({"figure": "ECA Fig. 2", "claim": "ECA's cost grows linearly in n; the Cholesky "
                 "orthonormalisation adds little", "source": src,
                 "measured": {"eca": growth("eca"), "eca_over_no_cholesky": {n: e[n] / enc[n] for n in common_n},
                              "median_eca_over_no_cholesky": statistics.median([e[n] / enc[n] for n in common_n])
                              if common_n else None}})
    return figs


def generation_figure(gen: dict, src: str) -> Dict[str, Any]:
    meas = {}
    for cfg, s in gen["summary"].items():
        rows = [r for r in gen["rows"] if r["config"] == cfg]
        last = max(r["position"] for r in rows)
        state = {r["model"]: r["state_bytes"] for r in rows if r["position"] == last}
        meas[cfg] = {"positions": s["positions"], "tost_last_over_first": s["tost_ratio_last_first"],
                     "gpt_last_over_first": s["gpt_ratio_last_first"],
                     "gpt_over_tost_at_last": s["gpt_over_tost"][str(last)], "state_bytes_at_last": state}
    return {"figure": "ToST Fig. 8", "claim": "causal ToST generates in constant time and memory per token; the "
            "softmax baseline's per-token cost grows with the position", "source": src, "measured": meas}


def compression_figure(comp: dict, src: str) -> Dict[str, Any]:
    meas: Dict[str, Any] = {}
    for r in comp["rows"]:
        if r["layer"] == "mhsa":
            continue
        key = f"{r['block']} {r['layer']} ({r['path']}) QK ratio {r['target_qk_ratio']}"
        meas[key] = {"time_vs_mhsa_sdpa": r["time_vs_mhsa_sdpa"], "block_macs_ratio": r["block_macs_ratio"]}
    return {"figure": "IrrAtt Table 1 (latency)", "claim": "compressed attention blocks run faster than MHSA, "
            "roughly in proportion to their FLOPs", "source": src, "measured": meas}


def main(argv=None) -> int:
    args = C.parser(NAME, __doc__.splitlines()[0]).parse_args(argv)
    setup = C.Setup(NAME, args)
    cfg = setup.cfg
    rdir = C.REPO / cfg["results_dir"]
    index: Dict[str, Any] = {"command": setup.command(NAME), "results_dir": cfg["results_dir"], "targets": {},
                             "figures": []}
    files = sorted(p for p in rdir.rglob("*") if p.is_file() and p.suffix in (".json", ".png", ".md")) \
        if rdir.is_dir() else []
    for target, figure in cfg["figures"].items():
        pattern = cfg.get("patterns", {}).get(target, target)
        mine = [str(p.relative_to(C.REPO)) for p in files if p.name.startswith(pattern)]
        index["targets"][target] = {"paper_figure": figure, "files": mine,
                                    "status": "available" if mine else "not run yet"}
        print(f"[{NAME}] {target}: {len(mine)} file(s) ({figure})")
    rel = lambda name: f"{cfg['results_dir']}/{name}"  # noqa: E731
    att, tgt = C.read_json(rdir / "attention_scaling.json"), C.read_json(rdir / "attention_target.json")
    if att is not None:
        index["figures"] += attention_figures(att, tgt, rel("attention_scaling.json"), int(cfg.get("slope_from", 4096)))
    gen = C.read_json(rdir / "generation.json")
    if gen is not None and gen.get("summary"):
        index["figures"].append(generation_figure(gen, rel("generation.json")))
    comp = C.read_json(rdir / "compressed_attention.json")
    if comp is not None:
        index["figures"].append(compression_figure(comp, rel("compressed_attention.json")))
    C.write_json(setup.out / "index.json", index)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
