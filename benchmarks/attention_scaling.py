"""Attention scaling: time and peak memory of a stack of attention layers as the number of tokens n
and the width d grow (ToST Fig. 1/6/7, DMST Fig. 4, ECA Fig. 2).

Setup (the papers'): ``depth`` = 12 attention layers, batch 1, K = 8 heads, d = 384; the token
sweep at n = 1k ... 64k and the width sweep at n = 4096. Only attention layers are stacked (no MLP,
no norm); a residual ``x + attn(x)`` joins them (ECA layers contain their residual). Modes:
``fwd`` (under ``torch.no_grad``) and ``fwdbwd`` (forward, ``mean().backward()``; the width sweep
runs ``fwd`` only by default). Each (method, n) runs in its own child process: a warm-up on 256
tokens, per-length caches filled (ECA's sketches), then the first call at size n under the
peak-memory meter, then the timed runs (median). ``profile`` adds a ``torch.profiler`` breakdown
of one forward per method at n = 4096.

Budgets: before running a configuration its single-run time and peak memory are extrapolated
from the previous size of the same method and mode (time ~ n^a, memory ~ n^b with the method's
complexity exponents); a configuration over ``time_budget`` seconds or ``mem_budget`` bytes is
recorded as ``skipped (budget)`` / ``skipped (memory)`` (and so are the larger sizes).

Usage::

    python -m benchmarks.attention_scaling [--quick] [--out DIR] [--methods tssa,mhsa_sdpa,...]
        [--sweeps tokens,dim,profile] [--tokens 8192,65536] [--allocator default|keep] [--merge]
        [--time-budget S] [--mem-budget-gib G] [--threads auto|N]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from . import common
from .common import GiB, fmt_bytes, fmt_time, fmt_tokens, log

# name -> (label, time exponent in n, memory exponent in n). Quadratic-time methods: MHSA, MSSA;
# quadratic memory: those that materialise the N x N attention matrix (not SDPA's flash kernel).
METHODS: Dict[str, tuple] = {
    "tssa": ("TSSA (ToST)", 1, 1),
    "tssa_torch": ("TSSA, pure PyTorch", 1, 1),
    "causal_tssa": ("causal TSSA", 1, 1),
    "dmsa": ("DMSA (DMST)", 1, 1),
    "eca": ("ECA", 1, 1),
    "eca_nochol": ("ECA w/o Cholesky", 1, 1),
    "xca": ("XCA (XCiT)", 1, 1),
    "mssa": ("MSSA (CRATE)", 2, 2),
    "mhsa_sdpa": ("MHSA (SDPA)", 2, 1),
    "mhsa_explicit": ("MHSA (explicit softmax)", 2, 2),
}
MODES = ("fwd", "fwdbwd")

# time_budget / time_budget_fwdbwd: max estimated seconds of ONE run (target_time_budget: MHSA (SDPA)
# forward up to target_tokens, needed for the target ratio); repeats / budget_per_config / long_run:
# timed runs after the first call at a size (see common.repeat_runs); dim_exclude: methods left out of
# the width sweep (explicit-softmax MHSA: its n^2 softmax dominates at any d, ~20-40 s per point).
FULL = dict(tokens=[1024, 2048, 4096, 8192, 16384, 32768, 65536], dims=[192, 384, 768, 1536],
            dim_sweep_tokens=4096, dim_modes=["fwd"], depth=12, heads=8, dim=384, repeats=3, budget_per_config=4.0,
            long_run=5.0, time_budget=60.0, target_time_budget=200.0, time_budget_fwdbwd=12.0, mem_budget=8 * GiB,
            target_tokens=16384, profile_tokens=4096, dim_exclude=["mhsa_explicit"], allocator="default")
QUICK = dict(tokens=[256, 1024], dims=[192, 384], dim_sweep_tokens=512, dim_modes=["fwd"], depth=2,
             heads=8, dim=384, repeats=2, budget_per_config=1.0, long_run=2.0, time_budget=10.0,
             target_time_budget=10.0, time_budget_fwdbwd=10.0, mem_budget=2 * GiB, target_tokens=1024,
             profile_tokens=256, dim_exclude=[], allocator="default")


class _Residual(nn.Module):
    def __init__(self, layer: nn.Module, residual: bool):
        super().__init__()
        self.layer, self.residual = layer, residual

    def forward(self, x):
        y = self.layer(x)
        return x + y if self.residual else y


def _no_cholesky_basis(y: torch.Tensor, eps: float) -> torch.Tensor:
    # ECA "w/o Cholesky" timing ablation (ECA paper, Fig. 2): the column-normalised sketch is used
    # as the basis, skipping the Gram matrix, its Cholesky factor and the triangular solve.
    return torch.nn.functional.normalize(y, p=2.0, dim=-2)


def prepare_process(method: str) -> str:
    """Process-wide switches of a method variant, applied in its child process only; returns the
    TSSA implementation in use ("fused kernel" / "pure PyTorch") or "" for other methods.

    ``tssa_torch``: ``WHITEFORMER_DISABLE_KERNELS=1`` (TSSA's pure-PyTorch path instead of the
    fused C++ kernel that ``tssa`` / ``causal_tssa`` dispatch to when it is available);
    ``eca_nochol``: ECA's orthonormal basis replaced by the normalised sketch."""
    if method == "tssa_torch":
        os.environ["WHITEFORMER_DISABLE_KERNELS"] = "1"
    if method == "eca_nochol":
        import whiteformer.ops.eca as eca_ops

        eca_ops._basis = _no_cholesky_basis
    if method not in ("tssa", "tssa_torch", "causal_tssa"):
        return ""
    try:
        from whiteformer.ops._kernels import fused_supported
    except ImportError:
        return "pure PyTorch"
    return "fused kernel" if fused_supported(torch.zeros(1, 1, 1, 1)) else "pure PyTorch"


