"""Write ``docs/benchmarks.md`` from the result files in ``benchmarks/results/``.

``python -m benchmarks.report [--results DIR] [--out FILE]``. Every number on the page is read
from the JSON files written by ``python -m benchmarks.run``; ``benchmarks.run`` calls this after a
full (non-quick) run that writes to the default results directory.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import string
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from . import common
from .attention_scaling import layer_macs
from .common import fmt_bytes, fmt_time, fmt_tokens

DOC = common.REPO_ROOT / "docs" / "benchmarks.md"
# the page's prose: markdown with ${placeholders} that this module fills (page.md: the frame, the others a
# section's fixed paragraphs)
TEMPLATES = common.REPO_ROOT / "docs" / "templates" / "benchmarks"


def prose(name: str, **values: Any) -> List[str]:
    """The lines of ``docs/templates/benchmarks/<name>.md`` with its placeholders filled, then a blank line."""
    text = string.Template((TEMPLATES / f"{name}.md").read_text(encoding="utf-8")).substitute(values)
    return text.rstrip("\n").split("\n") + [""]


def _load(results: Path, name: str) -> Optional[Dict[str, Any]]:
    p = results / name
    return json.loads(p.read_text()) if p.exists() else None


def _rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(common.REPO_ROOT))
    except ValueError:
        return str(p)


def _row(rows, **kw) -> Optional[Dict[str, Any]]:
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def _share(profile: Dict[str, Any], *names: str) -> float:
    return sum(o["share"] for o in profile["ops"] if any(n in o["op"] for n in names))


def _loads(rows: Sequence[Dict[str, Any]]) -> str:
    vals = [r["env"]["loadavg"][0] for r in rows if r.get("env", {}).get("loadavg")]
    return f"{min(vals):.1f}-{max(vals):.1f}" if vals else "n/a"


# --------------------------------------------------------------------------------------------------


def page_values(att, gen, comp) -> Dict[str, str]:
    """The values of the page template's placeholders (machine, load, commands, budgets)."""
    first = next(x for x in (att, gen, comp) if x)
    from . import attention_scaling as A

    c = {**A.FULL, **(att["config"] if att else {})}
    m = first["machine"]
    which: Dict[str, List[str]] = {}
    for name, x in (("attention scaling", att), ("generation", gen), ("compressed attention", comp)):
        if x and x.get("command"):
            which.setdefault(x["command"], []).append(name)
    cmds = [f"{c}   # -> {', '.join(v)} results below" for c, v in which.items()]
    all_rows = [r for x in (att, gen, comp) if x for r in x["rows"]]
    threads = sorted({r["env"]["threads"] for r in all_rows})
    return {
        "machine": common.machine_string(m), "platform": m["platform"], "python": m["python"], "torch": m["torch"],
        "threads": ", ".join(map(str, threads)), "loads": _loads(all_rows), "logical_cpus": str(m["logical_cpus"]),
        "commands": "".join(c.replace("python ", ".venv/bin/python ", 1) + "\n" for c in cmds),
        "repeats": str(c["repeats"]), "budget_per_config": f"{c['budget_per_config']:g}",
        "long_run": f"{c['long_run']:g}", "time_budget": f"{c['time_budget']:g}",
        "target_time_budget": f"{c['target_time_budget']:g}", "target_tokens": fmt_tokens(c["target_tokens"]),
        "time_budget_fwdbwd": f"{c['time_budget_fwdbwd']:g}", "gib": f"{c['mem_budget'] / common.GiB:g}",
    }


