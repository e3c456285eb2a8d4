"""Packed documents (``cu_seqlens``) on the PyTorch path: the native varlen path against the
padded layout (S, H, L, p) it replaced (and, with ``--kernel``, the C++ CPU kernel, which keeps
that layout), for one long document and many short ones; and how exact a packed row is.

Exactness (``--errors-lengths``, default one long document and 4,000 short ones, 65,536 tokens):
``causal_tssa`` and ``tssa`` on the packed row against each document run alone
(:func:`separate`), forward (out, Pi) and gradients (w, temp, and pos_bias for the causal op),
as the largest error relative to the largest magnitude of the float64 result. In float64 the
packed row is compared with the separate runs; in float32 both the packed row and the separate
runs are compared with the float64 separate runs (a packed row is exact when its error is that
of the separate runs).

One forward + backward (float32, ``WHITEFORMER_BACKEND=torch``) of ``causal_tssa`` and ``tssa``
on a packed row, each cell in a separate process: peak memory is the RSS high-water mark minus
the RSS before (``benchmarks.common.PeakMemory``), time the wall time of that one call. The
padded cell is the former route: :func:`whiteformer.ops.layout.to_padded`, the masked op,
:func:`whiteformer.ops.layout.from_padded`. Usage::

    python -m benchmarks.packed_varlen [--lengths 4096,8x100] [--heads 8] [--p 64] [--kernel]
                                       [--errors-lengths 1,3,8,12,17,24x4000+65536]

The language-model row (``--lm LABEL``, written to ``results/packed_lm.json`` under LABEL, e.g.
"before" / "after" a change): one forward (no gradients, float32, ``WHITEFORMER_BACKEND=torch``) of
a 12-layer ToST LM and its GPT baseline on one packed row of 1,000 documents of 1-32 tokens,
timed (median of the runs that fit the budget) and with its host reads counted (``.tolist()``,
``.item()``, ``.cpu()``, tensors turned into Python numbers: each one a stream synchronisation on
a GPU). The same script runs against another checkout of the library with that checkout's ``src``
first on ``PYTHONPATH``::

    python -m benchmarks.packed_varlen --lm after [--lm-documents 1000] [--lm-depth 12] [--lm-dim 256]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Any, Dict, List, Optional

import torch

from . import common
from .common import fmt_bytes, fmt_time, log


def _lengths(spec: str) -> List[int]:
    out: List[int] = []
    for part in spec.split(","):
        n, _, times = part.partition("x")
        out += [int(n)] * (int(times) if times else 1)
    return out


#: the exactness row: 4,000 short documents and one long one, 65,536 tokens
ERRORS_LENGTHS = "1,3,8,12,17,24x4000+65536"


def error_lengths(spec: str, seed: int = 0) -> List[int]:
    """``A,B,...xCOUNT+TOTAL``: COUNT short documents drawn from the lengths A, B, ... and one long
    document making the row TOTAL tokens, placed three quarters of the way along the row (many
    short documents after it too); a plain :func:`_lengths` spec otherwise."""
    if "+" not in spec:
        return _lengths(spec)
    shorts, _, total = spec.partition("+")
    choices, _, count = shorts.rpartition("x")
    pool = [int(v) for v in choices.split(",")]
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(pool), (int(count),), generator=g).tolist()
    short = [pool[i] for i in picks]
    long_doc = int(total) - sum(short)
    if long_doc <= 0:
        raise ValueError(f"--errors-lengths {spec}: the short documents alone exceed {total} tokens")
    at = 3 * len(short) // 4
    return short[:at] + [long_doc] + short[at:]


def separate(fn, w: torch.Tensor, lengths: List[int]):
    """``fn`` on each document of the packed row ``w`` (1, H, total, p) alone, the results in packed
    order (differentiable in ``w``). Documents of one length run as one batch (B, H, L, p) without a
    mask: a batch's rows are independent sequences. ``fn`` maps (B, H, L, p) to a tuple of tensors
    (B, H, L, ...)."""
    starts = [0, *itertools.accumulate(lengths)][:-1]
    by_length: Dict[int, List[int]] = {}
    for start, n in zip(starts, lengths):
        if n:
            by_length.setdefault(n, []).append(start)
    pieces, tokens = [], []
    for n, first in by_length.items():
        index = (torch.tensor(first)[:, None] + torch.arange(n)).to(w.device)  # (k, n)
        outs = fn(w[0][:, index].transpose(0, 1))  # (k, H, n, ...) each
        pieces.append([o.transpose(0, 1).flatten(1, 2) for o in outs])  # (H, k * n, ...)
        tokens.append(index.reshape(-1))
    order = torch.empty(sum(lengths), dtype=torch.long, device=w.device)
    order[torch.cat(tokens)] = torch.arange(order.numel(), device=w.device)
    return tuple(torch.cat(parts, dim=1).index_select(1, order).unsqueeze(0) for parts in zip(*pieces))


def packed_errors(op: str, lengths: List[int], dtype: torch.dtype, heads: int = 2, p: int = 16,
                  seed: int = 0) -> Dict[str, Dict[str, float]]:
    """Errors of ``op`` (``"causal_tssa"`` or ``"tssa"``) on one packed row of documents of
    ``lengths`` in ``dtype``: {"packed": {...}, "separate": {...}}, each mapping out, pi, grad_w,
    grad_temp (and grad_pos_bias) to the largest absolute error relative to the largest magnitude
    of the float64 separate runs. Uses the backend the environment selects."""
    from whiteformer.ops import causal_tssa, tssa

    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    w = torch.randn(1, heads, total, p, generator=g, dtype=torch.float64)
    temp = torch.rand(heads, 1, generator=g, dtype=torch.float64) + 0.5
    args = [temp]
    if op == "causal_tssa":
        args.append(0.3 * torch.randn(heads, max(lengths), 1, generator=g, dtype=torch.float64))
    cot_out = torch.randn(1, heads, total, p, generator=g, dtype=torch.float64)
    cot_pi = torch.randn(1, heads, total, generator=g, dtype=torch.float64)
    names = ["out", "pi", "grad_w", "grad_temp"] + (["grad_pos_bias"] if op == "causal_tssa" else [])

    def run(packed: bool, dt: torch.dtype) -> List[torch.Tensor]:
        leaves = [t.to(dt).requires_grad_() for t in (w, *args)]
        fn = causal_tssa if op == "causal_tssa" else tssa
        if packed:
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            out, pi = fn(leaves[0], *leaves[1:], return_pi=True, cu_seqlens=cu)
        else:
            out, pi = separate(lambda x: fn(x, *leaves[1:], return_pi=True), leaves[0], lengths)
        loss = (out.double() * cot_out).sum() + (pi.double() * cot_pi).sum()
        return [t.detach().double() for t in (out, pi, *torch.autograd.grad(loss, leaves))]

    ref = run(False, torch.float64)

    def errors(res: List[torch.Tensor]) -> Dict[str, float]:
        return {k: float((a - b).abs().max() / b.abs().max().clamp_min(1e-300)) for k, a, b in zip(names, res, ref)}

    return dict(packed=errors(run(True, dtype)), separate=errors(run(False, dtype)))


def error_cell(op: str, backend: str, lengths: List[int], dtype: str, heads: int, p: int) -> Dict[str, Any]:
    """:func:`packed_errors` on ``backend`` (``torch`` or ``cpu``), alone in this process."""
    os.environ["WHITEFORMER_BACKEND"] = backend
    common.setup_torch(None)
    return dict(op=op, backend=backend, dtype=dtype,
                **packed_errors(op, lengths, getattr(torch, dtype), heads=heads, p=p))


def error_table(rows: List[Dict[str, Any]]) -> str:
    body = []
    for r in rows:
        for k in r["packed"]:
            body.append([r["op"], r["backend"], r["dtype"], k, f"{r['packed'][k]:.2e}", f"{r['separate'][k]:.2e}"])
    return common.markdown_table(["op", "backend", "dtype", "quantity", "packed error", "separate error"], body)


def cell(op: str, route: str, lengths: List[int], heads: int, p: int) -> Dict[str, Any]:
    """Peak memory and time of one forward + backward of ``op`` by ``route``, alone in this process."""
    os.environ["WHITEFORMER_BACKEND"] = "cpu" if route == "C++ kernel (padded)" else "torch"
    common.setup_torch(None)
    from whiteformer.ops import causal_tssa, layout, tssa
    from whiteformer.ops.layout import TokenLayout, from_padded, to_padded

    if route == "C++ kernel (padded)":  # the kernel on the padded layout, however much it pads
        layout.PADDED_WASTE_MAX = float("inf")
    fn = causal_tssa if op == "causal_tssa" else tssa
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    w = torch.randn(1, heads, sum(lengths), p, requires_grad=True)
    temp = torch.ones(heads, 1)

    def run():
        if route != "padded":
            out = fn(w, temp, cu_seqlens=cu)
        else:
            pk = TokenLayout.of(w, cu_seqlens=cu, token_dim=2, name="w").packing
            out = from_padded(fn(to_padded(w, pk), temp, attn_mask=pk.mask), pk)
        out.square().sum().backward()

    run()  # warm-up
    w.grad = None
    with common.PeakMemory("cpu") as pm:
        t = common.time_call(run, "cpu")
    return dict(op=op, route=route, peak_bytes=pm.delta, mem_method=pm.method, time_s=t)


def table(result: Dict[str, Any]) -> str:
    body = [[r["op"], r["route"], fmt_bytes(r["peak_bytes"]), fmt_time(r["time_s"])] for r in result["rows"]]
    return common.markdown_table(["op", "route", "peak memory", "forward + backward"], body)


def section(result: Optional[Dict[str, Any]]) -> List[str]:
    """The docs/benchmarks.md section (:mod:`benchmarks.report`)."""
    out = ["## Packed documents (cu_seqlens): native path against the padded layout", ""]
    if not result:
        return out + ["Not run yet: `python -m benchmarks.packed_varlen --kernel`.", ""]
    lengths = _lengths(result["lengths"])
    return out + [
        f"One forward + backward (float32) of `causal_tssa` and `tssa` on one packed row of {len(lengths)} "
        f"documents (lengths {result['lengths']}: {sum(lengths)} tokens, {len(lengths) * max(lengths)} slots in "
        f"the padded layout), H = {result['heads']}, p = {result['p']}. \"padded\": the former PyTorch route "
        "(documents laid out as (S, H, L, p) with a mask); \"native\": per-document sums and prefix sums on the "
        "packed tokens; \"C++ kernel (padded)\": the fused CPU kernel on the padded layout. Peak memory: a "
        "separate process per cell, RSS high-water mark minus RSS before; time: that one call "
        f"({result['machine']['logical_cpus']} shared CPUs, load {result['machine']['loadavg'][0]:.1f}).",
        "",
        "```",
        result.get("command") or "python -m benchmarks.packed_varlen --kernel",
        "```",
        "",
        table(result),
        "",
        "Hence the fused kernels keep the padded layout only while it has at most `PADDED_WASTE_MAX` (2) times "
        "the packed tokens (`whiteformer.ops.layout`); not measured on GPU.",
        "",
    ] + _errors_section(result.get("errors"))


def _errors_section(errors: Optional[Dict[str, Any]]) -> List[str]:
    if not errors:
        return []
    return [
        "### Packed against separate",
        "",
        f"One packed row of {errors['documents']} documents ({errors['tokens']} tokens; spec `{errors['lengths']}`: "
        "short documents drawn from those lengths and one long one), H = "
        f"{errors['heads']}, p = {errors['p']}, against each document run alone: the largest error relative to "
        "the largest magnitude of the float64 separate runs, forward and gradients (of a random linear function "
        "of out and Pi). In float32, \"separate\" is the separate runs' own error against float64; the packed "
        "row should be within 4x of it. In float64 the packed row is compared with the separate runs directly.",
        "",
        error_table(errors["rows"]),
        "",
    ]


#: the host reads counted by the language-model row (tensor methods and conversions to Python)
HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def lm_cell(name: str, documents: int, depth: int, dim: int, heads: int, seed: int = 0) -> Dict[str, Any]:
    """One packed forward of ``name`` (``tost_lm_base`` / ``gpt_base`` at these sizes): its time and
    host reads, alone in this process."""
    os.environ["WHITEFORMER_BACKEND"] = "torch"
    common.setup_torch(None)
    from torch.overrides import TorchFunctionMode

    from whiteformer.models import create_model

    class Reads(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.count += getattr(func, "__name__", "") in HOST_READS
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 33, (documents,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    idx = torch.randint(0, 1024, (1, int(cu[-1])), generator=g)
    model = create_model(name, vocab_size=1024, dim=dim, depth=depth, num_heads=heads, max_len=64).eval()

    def run():
        with torch.no_grad():
            model(idx, cu_seqlens=cu)

    first = common.time_call(run)
    with Reads() as reads:
        run()
    return dict(model=name, documents=documents, tokens=int(cu[-1]), depth=depth, dim=dim, heads=heads,
                host_reads=reads.count, **common.repeat_runs(run, first, repeats=7, budget_s=60.0))


def lm_table(result: Dict[str, Any]) -> str:
    body = [[label, r["model"], r["depth"], r["documents"], r["tokens"], r["host_reads"], fmt_time(r["time_s"])]
            for label, rows in result["runs"].items() for r in rows]
    return common.markdown_table(["library", "model", "depth", "documents", "tokens", "host reads", "forward"], body)


def lm_section(result: Optional[Dict[str, Any]]) -> List[str]:
    """The docs/benchmarks.md section of the language-model row (:mod:`benchmarks.report`)."""
    out = ["## Packed documents through a language model: the token layout built once", ""]
    if not result:
        return out + ["Not run yet: `python -m benchmarks.packed_varlen --lm after` (see its docstring).", ""]
    machine = result["machine"]
    first = next(iter(result["runs"].values()))[0]
    reads = "; ".join(f"{label}: {', '.join(str(r['host_reads']) for r in rows)}"
                      for label, rows in result["runs"].items())
    return out + [
        f"One forward (no gradients, float32, the PyTorch path) of a {first['depth']}-layer ToST LM and its GPT "
        f"baseline (D {first['dim']}, {first['heads']} heads) on one packed row of {first['documents']:,} documents "
        "of 1-32 tokens, with the library before and after the token layout "
        "(`whiteformer.ops.TokenLayout`: `cu_seqlens` validated and read once per forward, the padded layout "
        "and the segments built once, handed to every block). Host reads: `.tolist()`, `.item()`, `.cpu()` and "
        "tensors turned into Python numbers during the forward, each a stream synchronisation on a GPU; time: "
        f"the median of the runs that fit the budget ({machine['logical_cpus']} shared CPUs, load "
        f"{machine['loadavg'][0]:.1f}, so differences within noise are not meaningful).",
        "",
        "```",
        *result.get("commands", {}).values(),
        "```",
        "",
        "(each with that library's `src` first on `PYTHONPATH`: the same script measures any checkout).",
        "",
        lm_table(result),
        "",
        f"Host reads per forward ({reads}): with the layout they no longer grow with the depth (the token ids' "
        "range and `cu_seqlens`, once each). On the CPU a host read costs little, so the time does not move "
        "beyond the noise. Not measured on GPU.",
        "",
    ]


def lm_main(args) -> int:
    """The language-model row under ``args.lm`` in results/packed_lm.json (the other labels kept)."""
    import json

    path = common.RESULTS_DIR / "packed_lm.json"
    result = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    rows = [common.run_isolated(lm_cell, name, args.lm_documents, args.lm_depth, args.lm_dim, args.lm_heads,
                                timeout=1800) for name in ("tost_lm_base", "gpt_base")]
    result["runs"][args.lm] = rows
    result["machine"] = common.machine_info("cpu")
    result.setdefault("commands", {})[args.lm] = common.command_string("benchmarks.packed_varlen", sys.argv[1:])
    print(lm_table(result))
    common.write_json(path, result)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lm", metavar="LABEL", help="only the language-model row, saved under LABEL (see above)")
    ap.add_argument("--lm-documents", type=int, default=1000)
    ap.add_argument("--lm-depth", type=int, default=12)
    ap.add_argument("--lm-dim", type=int, default=256)
    ap.add_argument("--lm-heads", type=int, default=4)
    ap.add_argument("--lengths", default="4096,8x100", help="document lengths, N or NxCOUNT, comma-separated")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--p", type=int, default=64)
    ap.add_argument("--kernel", action="store_true", help="also the C++ CPU kernel's route (its padded layout)")
    ap.add_argument("--errors-lengths", default=ERRORS_LENGTHS,
                    help="the exactness row: A,B,...xCOUNT+TOTAL (COUNT documents of lengths drawn from A, B, ... "
                         "and one long one, TOTAL tokens) or a --lengths spec; '' skips it")
    ap.add_argument("--errors-heads", type=int, default=2)
    ap.add_argument("--errors-p", type=int, default=16)
    args = ap.parse_args(argv)
    if args.lm:
        return lm_main(args)
    lengths = _lengths(args.lengths)
    log(f"packed_varlen: {len(lengths)} documents, {sum(lengths)} tokens, padded layout "
        f"{len(lengths) * max(lengths)} slots, H={args.heads}, p={args.p}")
    routes = ["padded", "native"]
    if args.kernel:
        routes.append("C++ kernel (padded)")
    rows = [common.run_isolated(cell, op, route, lengths, args.heads, args.p, timeout=1800)
            for op in ("causal_tssa", "tssa") for route in routes]
    result = dict(lengths=args.lengths, heads=args.heads, p=args.p, rows=rows, machine=common.machine_info("cpu"),
                  command=common.command_string("benchmarks.packed_varlen", sys.argv[1:] if argv is None else argv))
    print(table(result))
    if args.errors_lengths:
        exact = error_lengths(args.errors_lengths)
        log(f"packed_varlen errors: {len(exact)} documents, {sum(exact)} tokens")
        backends = ["torch"] + (["cpu"] if args.kernel else [])
        result["errors"] = dict(
            lengths=args.errors_lengths, documents=len(exact), tokens=sum(exact), heads=args.errors_heads,
            p=args.errors_p,
            rows=[common.run_isolated(error_cell, op, backend, exact, dtype, args.errors_heads, args.errors_p,
                                      timeout=1800)
                  for op in ("causal_tssa", "tssa") for backend in backends for dtype in ("float64", "float32")])
        print(error_table(result["errors"]["rows"]))
    common.write_json(common.RESULTS_DIR / "packed_varlen.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