def build_layer(method: str, dim: int, heads: int) -> nn.Module:
    """One attention layer of ``method`` (see :data:`METHODS`)."""
    from whiteformer.attention import build

    if method == "tssa_torch":
        return build("tssa", dim, heads)
    if method == "causal_tssa":
        return build("causal_tssa", dim, heads, pos_bias=False)  # no position table: any length
    if method in ("eca", "eca_nochol"):
        return build("eca", dim, heads)
    if method in ("mhsa_sdpa", "mhsa_explicit"):
        layer = build("mhsa", dim, heads)
        layer.fused_attn = method == "mhsa_sdpa"
        return layer
    return build(method, dim, heads)


def build_stack(method: str, dim: int, heads: int, depth: int) -> nn.Module:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {list(METHODS)}")
    residual = method not in ("eca", "eca_nochol")  # the ECA layer contains its residual
    return nn.Sequential(*[_Residual(build_layer(method, dim, heads), residual) for _ in range(depth)])


def prewarm_caches(model: nn.Module, n: int, device: str, dtype: torch.dtype = torch.float32) -> None:
    """Fill per-length caches before timing: ECA layers cache their fixed Gaussian sketches per
    number of tokens (``omega_for``); generating them is a one-time cost per (layer, n) that would
    otherwise land in the first (for long runs, the only) measured call."""
    for m in model.modules():
        if hasattr(m, "omega_for"):
            if getattr(m, "use_expand", False):
                m.omega_for(n, "expand", device=device, dtype=dtype)
            if getattr(m, "use_compress", False):
                m.omega_for(n, "compress", device=device, dtype=dtype)