def attention_section(att: Dict[str, Any], results: Path, suffix: str = "") -> List[str]:
    from . import attention_scaling as A

    rows = att["rows"]
    cfg = att["config"]
    out = prose("attention", depth=cfg["depth"], heads=cfg["heads"], dim=cfg["dim"],
                first_tokens=fmt_tokens(cfg["tokens"][0]), last_tokens=fmt_tokens(cfg["tokens"][-1]),
                dims=", ".join(map(str, cfg["dims"])), dim_sweep_tokens=cfg["dim_sweep_tokens"])
    for m in att.get("merged", []):
        out += [f"Rows of {', '.join(f'`{x}`' for x in m['methods'])} ({', '.join(m['sweeps'])}) were re-measured "
                f"after a change to that operator and merged into this run's table: `{m['command']}`, load "
                f"{m['machine'].get('loadavg')} -> {m.get('loadavg_end')}.", ""]
    t = att.get("target")
    profs = {p["method"]: p for p in att.get("profiles", [])}
    gemm = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
    bound = "profile below"
    if "tssa" in profs and "mhsa_sdpa" in profs:
        bound = (f"profile below: GEMMs take {_share(profs['tssa'], *gemm):.0%} of TSSA's forward, the SDPA kernel "
                 f"and GEMMs {_share(profs['mhsa_sdpa'], 'scaled_dot_product', *gemm):.0%} of MHSA's")
    explicit = ""
    r_e = max((r for r in rows if r["sweep"] == "tokens" and r["method"] == "mhsa_explicit" and r["mode"] == "fwd"
               and r["status"] == "ok"), key=lambda r: r["n"], default=None)
    if r_e is not None:
        r_s = _row(rows, sweep="tokens", method="mhsa_sdpa", mode="fwd", n=r_e["n"])
        r_t = _row(rows, sweep="tokens", method="tssa", mode="fwd", n=r_e["n"])
        if r_s and r_t and r_s["status"] == r_t["status"] == "ok":
            explicit = (f"Explicit-softmax MHSA is slower still: {r_e['time_s'] / r_s['time_s']:.1f}x the SDPA time "
                        f"and {r_e['time_s'] / r_t['time_s']:.0f}x the TSSA time at n = {fmt_tokens(r_e['n'])} "
                        "(sweep rows), and over the budgets beyond.")
    if t and t.get("speedup") is not None:
        sb = t.get("side_by_side", {})
        out += [
            f"### Target: TSSA stack >= 50x faster than MHSA (SDPA) at n = {fmt_tokens(t['n'])}, forward",
            "",
            f"* **Measured side by side: {t['speedup']:.1f}x** ({'met' if t['met'] else 'not met'}). In the MHSA "
            f"(SDPA) child process, a TSSA stack of the same shape ran its forward just before and just after the MHSA "
            f"forward: MHSA {fmt_time(sb.get('mhsa_sdpa_s'))}, TSSA median {fmt_time(sb.get('tssa_s'))} "
            f"(samples {', '.join(fmt_time(x) for x in sb.get('tssa_samples_s', []))}).",
            f"* From the two sweep rows (separate processes, minutes apart): {t['sweep_speedup']:.1f}x.",
            *target_lines(results, suffix),
            f"* Ceiling: the multiply-add count of MHSA over TSSA per layer is (4 n d^2 + 2 n^2 d) / (2 n d^2) = "
            f"2 + n/d = **{t['flop_ratio']:.1f}x** at n = {t['n']}, d = {cfg['dim']} (TSSA: the projection U and the "
            f"output projection; its statistics are O(n d)). Both stacks are compute-bound on this CPU ({bound}), "
            f"so the measured speedup lands near this ratio; 50x would need 2 + n/d >= 50, i.e. n >= "
            f"{48 * cfg['dim']} at d = {cfg['dim']}, or an attention kernel slower than this CPU's flash SDPA. "
            f"{explicit}",
            "",
        ]
    out += [A.tables(rows), ""]
    for axis in ("tokens", "dim"):
        p = results / f"attention_scaling_{axis}{suffix}.png"
        if p.exists():
            out += [f"![attention scaling vs {'n' if axis == 'tokens' else 'd'}](../{_rel(p)})", ""]
    out += where_time_goes(att), ""
    out += allocator_section(results)
    return out


