"""Compressed attention (IrrAtt paper): measured latency of TruncAtt, CP SlimAtt and IrrAtt blocks vs
the MHSA block they compress, at the same QK FLOPs compression ratio.

For a DeiT-S block (F 384, H 6) and a DeiT-B block (F 768, H 12) at N = 197 tokens, batch 8, each
target QK FLOPs ratio CR gives the ranks (:func:`whiteformer.compress.qk_rank_for_budget`, as the
paper's Sec. 3.4):

* TruncAtt: per-head rank r (all heads equal);
* CP SlimAtt: CP rank R;
* IrrAtt (general fusion): total rank sum L from the budget (fusion cost N^2 H^2 included), split
  into H blocks of irregular ranks (linearly decreasing, a fixed illustrative pattern);
* IrrAtt (identity fusion): the same irregular per-head ranks without a fusion matrix, i.e.
  TruncAtt with irregular ranks (SDPA-capable: the ranks are zero-padded to the largest).

VO is left uncompressed (full ranks) so that only the QK part differs. Each layer is timed on its
SDPA path (``fused_attn = True``; IrrAtt with general fusion has none and always runs explicit
matmuls) and on its explicit-matmul path (``fused_attn = False``, whose MACs are exactly the
:mod:`whiteformer.compress.flops` formulas). All layers of one block run interleaved in one
process (round-robin), so that the ratios to MHSA see the same machine load. Weights are random
(a fresh layer has the right shapes; latency does not depend on the values).

Usage::

    python -m benchmarks.compressed_attention [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from . import common
from .common import fmt_time, log

FULL = dict(blocks=[("DeiT-S", 384, 6), ("DeiT-B", 768, 12)], tokens=197, batch=8, ratios=[0.5, 0.25], rounds=7)
QUICK = dict(blocks=[("tiny", 64, 4)], tokens=33, batch=2, ratios=[0.5], rounds=2)


def available() -> bool:
    """True when the compression toolkit provides its layers."""
    try:
        from whiteformer.compress import CPSlimAtt, IrrAtt, TruncAtt  # noqa: F401
    except ImportError:
        return False
    return True


def irregular_ranks(total: int, heads: int) -> List[int]:
    """``total`` split into ``heads`` ranks >= 1 decreasing linearly (weights 2 ... 1)."""
    if total < heads:
        raise ValueError(f"total rank {total} < number of blocks {heads}")
    w = [2.0 - h / max(heads - 1, 1) for h in range(heads)]
    ranks = [max(1, int(total * x / sum(w))) for x in w]
    i = 0
    while sum(ranks) < total:
        ranks[i % heads] += 1
        i += 1
    while sum(ranks) > total:
        j = max(range(heads), key=lambda h: ranks[h])
        ranks[j] -= 1
    return ranks


def build_layers(dim: int, heads: int, tokens: int, ratio: float) -> Dict[str, Any]:
    """{name: (layer, qk_macs, block_macs, description)} for one block and QK FLOPs ratio."""
    from whiteformer.attention import build
    from whiteformer.compress import CPSlimAtt, IrrAtt, TruncAtt, flops, qk_rank_for_budget

    D = dim // heads
    kw = dict(num_tokens=tokens, dim=dim, num_heads=heads)
    r = qk_rank_for_budget("truncatt", ratio, **kw)
    R = qk_rank_for_budget("cp", ratio, **kw)
    total = qk_rank_for_budget("irratt", ratio, fusion="general", **kw)
    irr = irregular_ranks(total, heads)
    total_id = qk_rank_for_budget("irratt", ratio, fusion="identity", **kw)
    irr_id = irregular_ranks(total_id, heads)
    mhsa = build("mhsa", dim, heads, qkv_bias=True)
    layers = {
        "mhsa": (mhsa, flops.mhsa_qk_macs(tokens, dim, heads, D), flops.mhsa_macs(tokens, dim, heads, D),
                 f"H={heads}, D={D}"),
    }
    for name, layer, desc in (
        ("truncatt", TruncAtt(dim, heads, qk_ranks=r), f"r={r} per head"),
        ("cp_slimatt", CPSlimAtt(dim, heads, rank=R), f"R={R}"),
        ("irratt_general", IrrAtt(dim, heads, ranks=irr, fusion="general"), f"L={irr}"),
        ("irratt_identity", IrrAtt(dim, heads, ranks=irr_id, fusion="identity"), f"L={irr_id}"),
    ):
        layers[name] = (layer, layer.qk_macs(tokens), layer.macs(tokens), desc)
    return layers


def run_block(name: str, dim: int, heads: int, *, tokens: int, batch: int, ratios: Sequence[float], rounds: int,
              threads: Optional[int], device: str, seed: int = 0) -> List[Dict[str, Any]]:
    """Child-process body: every layer of one block at every ratio, both paths, interleaved."""
    common.setup_torch(threads, seed)
    x = torch.randn(batch, tokens, dim, device=device)
    rows = []
    for ratio in ratios:
        layers = build_layers(dim, heads, tokens, ratio)
        fns, meta = {}, {}
        for lname, (layer, qk, macs, desc) in layers.items():
            layer = layer.to(device).eval()
            for fused in (True, False):
                if lname == "irratt_general" and fused:
                    continue  # no SDPA path (general head fusion)

                def f(layer=layer, fused=fused):
                    layer.fused_attn = fused
                    with torch.no_grad():
                        layer(x)

                key = (lname, "sdpa" if fused else "explicit")
                fns[key] = f
                meta[key] = (qk, macs, desc)
        samples = common.interleaved_runs(fns, device=device, rounds=rounds, warmup=True)
        base_qk, base_macs = meta[("mhsa", "sdpa")][:2]
        t_base = {p: common.summarize(samples[("mhsa", p)])["time_s"] for p in ("sdpa", "explicit")}
        for (lname, path), s in samples.items():
            st = common.summarize(s)
            qk, macs, desc = meta[(lname, path)]
            rows.append(dict(block=name, dim=dim, heads=heads, tokens=tokens, batch=batch, target_qk_ratio=ratio,
                             layer=lname, path=path, ranks=desc, qk_macs=qk, block_macs=macs,
                             qk_macs_ratio=qk / base_qk, block_macs_ratio=macs / base_macs,
                             time_vs_mhsa_same_path=st["time_s"] / t_base[path],
                             time_vs_mhsa_sdpa=st["time_s"] / t_base["sdpa"], **st))
    return rows


LABELS = {"mhsa": "MHSA", "truncatt": "TruncAtt", "cp_slimatt": "CP SlimAtt", "irratt_general": "IrrAtt (general)",
          "irratt_identity": "IrrAtt (identity)"}


def tables(rows: List[Dict[str, Any]]) -> str:
    parts = []
    for block in dict.fromkeys(r["block"] for r in rows):
        for ratio in dict.fromkeys(r["target_qk_ratio"] for r in rows if r["block"] == block):
            sel = [r for r in rows if r["block"] == block and r["target_qk_ratio"] == ratio]
            r0 = sel[0]
            parts.append(f"**{block} block (F {r0['dim']}, H {r0['heads']}), N = {r0['tokens']}, batch "
                         f"{r0['batch']}, target QK FLOPs ratio {ratio}**\n")
            header = ["layer", "ranks", "QK MACs ratio", "block MACs ratio", "time SDPA path", "vs MHSA (SDPA)",
                      "time explicit path", "vs MHSA (explicit)"]
            body = []
            for lname in dict.fromkeys(r["layer"] for r in sel):
                by = {r["path"]: r for r in sel if r["layer"] == lname}
                a = by.get("sdpa")
                e = by["explicit"]
                body.append([LABELS[lname], e["ranks"], f"{e['qk_macs_ratio']:.3f}", f"{e['block_macs_ratio']:.3f}",
                             fmt_time(a["time_s"]) if a else "n/a",
                             f"{a['time_vs_mhsa_same_path']:.2f}x" if a else "n/a",
                             fmt_time(e["time_s"]), f"{e['time_vs_mhsa_same_path']:.2f}x"])
            parts.append(common.markdown_table(header, body) + "\n")
    return "\n".join(parts)


def run(*, quick: bool = False, out_dir: Optional[Path] = None, threads: Optional[int] = None, device: str = "cpu",
        command: str = "", write: bool = True) -> Dict[str, Any]:
    plan = dict(QUICK if quick else FULL)
    out_dir = Path(out_dir) if out_dir is not None else common.default_out_dir(quick)
    info = common.machine_info(device)
    log(f"compressed attention ({'quick' if quick else 'full'}): {common.machine_string(info)}, "
        f"load {info['loadavg']}")
    if not available():
        log("  skipped: whiteformer.compress has no layers")
        return {"benchmark": "compressed_attention", "skipped": "whiteformer.compress has no layers"}
    rows: List[Dict[str, Any]] = []
    for name, dim, heads in plan["blocks"]:
        try:
            res = common.run_isolated(run_block, name, dim, heads, tokens=plan["tokens"], batch=plan["batch"],
                                      ratios=plan["ratios"], rounds=plan["rounds"], threads=threads, device=device,
                                      timeout=1800)
        except common.ChildFailed as e:
            log(f"  {name}: failed: {str(e).splitlines()[0]}")
            continue
        env = common.row_env(command, device, threads)
        for r in res:
            r["env"] = env
            log(f"  {name} CR={r['target_qk_ratio']:<5} {LABELS[r['layer']]:18s} {r['path']:8s} "
                f"{fmt_time(r['time_s']):>9s}  x{r['time_vs_mhsa_same_path']:.2f} vs MHSA  "
                f"(QK MACs x{r['qk_macs_ratio']:.2f}, block MACs x{r['block_macs_ratio']:.2f})")
        rows += res
    result = {"benchmark": "compressed_attention", "quick": quick, "plan": plan, "machine": info, "command": command,
              "loadavg_end": common.loadavg(), "rows": rows}
    if write and rows:
        common.write_results(out_dir, "compressed_attention", quick, result, tables(rows))
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m benchmarks.compressed_attention")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--threads", default="auto", help="torch threads per measuring process, or auto")
    p.add_argument("--device", default="cpu")
    return p


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    return run(quick=a.quick, out_dir=a.out, threads=common.resolve_threads(a.threads)[0], device=a.device,
               command=common.command_string("benchmarks.compressed_attention", argv))


if __name__ == "__main__":
    main()