def run_config(method: str, n: int, dim: int, heads: int, depth: int, modes: Sequence[str], *, repeats: int,
               budget_per_config: float, long_run: float, threads: Optional[int], device: str,
               bracket: Optional[str] = None, allocator: str = "default", seed: int = 0) -> Dict[str, Any]:
    """Child-process body: measure ``modes`` of one (method, n, dim). Returns {mode: result}.

    ``bracket``: another method whose forward is timed just before and just after each forward
    run of ``method`` in this process (``B A B A B``), giving a side-by-side ratio under the same
    load (stored as ``result["fwd"]["bracket"]``). ``allocator="keep"``: glibc keeps freed
    blocks for reuse (:func:`common.keep_freed_memory`)."""
    if allocator == "keep" and not common.keep_freed_memory():
        raise RuntimeError("allocator='keep' needs glibc mallopt")
    common.setup_torch(threads, seed)
    impl = prepare_process(method)
    model = build_stack(method, dim, heads, depth).to(device).eval()  # no dropout; ECA: fixed sketches
    other = build_stack(bracket, dim, heads, depth).to(device).eval() if bracket and "fwd" in modes else None

    def make_fns(m, x):
        def fwd():
            with torch.no_grad():
                m(x)

        def fwdbwd():
            m.zero_grad(set_to_none=True)
            m(x).float().mean().backward()

        return {"fwd": fwd, "fwdbwd": fwdbwd}

    small = torch.randn(1, min(n, 256), dim, device=device)
    for mode in modes:
        make_fns(model, small)[mode]()
    if other is not None:
        make_fns(other, small)["fwd"]()
    x = torch.randn(1, n, dim, device=device)
    prewarm_caches(model, n, device)
    fns = make_fns(model, x)
    b_samples: List[float] = []
    if other is not None:
        b_fwd = make_fns(other, x)["fwd"]
        b_samples.append(common.time_call(b_fwd, device))
    out: Dict[str, Any] = {}
    for mode in modes:
        model.zero_grad(set_to_none=True)
        with common.PeakMemory(device) as mem:
            first = common.time_call(fns[mode], device)
        if other is not None and mode == "fwd":
            b_samples.append(common.time_call(b_fwd, device))

            def bracketed():  # one run of ``method`` followed by one of ``bracket``; returns the first
                t = common.time_call(fns["fwd"], device)
                b_samples.append(common.time_call(b_fwd, device))
                return t

            res = common.repeat_runs(bracketed, first, device=device, repeats=repeats, budget_s=budget_per_config,
                                     long_run_s=long_run, self_timed=True)
            res["bracket"] = dict(method=bracket, **common.summarize(b_samples),
                                  note=f"{bracket} forward timed before and after each {method} forward run")
        else:
            res = common.repeat_runs(fns[mode], first, device=device, repeats=repeats, budget_s=budget_per_config,
                                     long_run_s=long_run)
        res.update(first_s=first, peak_mem_bytes=mem.delta, mem_method=mem.method, impl=impl)
        out[mode] = res
    return out


def _estimate(history: List[tuple], x: int, t_exp: float, m_exp: float):
    """Extrapolate (time, memory) at size x from the last measured (size, time, memory)."""
    if not history:
        return None, None
    x0, t0, m0 = history[-1]
    r = x / x0
    return t0 * r ** t_exp, (m0 * r ** m_exp if m0 is not None else None)