def target_lines(results: Path, suffix: str = "") -> List[str]:
    """Bullets for the dedicated side-by-side target runs (:mod:`benchmarks.attention_target`):
    ``attention_target.json`` (n = 16k) and any ``attention_target_<n>k.json`` (other n)."""
    names = [f"attention_target{suffix}.json"]
    if not suffix:
        names += sorted(p.name for p in results.glob("attention_target_*k.json"))
    out = []
    for name in names:
        tg = _load(results, name)
        if not tg:
            continue
        for r in tg["runs"]:
            head = f"Dedicated run, n = {fmt_tokens(tg['n'])}, allocator `{r['allocator']}`"
            if "speedup" not in r:
                out.append(f"* {head}: failed ({r.get('error')}).")
                continue
            n, d, L = tg["n"], tg["dim"], tg["depth"]
            rate_t = L * layer_macs("tssa", n, d) / statistics.median(r["tssa_samples_s"]) / 1e9
            rate_m = L * layer_macs("mhsa_sdpa", n, d) / statistics.median(r["mhsa_sdpa_samples_s"]) / 1e9
            out.append(
                f"* **{head}: {r['speedup']:.1f}x** ({'met' if r['met'] else 'not met'}; multiply-add rate "
                f"TSSA {rate_t:.1f}, MHSA {rate_m:.1f} GMAC/s; multiply-add ratio "
                f"{tg['mac_ratio']:.1f}x; median over {len(r['ratios'])} alternating round(s) of time(MHSA) / "
                f"time(TSSA): {', '.join(f'{x:.1f}x' for x in r['ratios'])}; TSSA "
                f"{', '.join(fmt_time(x) for x in r['tssa_samples_s'])}, MHSA (SDPA) "
                f"{', '.join(fmt_time(x) for x in r['mhsa_sdpa_samples_s'])}). Command: `{tg['command']}`, "
                f"{tg['threads']} thread(s), load {tg['machine'].get('loadavg')} -> {tg.get('loadavg_end')}"
                + (f"; {tg['note']}" if tg.get("note") else "") + ".")
    return out


def allocator_section(results: Path) -> List[str]:
    """Supplementary: the same sweep under glibc's default allocator settings vs ``--allocator keep``."""
    d = _load(results / "allocator_default", "attention_scaling.json")
    k = _load(results / "allocator_keep", "attention_scaling.json")
    if not (d and k):
        return []
    out = prose("allocator", default_command=d["command"], keep_command=k["command"],
                loads=_loads(d["rows"] + k["rows"]))
    header = ["method", "n", "default allocator", "keep freed blocks", "default / keep"]
    body = []
    for r in d["rows"]:
        if r["mode"] != "fwd" or r["status"] != "ok":
            continue
        q = _row(k["rows"], method=r["method"], n=r["n"], mode="fwd", sweep="tokens")
        if q and q["status"] == "ok":
            body.append([r["label"], fmt_tokens(r["n"]), fmt_time(r["time_s"]), fmt_time(q["time_s"]),
                         f"{r['time_s'] / q['time_s']:.2f}x"])
    return out + [common.markdown_table(header, body), ""]


