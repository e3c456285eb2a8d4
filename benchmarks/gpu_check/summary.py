"""Part (f) of the GPU check: the summary of every part's result, as a dict (for
``gpu_check.json``) and as markdown tables (printed, and ``gpu_check.md``)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .. import gpu
from ..common import fmt_bytes, fmt_time, fmt_tokens, markdown_table

OP_MODEL = {"tssa_fwd": ("tssa", ("fwd",)), "tssa_fwdbwd": ("tssa", ("fwd", "bwd")),
            "causal_fwd": ("causal_tssa", ("fwd",)), "causal_fwdbwd": ("causal_tssa", ("fwd", "bwd"))}


def _rows(results: Dict[str, Dict[str, Any]], part: str) -> List[Dict[str, Any]]:
    return results.get(part, {}).get("rows", [])


def correctness(results) -> Optional[Dict[str, Any]]:
    rows = _rows(results, "correctness")
    if "correctness" not in results:
        return None
    worst: Dict[str, Dict[str, float]] = {}
    for r in rows:
        for path in ("triton", "torch"):
            errs = r.get(path, {}).get("rel_err", {})
            if errs:
                d = worst.setdefault(r["dtype"], {})
                d[path] = max(d.get(path, 0.0), max(errs.values()))
    failed = [f"{r.get('op')} {r.get('dtype')} {r.get('layout', '')} {r.get('shape', '')} {r.get('error', '')}".strip()
              for r in rows if not r.get("passed")]
    return {"cases": len(rows), "passed": len(rows) - len(failed), "failed": failed, "worst_rel_err": worst}


def ops_ratios(results) -> Dict[str, Dict[str, Any]]:
    """{impl: {op: ratio to clone}} of the implementations that ran."""
    return {r["impl"]: {op: r[op]["ratio"] for op in gpu.OPS if op in r}
            for r in _rows(results, "ops") if r.get("status") == "ok"}


def bandwidth(results) -> Optional[Dict[str, Any]]:
    part = results.get("bandwidth", {})
    copy = part.get("copy", {}).get("bytes_per_s")
    triton = next((r for r in _rows(results, "ops") if r.get("impl") == "triton" and r.get("status") == "ok"), None)
    if not copy:
        return None
    models = {r["op"]: r for r in part.get("rows", []) if "fwd_bytes" in r}
    ops = {}
    for op, (name, dirs) in OP_MODEL.items():
        m = models.get(name)
        if m is None:
            continue
        moved = sum(m[f"{d}_bytes"] for d in dirs)
        row = {"model_bytes": moved, "model_x_clone": moved / (2 * m["w_bytes"])}
        if triton is not None and op in triton:
            t = triton[op]["time_s"]
            row.update(measured_x_clone=triton[op]["ratio"], achieved_bytes_per_s=moved / t,
                       pct_of_copy=100 * moved / t / copy)
        ops[op] = row
    return {"copy_bytes_per_s": copy, "ops": ops}


def fla(results) -> List[Dict[str, Any]]:
    """Per shape: causal_tssa and tssa forward + backward time over chunk_simple_gla's."""
    by_shape: Dict[tuple, Dict[str, Dict[str, Any]]] = {}
    for r in _rows(results, "fla"):
        by_shape.setdefault(tuple(r["shape"].values()), {})[r["impl"]] = r
    out = []
    for shape, impls in by_shape.items():
        row: Dict[str, Any] = {"shape": dict(zip("BTHD", shape))}
        for name, r in impls.items():
            row[name] = {m: r[m]["time_s"] for m in ("fwd", "fwdbwd") if m in r} or r.get("status", "-")
        gla = impls.get("chunk_simple_gla", {}).get("fwdbwd")
        for name in ("causal_tssa", "tssa"):
            mine = impls.get(name, {}).get("fwdbwd")
            if gla and mine:
                row[f"{name}_fwdbwd_over_gla"] = mine["time_s"] / gla["time_s"]
        out.append(row)
    return out