def sweep(methods: Sequence[str], sizes: Sequence[int], *, axis: str, cfg: Dict[str, Any], threads: Optional[int],
          device: str, command: str, modes: Sequence[str] = MODES, timeout: float = 1800.0) -> List[Dict[str, Any]]:
    """Run the token sweep (``axis="tokens"``: sizes are n at d = cfg["dim"]) or the width sweep
    (``axis="dim"``: sizes are d at n = cfg["dim_sweep_tokens"]). Returns result rows."""
    rows: List[Dict[str, Any]] = []
    for method in methods:
        if axis == "dim" and method in cfg.get("dim_exclude", ()):
            continue
        label, t_exp, m_exp = METHODS[method]
        if axis == "dim":
            t_exp, m_exp = 2, 1  # projections ~ d^2 (quadratic methods: n^2 d + n d^2), activations ~ d
        history: Dict[str, List[tuple]] = {m: [] for m in modes}
        stopped: Dict[str, str] = {}
        for size in sizes:
            n, dim = (size, cfg["dim"]) if axis == "tokens" else (cfg["dim_sweep_tokens"], size)
            base = dict(sweep=axis, method=method, label=label, n=n, dim=dim, heads=cfg["heads"], depth=cfg["depth"],
                        batch=1)
            to_run, pending = [], []
            for mode in (modes if axis == "tokens" else cfg.get("dim_modes", modes)):
                row = dict(base, mode=mode)
                est_t, est_m = _estimate(history[mode], size, t_exp, m_exp)
                row.update(est_time_s=est_t, est_mem_bytes=est_m)
                budget = cfg["time_budget"] if mode == "fwd" else cfg["time_budget_fwdbwd"]
                if (axis, method, mode) == ("tokens", "mhsa_sdpa", "fwd") and n <= cfg["target_tokens"]:
                    budget = max(budget, cfg.get("target_time_budget", budget))  # the target needs this one
                if mode in stopped:
                    row["status"] = stopped[mode]
                elif est_m is not None and est_m > cfg["mem_budget"]:
                    row["status"] = stopped[mode] = "skipped (memory)"
                elif est_t is not None and est_t > budget:
                    row["status"] = stopped[mode] = "skipped (budget)"
                else:
                    to_run.append(mode)
                pending.append(row)
            if to_run:
                bracket = ("tssa" if axis == "tokens" and method == "mhsa_sdpa" and n == cfg["target_tokens"]
                           else None)  # the target ratio, measured side by side
                try:
                    res = common.run_isolated(run_config, method, n, dim, cfg["heads"], cfg["depth"], to_run,
                                              repeats=cfg["repeats"], budget_per_config=cfg["budget_per_config"],
                                              long_run=cfg["long_run"], threads=threads, device=device,
                                              bracket=bracket, allocator=cfg.get("allocator", "default"),
                                              timeout=timeout)
                except common.ChildFailed as e:
                    res = {m: {"error": str(e).splitlines()[0]} for m in to_run}
            else:
                res = {}
            env = common.row_env(command, device, threads)
            for row in pending:
                mode = row["mode"]
                if mode in res:
                    r = res[mode]
                    if "error" in r:
                        row["status"] = stopped[mode] = "failed: " + r["error"][:200]
                    else:
                        row.update(r, status="ok")
                        history[mode].append((size, r["time_s"], r["peak_mem_bytes"]))
                row["env"] = env
                rows.append(row)
                if row["status"] == "ok":
                    log(f"  {axis:6s} {label:24s} n={n:6d} d={dim:5d} {mode:6s} {fmt_time(row['time_s']):>9s} "
                        f"x{row['runs']}  peak {fmt_bytes(row['peak_mem_bytes'])}")
                else:
                    log(f"  {axis:6s} {label:24s} n={n:6d} d={dim:5d} {mode:6s} {row['status']}"
                        + (f" (est. {fmt_time(row['est_time_s'])}, {fmt_bytes(row['est_mem_bytes'])})"
                           if row.get("est_time_s") is not None else ""))
    return rows


def profile_config(method: str, n: int, dim: int, heads: int, depth: int, *, threads: Optional[int], device: str,
                   top: int = 8, seed: int = 0) -> Dict[str, Any]:
    """Child-process body: where the forward time of one (method, n) goes. One forward under
    ``torch.profiler`` (after a warm-up at the same size); operators ranked by self time."""
    from torch.profiler import ProfilerActivity, profile

    common.setup_torch(threads, seed)
    impl = prepare_process(method)
    model = build_stack(method, dim, heads, depth).to(device).eval()
    x = torch.randn(1, n, dim, device=device)
    prewarm_caches(model, n, device)
    with torch.no_grad():
        model(x)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        with profile(activities=acts) as prof:
            model(x)
            common.sync(device)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    ops = [dict(op=e.key, share=e.self_cpu_time_total / total, calls=e.count) for e in events[:top]]
    return dict(method=method, n=n, dim=dim, depth=depth, impl=impl, total_s=total / 1e6, ops=ops)


def breakdown_table(profiles: List[Dict[str, Any]]) -> str:
    if not profiles:
        return ""
    p0 = profiles[0]
    header = ["method", "profiled forward", "top operators by self time (share)"]
    body = [[METHODS[p["method"]][0], fmt_time(p["total_s"]),
             ", ".join(f"`{o['op']}` {o['share']:.0%}" for o in p["ops"][:5])] for p in profiles]
    return (f"**where the forward time goes: n = {p0['n']}, d = {p0['dim']}, {p0['depth']} layers "
            f"(torch.profiler, one forward, self time per operator)**\n\n" + common.markdown_table(header, body) + "\n")


def layer_macs(method: str, n: int, d: int) -> int:
    """Multiply-adds of one layer's matrix products: TSSA 2 n d^2 (the projection U and the output
    projection; its statistics are O(n d)), MHSA 4 n d^2 + 2 n^2 d (q, k, v, out; q k^T, attn v)."""
    if method == "tssa":
        return 2 * n * d * d
    if method in ("mhsa_sdpa", "mhsa_explicit"):
        return 4 * n * d * d + 2 * n * n * d
    raise ValueError(f"no multiply-add count for method {method!r}")