def where_time_goes(att: Dict[str, Any]) -> str:
    from . import attention_scaling as A

    profs = {p["method"]: p for p in att.get("profiles", [])}
    rows = att["rows"]
    lines = ["### Where the time goes", ""]
    if profs:
        lines += [A.breakdown_table(list(profs.values())), ""]
    gemm = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
    notes = []
    if "tssa" in profs:
        p = profs["tssa"]
        notes.append(f"**TSSA**: {_share(p, *gemm):.0%} of the forward is the two d x d projections (GEMMs) and "
                     f"{_share(p, 'tssa_fused', 'whiteformer::'):.0%} the fused TSSA operator itself "
                     "(statistics, memberships, output), so TSSA runs at GEMM speed; the pure-PyTorch operator "
                     "(`tssa_torch`) adds elementwise passes (`aten::mul`, `neg`, ...: "
                     f"{1 - _share(profs['tssa_torch'], *gemm):.0%} of its time)." if "tssa_torch" in profs else "")
    for m, name in (("mhsa_sdpa", "MHSA (SDPA)"), ("mssa", "MSSA (CRATE)")):
        if m in profs:
            notes.append(f"**{name}**: {_share(profs[m], 'scaled_dot_product'):.0%} in the SDPA (flash) kernel: "
                         "the n^2 d part dominates from n = 4k at d = 384.")
    if "mhsa_explicit" in profs:
        p = profs["mhsa_explicit"]
        notes.append(f"**MHSA (explicit softmax)**: {_share(p, 'bmm'):.0%} in the two batched matmuls, "
                     f"{_share(p, 'softmax'):.0%} in the softmax and {_share(p, 'aten::mul'):.0%} in the scaling of "
                     "the n x n map; it also materialises that map (memory ~ n^2: 1 GiB at 4k, 8 heads).")
    if "eca" in profs and "eca_nochol" in profs:
        p, q = profs["eca"], profs["eca_nochol"]
        chol = _share(p, "cholesky", "solve_triangular")
        smallest = min(o["share"] for o in p["ops"])
        chol_s = (f"takes {chol:.0%}" if chol >= 0.01 else
                  f"takes under 1% ({chol:.1%} among the {len(p['ops'])} largest operators, the rest below "
                  f"{smallest:.1%} each)")
        notes.append(f"**ECA**: GEMMs/batched matmuls take {_share(p, *gemm):.0%}; the Cholesky step "
                     f"(`linalg_cholesky_ex` + `linalg_solve_triangular`) {chol_s} of the forward at "
                     f"n = {p['n']} (its size does not depend on n: a 160 x 160 Gram matrix per layer for the "
                     "expansion, 20 x 20 per head for the compression), so removing it changes little here: "
                     f"{fmt_time(p['total_s'])} vs "
                     f"{fmt_time(q['total_s'])} profiled. Not timed: generating ECA's fixed Gaussian sketches "
                     "(`whiteformer.ops.eca.eca_omega`, a counter-based hash + Box-Muller) is a one-time cost per "
                     "(layer, n), cached by the layer; it is slow (a one-off check: 32 s for the 12 layers at "
                     "n = 32k, more than a forward), so the benchmark fills that cache before timing.")
    for m, name in (("dmsa", "DMSA"), ("xca", "XCA")):
        if m in profs:
            top = ", ".join(f"`{o['op']}` {o['share']:.0%}" for o in profs[m]["ops"][:3])
            notes.append(f"**{name}**: {top}.")
    r_t = _row(rows, sweep="tokens", method="tssa", mode="fwdbwd", n=16384)
    r_tt = _row(rows, sweep="tokens", method="tssa_torch", mode="fwdbwd", n=16384)
    if r_t and r_tt and r_t["status"] == r_tt["status"] == "ok":
        notes.append(f"**Backward memory**: at n = 16k the fused TSSA kernel keeps {fmt_bytes(r_t['peak_mem_bytes'])} "
                     f"for forward+backward vs {fmt_bytes(r_tt['peak_mem_bytes'])} for the pure-PyTorch operator "
                     "(it saves only w, Pi and O(B H p) statistics); the rest is the projections' saved inputs.")
    lines += [f"* {n}" for n in notes if n]
    return "\n".join(lines)


def generation_section(gen: Dict[str, Any], results: Path, suffix: str = "") -> List[str]:
    from . import generation as G

    rows, summary = gen["rows"], gen["summary"]
    out = prose("generation") + [G.tables(rows, summary), ""]
    p = results / f"generation{suffix}.png"
    if p.exists():
        out += [f"![generation](../{_rel(p)})", ""]
    notes = []
    for config, s in summary.items():
        r = s.get("tost_ratio_last_first")
        lo, hi = s["positions"]
        if r is not None:
            g = s["gpt_over_tost"]
            ratio_hi = g[str(hi)]
            notes.append(f"**{config}**: ToST per-token time at {fmt_tokens(hi)} / at {fmt_tokens(lo)} = **{r:.2f}** "
                         f"(target <= 1.2: {'met' if s['tost_flat_met'] else 'not met'}); GPT: "
                         f"{s.get('gpt_ratio_last_first', float('nan')):.2f}. GPT / ToST per token at "
                         f"{fmt_tokens(hi)}: {ratio_hi:.1f}x.")
    big = max((r for r in rows if r["model"] == "gpt"), key=lambda r: (r["dim"] * r["depth"], r["position"]))
    notes.append("ToST's step does the same work at every position (the state is three running sums per head), "
                 "so its per-token time is flat up to noise; GPT's step reads the whole cache (attention over P keys) "
                 "and, in `whiteformer.models.lm.CausalSelfAttention.step`, builds a new cache with `torch.cat` at "
                 f"every token: a copy of the whole cache ({fmt_bytes(big['state_bytes'])} per token for "
                 f"{big['config']} at {fmt_tokens(big['position'])}), so its time grows linearly with P. A "
                 "preallocated cache would remove the copy, not the O(P) attention read.")
    out += [f"* {n}" for n in notes] + [""]
    return out