def lm(results) -> List[Dict[str, Any]]:
    from ..lm_model import PAPER

    rows = {}
    for r in _rows(results, "lm"):
        rows.setdefault(r["context"], {})[r["model"]] = r
    out = []
    for T, m in rows.items():
        tost, gpt = m.get("tost", {}), m.get("gpt_sdpa", {})
        row: Dict[str, Any] = {"context": T, "paper": PAPER.get(T)}
        for k in ("time_s", "peak_bytes"):
            row[f"tost_{k}"], row[f"gpt_{k}"] = tost.get(k), gpt.get(k)
            if tost.get(k) and gpt.get(k):
                row[f"{k}_ratio"] = tost[k] / gpt[k]
        row["status"] = tost.get("status") or gpt.get("status") or "ok"
        out.append(row)
    return out


def lm_more(results) -> Dict[str, Any]:
    """The linearized model's generation step and the packed forward: their rows, and the checks that failed."""
    rows = {p: _rows(results, p) for p in ("lm_linearized", "lm_packed")}
    failed = [f"{p}: {r.get('status') or 'logits differ'}" for p, rs in rows.items() for r in rs
              if not r.get("passed")]
    return {**rows, "failed": failed}


def targets(ratios: Dict[str, Dict[str, Any]], fla_rows: List[Dict[str, Any]], cfg) -> List[Dict[str, Any]]:
    out = []
    tri = ratios.get("triton", {})
    for op, limit in cfg["targets"].items():
        v = tri.get(op)
        out.append({"target": f"{op} <= {limit:g}x clone", "value": v, "met": None if v is None else v <= limit})
    gla = [r.get("causal_tssa_fwdbwd_over_gla") for r in fla_rows]
    measured = [g for g in gla if g is not None]
    out.append({"target": "causal_tssa fwd+bwd faster than chunk_simple_gla at every shape",
                "value": max(measured) if measured else None,
                "met": (all(g < 1 for g in measured) and len(measured) == len(gla)) if measured else None})
    return out