def target_check(rows: List[Dict[str, Any]], n: int) -> Dict[str, Any]:
    """The issue's target: the TSSA stack at least 50x faster than MHSA (SDPA) at n, forward.

    ``speedup``: MHSA (SDPA) time / TSSA time measured side by side in one process (TSSA runs
    bracketing each MHSA run); ``sweep_speedup``: the same from the two sweep rows (different
    processes and moments). ``flop_ratio``: the ratio of multiply-adds per layer, 4 n d^2 + 2 n^2 d
    for MHSA (q, k, v, out projections; q k^T and attn v) vs 2 n d^2 for TSSA (projection U, out
    projection; its statistics are O(n d)): the speedup a compute-bound run can reach."""
    def get(method):
        for r in rows:
            if (r["sweep"], r["method"], r["mode"], r["n"]) == ("tokens", method, "fwd", n) and r["status"] == "ok":
                return r
        return None

    r_tssa, r_mhsa = get("tssa"), get("mhsa_sdpa")
    out: Dict[str, Any] = {"n": n, "target_speedup": 50.0}
    if r_mhsa is not None:
        d = r_mhsa["dim"]
        out["flop_ratio"] = layer_macs("mhsa_sdpa", n, d) / layer_macs("tssa", n, d)
    out["sweep_speedup"] = (r_mhsa["time_s"] / r_tssa["time_s"]) if r_tssa and r_mhsa else None
    br = r_mhsa.get("bracket") if r_mhsa else None
    if br:
        out["side_by_side"] = {"mhsa_sdpa_s": r_mhsa["time_s"], "tssa_s": br["time_s"],
                               "mhsa_sdpa_samples_s": r_mhsa["samples_s"], "tssa_samples_s": br["samples_s"]}
        out["speedup"] = r_mhsa["time_s"] / br["time_s"]
    else:
        out["speedup"] = out["sweep_speedup"]
    out["met"] = None if out["speedup"] is None else out["speedup"] >= 50.0
    return out


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------


def _cell(row: Dict[str, Any], key: str) -> str:
    if row["status"] != "ok":
        s = row["status"]
        return s.split(":")[0] if s.startswith("failed") else s.replace("skipped ", "skip ")
    return fmt_time(row["time_s"]) if key == "time" else fmt_bytes(row["peak_mem_bytes"])


def _label(method: str, rows: List[Dict[str, Any]]) -> str:
    """Method label; TSSA variants say which implementation ran."""
    impls = {r.get("impl") for r in rows if r["method"] == method and r.get("impl")}
    label = METHODS[method][0]
    return label + " [fused kernel]" if method != "tssa_torch" and impls == {"fused kernel"} else label


def tables(rows: List[Dict[str, Any]]) -> str:
    """Markdown tables: per sweep, mode and quantity, methods x sizes."""
    parts = []
    for axis in ("tokens", "dim"):
        ax_rows = [r for r in rows if r["sweep"] == axis]
        if not ax_rows:
            continue
        key = "n" if axis == "tokens" else "dim"
        sizes = sorted({r[key] for r in ax_rows})
        methods = list(dict.fromkeys(r["method"] for r in ax_rows))
        r0 = ax_rows[0]
        fixed = f"d = {r0['dim']}" if axis == "tokens" else f"n = {r0['n']}"
        for mode in MODES:
            for quantity in ("time", "memory"):
                sel = {(r["method"], r[key]): r for r in ax_rows if r["mode"] == mode}
                if not sel:
                    continue
                mode_s = "forward" if mode == "fwd" else "forward + backward"
                what = "median time" if quantity == "time" else "peak memory (RSS delta)"
                parts.append(f"**{what}, {mode_s}, {r0['depth']} layers, K = {r0['heads']}, {fixed}, batch 1**\n")
                header = ["method"] + [(fmt_tokens(s) if axis == "tokens" else f"d={s}") for s in sizes]
                body = []
                for m in methods:
                    body.append([_label(m, ax_rows)] + [(_cell(sel[(m, s)], quantity) if (m, s) in sel else "")
                                                        for s in sizes])
                parts.append(common.markdown_table(header, body) + "\n")
    return "\n".join(parts)