def compression_section(comp: Optional[Dict[str, Any]]) -> List[str]:
    from . import compressed_attention as C

    if not comp or not comp.get("rows"):
        return prose("compression_pending")
    rows = comp["rows"]
    plan = comp["plan"]
    out = prose("compression", ratios=", ".join(map(str, plan["ratios"])), tokens=plan["tokens"],
                 batch=plan["batch"], rounds=plan["rounds"]) + [C.tables(rows), ""]
    ex = [r for r in rows if r["path"] == "explicit" and r["layer"] != "mhsa"]
    irr_parts = []
    for path in ("sdpa", "explicit"):
        q = []
        for r in rows:
            if r["layer"] == "irratt_identity" and r["path"] == path:
                t = _row(rows, layer="truncatt", path=path, block=r["block"], target_qk_ratio=r["target_qk_ratio"])
                if t:
                    q.append(r["time_s"] / t["time_s"])
        if q:
            irr_parts.append(f"{min(q):.2f}-{max(q):.2f}x on the {'SDPA' if path == 'sdpa' else 'explicit'} path")
    irr = ", ".join(irr_parts) or "n/a"
    if ex:
        best = min(ex, key=lambda r: r["time_vs_mhsa_same_path"])
        worst = max(ex, key=lambda r: r["time_vs_mhsa_same_path"])
        out += [
            f"* Explicit path: measured time / MHSA time ranges from {best['time_vs_mhsa_same_path']:.2f}x "
            f"({C.LABELS[best['layer']]}, {best['block']}, CR {best['target_qk_ratio']}) to "
            f"{worst['time_vs_mhsa_same_path']:.2f}x ({C.LABELS[worst['layer']]}, {worst['block']}, CR "
            f"{worst['target_qk_ratio']}), against whole-block MACs ratios of "
            f"{min(r['block_macs_ratio'] for r in ex):.2f}-{max(r['block_macs_ratio'] for r in ex):.2f}: at N = 197 "
            "the QK part is only part of the block (VO and the output projection are unchanged), and the "
            "compressed layers run separate q, k and v projections (three GEMMs instead of one fused qkv GEMM) "
            "plus, for IrrAtt with general fusion, an N^2 H B head-fusion step that the SDPA kernel cannot absorb.",
            f"* Irregular vs equal ranks at the same budget, IrrAtt (identity fusion) / TruncAtt time: {irr}. On "
            "the SDPA path irregular ranks are zero-padded to the largest; on the explicit path the per-head "
            "logits are separate matmuls. The paper notes that irregular ranks need 'extra low-level "
            "optimization' to turn their FLOPs into speed.",
            "",
        ]
    return out


def fused_section(results: Path, suffix: str = "") -> List[str]:
    data = _load(results, f"tssa_fused{suffix}.json")
    if not data:
        return prose("fused_not_run")
    out = prose("fused", command=data.get("command", "python -m benchmarks.tssa_fused"))
    try:
        mod = importlib.import_module("benchmarks.tssa_fused")
        out += [mod.table(data["results"]), ""]
    except Exception as e:  # noqa: BLE001 - the other benchmark's format may change
        out += [f"(table not rendered: {type(e).__name__}: {e}; see the JSON)", ""]
    out += prose("fused_notes")
    return out


def op_floor_section(results: Path, suffix: str = "") -> List[str]:
    """``tssa`` / ``causal_tssa`` as multiples of ``w.clone()`` against their targets
    (``benchmarks/op_floor.py``)."""
    data = _load(results, f"op_floor{suffix}.json")
    if not data:
        return prose("op_floor_not_run")
    load = data.get("loadavg"), data.get("loadavg_end")
    cfg = data.get("config", {})
    note = cfg.get("rounds_note")
    mod = importlib.import_module("benchmarks.op_floor")
    out = prose("op_floor", command=data.get("command", "python -m benchmarks.op_floor"), torch=data.get("torch"),
                load_start=load[0] and load[0][0], load_end=load[1] and load[1][0], rounds=cfg.get("rounds"),
                rounds_note=f" ({note})" if note else "", **mod.reading_values(data))
    try:
        out += [mod.table(data), ""]
    except Exception as e:  # noqa: BLE001 - the other benchmark's format may change
        out += [f"(table not rendered: {type(e).__name__}: {e}; see the JSON)", ""]
    return out