def _ratio(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _met(v: Optional[bool]) -> str:
    return "not measured" if v is None else ("met" if v else "NOT met")


def markdown(s: Dict[str, Any], results: Dict[str, Dict[str, Any]]) -> str:
    env = results.get("env", {})
    pk = env.get("packages", {})
    ver = ", ".join(f"{k} {v.get('version', 'missing')}" for k, v in pk.items() if k in ("torch", "triton",
                                                                                            "transformers", "fla"))
    out = [f"# GPU check{' (dry run: CPU, Triton interpreter, tiny sizes)' if s['dry_run'] else ''}", "",
           f"Device: {env.get('gpu', 'cpu')}; {ver or 'versions unknown'}.", ""]
    out += ["## Parts", "", markdown_table(["part", "status", "seconds"], [
        [p, str(r.get("status")), str(r.get("wall_s", "-"))] for p, r in results.items()]), ""]
    c = s.get("correctness")
    if c:
        out += ["## (a) Correctness: Triton and the PyTorch path vs the float64 reference", "",
                f"{c['passed']} of {c['cases']} cases passed.", ""]
        out.append(markdown_table(["dtype", "worst error, Triton", "worst error, PyTorch path"], [
            [d, f"{w.get('triton', 0):.2e}", f"{w.get('torch', 0):.2e}"] for d, w in c["worst_rel_err"].items()]))
        out += [f"- FAILED: {f}" for f in c["failed"]] + [""]
    ops_rows = _rows(results, "ops")
    if ops_rows:
        out += ["## (b) Operators: time / w.clone() (peak memory)", "", gpu.ops_table(ops_rows), ""]
    stack_rows = _rows(results, "stack")
    if stack_rows:
        out += ["## (b) 12-layer stacks", "", gpu.stack_table(stack_rows), ""]
    if s.get("fla"):
        out += ["## (c) flash-linear-attention beside TSSA (bfloat16): time fwd / fwd+bwd", ""]
        names = ["tssa", "causal_tssa", "chunk_simple_gla", "chunk_retention"]
        lines = []
        for r in s["fla"]:
            cells = []
            for n in names:
                v = r.get(n, "-")
                cells.append(v if isinstance(v, str) else f"{fmt_time(v.get('fwd'))} / {fmt_time(v.get('fwdbwd'))}")
            lines.append([" ".join(f"{k}{v}" for k, v in r["shape"].items()), *cells,
                          _ratio(r.get("causal_tssa_fwdbwd_over_gla"))])
        out += [markdown_table(["shape", *names, "causal_tssa / gla fwd+bwd"], lines), ""]
    if s.get("lm"):
        out += ["## (d) Training step, ToST vs GPT (SDPA), 12 layers", ""]
        lines = [[fmt_tokens(r["context"]), fmt_time(r["tost_time_s"]), fmt_time(r["gpt_time_s"]),
                  _ratio(r.get("time_s_ratio")) + (f" (paper {r['paper']['time']:.2f}x)" if r["paper"] else ""),
                  fmt_bytes(r["tost_peak_bytes"]), fmt_bytes(r["gpt_peak_bytes"]),
                  _ratio(r.get("peak_bytes_ratio")) + (f" (paper {r['paper']['memory']:.2f}x)" if r["paper"] else ""),
                  r["status"]] for r in s["lm"]]
        out += [markdown_table(["tokens", "ToST", "GPT", "time ToST/GPT", "ToST peak", "GPT peak", "memory ToST/GPT",
                                "status"], lines), ""]
    more = s.get("lm_more") or {}
    if more.get("lm_linearized"):
        out += ["## (g) Linearized model (decoder_base, 0 steps): generation step, float32", ""]
        out += [markdown_table(["prompt", "prefill", "step per token", "state after prompt", "state after steps",
                                "step vs forward (rel. error)", "status"], [
            [fmt_tokens(results["lm_linearized"].get("prompt", 0)), fmt_time(r["prefill_s"]),
             fmt_time(r["step_s_median"]), fmt_bytes(r["state_bytes_after_prompt"]),
             fmt_bytes(r["state_bytes_after_steps"]), f"{r['rel_err_step_vs_forward']:.2e} (tol {r['tol']:g})",
             "ok" if r["passed"] else "FAILED"] for r in more["lm_linearized"]]), ""]
    if more.get("lm_packed"):
        out += ["## (h) Packed forward (cu_seqlens), causal ToST", ""]
        out += [markdown_table(["documents", "tokens", "forward", "tokens / s", "document vs alone (rel. error)",
                                "status"], [
            [str(r["documents"]), str(r["tokens"]), fmt_time(r.get("time_s")),
             f"{r['tokens_per_s']:.3g}" if "tokens_per_s" in r else "-",
             f"{r['rel_err_document_vs_alone']:.2e} (tol {r['tol']:g})" if "tol" in r else "-",
             r.get("status") or ("ok" if r.get("passed") else "FAILED")] for r in more["lm_packed"]]), ""]
    b = s.get("bandwidth")
    if b:
        out += [f"## (e) Bandwidth: copy {b['copy_bytes_per_s'] / 1e9:.3g} GB/s (w.clone())", ""]
        lines = [[op, _ratio(r.get("measured_x_clone")), _ratio(r["model_x_clone"]),
                  "-" if "achieved_bytes_per_s" not in r else f"{r['achieved_bytes_per_s'] / 1e9:.3g} GB/s",
                  "-" if "pct_of_copy" not in r else f"{r['pct_of_copy']:.3g} %"] for op, r in b["ops"].items()]
        out += [markdown_table(["op (Triton)", "measured / clone", "traffic model / clone",
                                "achieved (modelled bytes / time)", "% of copy bandwidth"], lines), ""]
    out += ["## Targets (bfloat16, H100)", "", markdown_table(["target", "measured", "status"], [
        [t["target"], _ratio(t["value"]), _met(t["met"])] for t in s["targets"]])]
    return "\n".join(out)


def build(results: Dict[str, Dict[str, Any]], cfg: Dict[str, Any]) -> Dict[str, Any]:
    ratios = ops_ratios(results)
    fla_rows = fla(results)
    c = correctness(results)
    s: Dict[str, Any] = {"dry_run": cfg["dry_run"], "parts": {p: r.get("status") for p, r in results.items()},
                         "correctness": c, "ops": ratios, "bandwidth": bandwidth(results), "fla": fla_rows,
                         "lm": lm(results), "lm_more": lm_more(results)}
    s["targets"] = targets(ratios, fla_rows, cfg)
    s["complete"] = (all(r.get("status") == "ok" for r in results.values()) and not (c and c["failed"])
                     and not s["lm_more"]["failed"])
    return {"summary": s, "markdown": markdown(s, results)}