def plot(rows: List[Dict[str, Any]], out_dir: Path, suffix: str = "") -> List[Path]:
    """Log-log PNGs: time and memory vs n (and vs d), forward and forward+backward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for axis in ("tokens", "dim"):
        ax_rows = [r for r in rows if r["sweep"] == axis and r["status"] == "ok"]
        if not ax_rows:
            continue
        key = "n" if axis == "tokens" else "dim"
        fig, axes = plt.subplots(2, 2, figsize=(12, 9))
        methods = list(dict.fromkeys(r["method"] for r in rows if r["sweep"] == axis))
        for j, mode in enumerate(MODES):
            for i, quantity in enumerate(("time_s", "peak_mem_bytes")):
                ax = axes[i][j]
                for k, m in enumerate(methods):
                    pts = sorted((r[key], r[quantity]) for r in ax_rows if r["method"] == m and r["mode"] == mode)
                    if not pts:
                        continue
                    xs, ys = zip(*pts)
                    if quantity == "peak_mem_bytes":
                        ys = [max(y, 1) / 2 ** 20 for y in ys]
                    style = "--" if METHODS[m][1] == 2 else "-"
                    ax.plot(xs, ys, style, marker="o", ms=3, label=METHODS[m][0], color=f"C{k}")
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel("number of tokens n" if axis == "tokens" else "width d")
                ax.set_ylabel("time (s)" if quantity == "time_s" else "peak memory (MiB, RSS delta)")
                ax.set_title(("forward" if mode == "fwd" else "forward + backward")
                             + (" time" if quantity == "time_s" else " memory"))
                ax.grid(True, which="both", alpha=0.3)
        r0 = ax_rows[0]
        fixed = f"d = {r0['dim']}" if axis == "tokens" else f"n = {r0['n']}"
        fig.suptitle(f"{r0['depth']} stacked attention layers, K = {r0['heads']}, {fixed}, batch 1 "
                     f"({r0['env']['machine']}, {r0['env']['threads']} threads)", fontsize=10)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / f"attention_scaling_{axis}{suffix}.png"
        common.save_figure(fig, p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


# --------------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------------


def run(*, quick: bool = False, out_dir: Optional[Path] = None, methods: Optional[Sequence[str]] = None,
        threads: Optional[int] = None, device: str = "cpu", command: str = "",
        sweeps: Sequence[str] = ("tokens", "dim", "profile"),
        overrides: Optional[Dict[str, Any]] = None, write: bool = True, merge: bool = False) -> Dict[str, Any]:
    """Run the sweeps and the side-by-side target check; write JSON, PNGs and tables.

    ``merge``: re-measure only ``methods`` (e.g. after changing one operator) and replace their
    rows and profiles in the existing result file of ``out_dir``, keeping every other method's;
    the file's top-level ``merged`` list records each such update (its command, machine, load)."""
    cfg = dict(QUICK if quick else FULL)
    cfg.update(overrides or {})
    methods = list(methods or METHODS)
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ValueError(f"unknown methods {bad}; expected some of {list(METHODS)}")
    out_dir = Path(out_dir) if out_dir is not None else common.default_out_dir(quick)
    info = common.machine_info(device)
    log(f"attention scaling ({'quick' if quick else 'full'}): {common.machine_string(info)}, "
        f"load {info['loadavg']}")
    rows: List[Dict[str, Any]] = []
    if "tokens" in sweeps:
        rows += sweep(methods, cfg["tokens"], axis="tokens", cfg=cfg, threads=threads, device=device, command=command)
    if "dim" in sweeps:
        rows += sweep(methods, cfg["dims"], axis="dim", cfg=cfg, threads=threads, device=device, command=command)
    profiles = []
    if "profile" in sweeps:
        for m in methods:
            try:
                profiles.append(common.run_isolated(profile_config, m, cfg["profile_tokens"], cfg["dim"], cfg["heads"],
                                                    cfg["depth"], threads=threads, device=device, timeout=1800))
                p = profiles[-1]
                log(f"  profile {METHODS[m][0]:24s} n={p['n']}: " + ", ".join(
                    f"{o['op']} {o['share']:.0%}" for o in p["ops"][:4]))
            except common.ChildFailed as e:
                log(f"  profile {m}: failed: {str(e).splitlines()[0]}")
    target = None
    if "tokens" in sweeps and "mhsa_sdpa" in methods:
        target = target_check(rows, cfg["target_tokens"])
        if target["speedup"] is not None:
            log(f"  target: TSSA vs MHSA (SDPA) at n={target['n']}, forward: {target['speedup']:.1f}x side by side "
                f"({'met' if target['met'] else 'NOT met'}; target >= 50x; multiply-add ratio "
                f"{target.get('flop_ratio', float('nan')):.1f}x)")
    result = {"benchmark": "attention_scaling", "quick": quick, "config": {k: v for k, v in cfg.items()},
              "machine": info, "command": command, "loadavg_end": common.loadavg(), "target": target,
              "profiles": profiles, "rows": rows}
    suffix = "_quick" if quick else ""
    if merge:
        result = merge_into(out_dir / f"attention_scaling{suffix}.json", result, methods, sweeps)
        rows = result["rows"]
    if write:
        common.write_json(out_dir / f"attention_scaling{suffix}.json", result)
        common.write_text(out_dir / f"attention_scaling{suffix}.md", tables(rows) + "\n" + breakdown_table(profiles))
        result["plots"] = [str(p) for p in plot(rows, out_dir, suffix)]
    return result