def gpu_section(results: Path, suffix: str = "") -> List[str]:
    """The GPU (Triton) section: what ``benchmarks/gpu.py`` measures, how to run it, and what this
    machine could measure (the kernels' correctness through Triton's interpreter only, until a
    ``gpu.json`` from a GPU run is in the results)."""
    out = prose("gpu") + gpu_model_section(results) + gpu_check_section(results)
    data = _load(results, f"gpu{suffix}.json")
    if not data:
        return out + prose("gpu_not_measured")
    from . import gpu

    cfg = data["config"]
    out += prose("gpu_measured", gpu=data.get("gpu", "?"), torch=data.get("torch"), triton=data.get("triton"),
                 command=data.get("command", "python -m benchmarks.gpu"), dtype=cfg["dtype"], batch=cfg["batch"],
                 heads=cfg["heads"], head_dim=cfg["head_dim"], n=cfg["n"])
    out += [gpu.ops_table(data["ops"]), ""]
    if data.get("stack"):
        out += prose("gpu_stacks", depth=cfg["depth"]) + [gpu.stack_table(data["stack"]), ""]
    return out


def gpu_check_section(results: Path) -> List[str]:
    """The one-call GPU check (:mod:`benchmarks.gpu_check`): its summary tables when a GPU run's
    ``gpu_check/gpu_check.json`` is in the results, else what it will measure and that it has not run."""
    data = _load(results, "gpu_check/gpu_check.json")
    if not data or data.get("dry_run"):
        return prose("gpu_check_not_run")
    from .gpu_check import summary

    text = summary.markdown(data["summary"], data["parts"])
    lines = [("##" + line) if line.startswith("#") else line for line in text.splitlines()]
    return prose("gpu_check", command=data.get("command"), wall_s=data.get("wall_s")) + lines[1:] + [""]


def triton_matrix_lines(matrix: Optional[Dict[str, Any]]) -> List[str]:
    """The kernels under every Triton release (``triton_matrix.json``, :mod:`benchmarks.triton_matrix`)."""
    if not matrix:
        return prose("triton_matrix_missing")
    from . import triton_matrix

    return prose("triton_matrix", command=matrix["command"], torch=matrix["torch"], numpy=matrix["numpy"],
                 specialisations=max((r["compile"].get("specialisations", 0) for r in matrix["results"]), default="?"),
                 tests=", ".join(f"`{t}`" for t in matrix["interpreter_tests"])) + [
        triton_matrix.table(matrix["results"]), ""]


def gpu_model_section(results: Path) -> List[str]:
    """What stands in for GPU measurements here: the compile check of the kernels for sm_80/sm_90
    (tests/ops/test_triton_compile.py) and the memory-traffic model (``gpu_model.json``)."""
    out = prose("gpu_model") + triton_matrix_lines(_load(results, "triton_matrix.json"))
    model = _load(results, "gpu_model.json")
    if not model:
        return out + prose("gpu_traffic_missing")
    from . import gpu

    cfg = model["config"]
    out += prose("gpu_traffic", command=model.get("command", "python -m benchmarks.gpu --model"), batch=cfg["batch"],
                 heads=cfg["heads"], n=cfg["n"], dtype=cfg["dtype"])
    return out + [gpu.model_table(model["rows"]), ""] + prose("gpu_traffic_reading")


def _lm_model_reading(lm: Dict[str, Any]) -> List[str]:
    """Bullets comparing the measured ratios at the paper's contexts with the paper's."""
    from . import lm_model as L

    out = []
    for T, paper in L.PAPER.items():
        cells = []
        for mode in lm["plan"]["modes"]:
            for vs in ("gpt_sdpa", "gpt_softmax"):
                d = lm["summary"].get(f"{mode}/{lm['plan']['losses'][-1]}/{T}/tost_over_{vs}", {})
                if "time_ratio" in d:
                    mem = f"{d['memory_ratio']:.2f}x" if "memory_ratio" in d else "-"
                    cells.append(f"{mode} vs {vs}: {d['time_ratio']:.2f}x time, {mem} memory")
        if cells:
            out.append(f"- {fmt_tokens(T)} (paper: {paper['time']:.2f}x time, {paper['memory']:.2f}x memory): "
                       + "; ".join(cells) + ".")
    if out:
        out.append("- Reading: against the explicit softmax (the (T, T) scores formed and kept for the backward, "
                   "as nanoGPT's slow path) ToST's ratios shrink with the context as the paper's do; against SDPA "
                   "(PyTorch's fused CPU kernel, flash-style: no (T, T) matrix is kept) the memory of both models is "
                   "linear in T and dominated by the MLP activations and the LM head, so the memory ratio stays "
                   "near 1 and the time ratio comes only from the attention FLOPs.")
        out.append("")
    return out