def merge_into(path: Path, new: Dict[str, Any], methods: Sequence[str], sweeps: Sequence[str]) -> Dict[str, Any]:
    """The result stored at ``path`` with the rows (of ``sweeps``) and profiles of ``methods``
    replaced by those of ``new``; the target check is redone on the merged rows."""
    if not path.exists():
        raise FileNotFoundError(f"--merge needs an existing result file, {path} not found")
    import json

    old = json.loads(path.read_text())
    keep = [r for r in old["rows"] if not (r["method"] in methods and r["sweep"] in sweeps)]
    rows = keep + new["rows"]
    order = {m: i for i, m in enumerate(METHODS)}
    rows.sort(key=lambda r: (r["sweep"] != "tokens", order.get(r["method"], 99)))
    profiles = old.get("profiles", [])
    if "profile" in sweeps:
        profiles = [p for p in profiles if p["method"] not in methods] + new["profiles"]
        profiles.sort(key=lambda p: order.get(p["method"], 99))
    out = dict(old, rows=rows, profiles=profiles)
    out["merged"] = old.get("merged", []) + [{"methods": list(methods), "sweeps": list(sweeps),
                                               "command": new["command"], "machine": new["machine"],
                                               "loadavg_end": new["loadavg_end"]}]
    target = target_check(rows, out["config"]["target_tokens"])
    out["target"] = target if target.get("speedup") is not None else old.get("target")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m benchmarks.attention_scaling")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 layers (seconds)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default benchmarks/results)")
    p.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--sweeps", default="tokens,dim,profile", help="any of tokens,dim,profile")
    p.add_argument("--threads", default="auto", help="torch threads per measuring process, or auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--time-budget", type=float, default=None, help="max est. seconds of one forward run")
    p.add_argument("--mem-budget-gib", type=float, default=None, help="max est. peak memory (GiB)")
    p.add_argument("--tokens", default=None, help="comma-separated token counts of the token sweep")
    p.add_argument("--merge", action="store_true",
                   help="replace only these methods' rows in the existing result file (after changing one operator)")
    p.add_argument("--allocator", default="default", choices=["default", "keep"],
                   help="keep: glibc keeps freed blocks for reuse (no page faults on re-allocation)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    overrides: Dict[str, Any] = {}
    if a.time_budget is not None:
        overrides.update(time_budget=a.time_budget, time_budget_fwdbwd=a.time_budget)
    if a.mem_budget_gib is not None:
        overrides["mem_budget"] = a.mem_budget_gib * GiB
    if a.tokens:
        overrides["tokens"] = [int(t) for t in a.tokens.split(",")]
    overrides["allocator"] = a.allocator
    return run(quick=a.quick, out_dir=a.out, methods=a.methods.split(",") if a.methods else None,
               threads=common.resolve_threads(a.threads)[0], device=a.device,
               command=common.command_string("benchmarks.attention_scaling", argv), sweeps=a.sweeps.split(","),
               overrides=overrides, merge=a.merge)


if __name__ == "__main__":
    main()