def lm_model_section(lm: Optional[Dict[str, Any]]) -> List[str]:
    """ToST Table 4 (right): the model-level ratios next to the paper's (benchmarks/lm_model.py)."""
    from . import lm_model as L

    out = ["## ToST Table 4 (right): model-level time and memory of the base language models", ""]
    if not lm:
        return out + ["Not run yet: `python -m benchmarks.lm_model` (see its docstring for the options).", ""]
    plan = lm["plan"]
    losses = {"plain": "the plain loss (all logits formed)",
              "chunked": "the chunked loss (`model(idx, targets, loss_chunk=...)`, "
                         "`whiteformer.ops.linear_cross_entropy`: the (T, 50304) logits are never formed whole; "
                         "tested equal to the plain loss, forward and gradient)"}
    out += prose("lm_model", losses=" and with ".join(losses[k] for k in plan["losses"]),
                 cpus=lm["machine"]["logical_cpus"], load=f"{lm['machine']['loadavg'][0]:.1f}",
                 command=lm.get("command") or "python -m benchmarks.lm_model") + [L.tables(lm)]
    out += _lm_model_reading(lm)
    prof = [r for r in lm["rows"] if r["kind"] == "profile"]
    if prof:
        per = {(r["model"], r["part"]): r["per_model_s"] for r in prof}
        head = per.get(("shared", "lm_head+loss (plain)"))
        for k in ("tost", "gpt_sdpa"):
            a, m = per.get((k, "attention")), per.get((k, "mlp"))
            if None in (a, m, head):
                continue
            tot = a + m + head
            out.append(f"- {k} at {fmt_tokens(prof[0]['context'])} (sum of the components {fmt_time(tot)}): attention "
                       f"{100 * a / tot:.0f} %, MLP {100 * m / tot:.0f} %, LM head + plain loss {100 * head / tot:.0f} %.")
        mt, mg = per.get(("tost", "mlp")), per.get(("gpt_sdpa", "mlp"))
        if mt and mg:
            loads = [r["env"]["loadavg"][0] for r in lm["rows"] if r.get("env", {}).get("loadavg")]
            out.append(f"- Noise: the two models' MLPs are the same module and measured {fmt_time(mt)} vs "
                       f"{fmt_time(mg)} ({max(mt, mg) / min(mt, mg):.2f}x) under a 1-minute load of "
                       f"{min(loads):.1f}-{max(loads):.1f} on {lm['machine']['logical_cpus']} CPUs: single runs "
                       "on this shared machine, read the ratios with that spread in mind.")
        chunked = per.get(("shared", "lm_head+loss (chunked)"))
        if head and chunked:
            out.append(f"- LM head + loss: chunked {fmt_time(chunked)} vs plain {fmt_time(head)} "
                       f"({chunked / head:.2f}x time); its memory saving is in the table above.")
        out.append("")
    skipped = sorted({(r["model"], r["context"], r["mode"]) for r in lm["rows"] if r.get("skipped")})
    if skipped:
        out += ["Skipped (explicit-softmax scores above the memory budget of "
                f"{plan['mem_budget_gib']} GiB): " + ", ".join(f"{m} {fmt_tokens(T)} {mode}" for m, T, mode in skipped),
                ""]
    missing = [T for T in L.PAPER if T not in plan["contexts"]]
    if missing:
        out += [f"Not measured here: context {', '.join(fmt_tokens(T) for T in missing)} (the paper's columns): one "
                "training step of the 12-layer base models there takes many minutes on this shared CPU. Run "
                "`python -m benchmarks.lm_model` on an idle machine or a GPU for them.", ""]
    return out


def grad_checkpointing_section(gc: Optional[Dict[str, Any]]) -> List[str]:
    """Peak memory and time of a training step with and without activation checkpointing
    (benchmarks/grad_checkpointing.py)."""
    from . import grad_checkpointing as G

    out = ["## Activation checkpointing of the language models", ""]
    if not gc:
        return out + ["Not run yet: `python -m benchmarks.grad_checkpointing`.", ""]
    out += prose("grad_checkpointing", cpus=gc["machine"]["logical_cpus"], load=f"{gc['machine']['loadavg'][0]:.1f}",
                 command=gc.get("command") or "python -m benchmarks.grad_checkpointing", tables=G.tables(gc))
    return out


def packed_varlen_section(result: Optional[Dict[str, Any]]) -> List[str]:
    """Packed documents: the native varlen path against the padded layout (:mod:`benchmarks.packed_varlen`)."""
    from .packed_varlen import section

    return section(result)


def packed_lm_section(result: Optional[Dict[str, Any]]) -> List[str]:
    """Packed documents through a language model, before and after the token layout (:mod:`benchmarks.packed_varlen`)."""
    from .packed_varlen import lm_section

    return lm_section(result)


def compressed_latency_section(result: Optional[Dict[str, Any]]) -> List[str]:
    """Whole compressed models against the original, interleaved (:mod:`benchmarks.compressed_latency`)."""
    from .compressed_latency import section

    return section(result)


def irratt_decomposition_section(result: Optional[Dict[str, Any]]) -> List[str]:
    """IrrAtt's decomposition, fast path against the reference (:mod:`benchmarks.irratt_decomposition`)."""
    from .irratt_decomposition import section

    return section(result)


def context_parallel_section(results: Path, suffix: str = "") -> List[str]:
    """Context parallelism: its own benchmark, :mod:`benchmarks.context_parallel`."""
    from .context_parallel import section

    return section(_load(results, f"context_parallel{suffix}.json"))


def linearize_section(results: Path, suffix: str = "") -> List[str]:
    """The linearization study (:mod:`benchmarks.linearize`; also docs/results.md, section 10)."""
    from .linearize import section

    return section(_load(results, f"linearize{suffix}.json"), _load(results, f"linearize_vision{suffix}.json"))


def render(results: Path, suffix: str = "") -> str:
    """The page for the result files in ``results`` (``suffix`` "_quick" for a --quick run)."""
    att = _load(results, f"attention_scaling{suffix}.json")
    gen = _load(results, f"generation{suffix}.json")
    comp = _load(results, f"compressed_attention{suffix}.json")
    if not (att or gen or comp):
        raise FileNotFoundError(f"no benchmark results in {results}")
    lines: List[str] = []
    if att:
        lines += attention_section(att, results, suffix)
    if gen:
        lines += generation_section(gen, results, suffix)
    lines += compression_section(comp)
    lines += compressed_latency_section(_load(results, f"compressed_latency{suffix}.json"))
    lines += irratt_decomposition_section(_load(results, f"irratt_decomposition{suffix}.json"))
    lines += lm_model_section(_load(results, f"lm_model{suffix}.json"))
    lines += grad_checkpointing_section(_load(results, f"grad_checkpointing{suffix}.json"))
    lines += packed_varlen_section(_load(results, f"packed_varlen{suffix}.json"))
    lines += packed_lm_section(_load(results, f"packed_lm{suffix}.json"))
    lines += fused_section(results, suffix)
    lines += op_floor_section(results, suffix)
    lines += gpu_section(results, suffix)
    lines += context_parallel_section(results, suffix)
    lines += linearize_section(results, suffix)
    sections = "".join(line + "\n" for line in lines)
    return string.Template((TEMPLATES / "page.md").read_text(encoding="utf-8")).substitute(
        page_values(att, gen, comp), sections=sections)


def main(argv: Optional[Sequence[str]] = None) -> Path:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=common.RESULTS_DIR)
    p.add_argument("--out", type=Path, default=DOC)
    p.add_argument("--quick", action="store_true", help="render the *_quick files (of a --quick run)")
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    common.write_text(a.out, render(a.results, "_quick" if a.quick else ""))
    common.log(f"wrote {a.out}")
    return a.out


if __name__ == "__main__":
    main()
