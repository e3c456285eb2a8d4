"""Activation checkpointing of the language models: peak memory and time of one training step with
and without ``model.set_grad_checkpointing(True)``.

One training step (forward with the next-token loss + backward, batch 1) of ``tost_lm_base`` and
``gpt_base`` (SDPA) at each context, without a length limit (``pos_emb=False``; ToST also
``pos_bias=False``), with the chunked loss (``loss_chunk``: the (T, vocabulary) logits are never
formed whole, so the blocks' activations are what is left to save). Each cell runs in a
**separate** process: peak memory is the RSS high-water mark of the step minus the RSS before it
(``benchmarks.common.PeakMemory``: weights excluded; gradients, saved activations and the
temporaries of forward and backward included), time is that one step's wall time. Usage::

    python -m benchmarks.grad_checkpointing [--quick] [--contexts 4096] [--models tost,gpt_sdpa]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from . import common
from .common import fmt_bytes, fmt_time, fmt_tokens, log
from .lm_model import CONFIGS, build_model

FULL = dict(config="base", contexts=[4096], models=["tost", "gpt_sdpa"], loss_chunk=1024)
QUICK = dict(config="tiny", contexts=[256], models=["tost", "gpt_sdpa"], loss_chunk=64)


def memory_child(kind: str, plan: Dict[str, Any], T: int, checkpointing: bool, threads: Optional[int],
                 device: str) -> Dict[str, Any]:
    """Peak memory and time of one training step of one model, alone in this process."""
    common.setup_torch(threads)
    cfg = CONFIGS[plan["config"]]
    model = build_model(kind, cfg, device)
    model.set_grad_checkpointing(checkpointing)
    g = torch.Generator().manual_seed(0)

    def step(idx):
        model.zero_grad(set_to_none=True)
        model(idx, idx, loss_chunk=plan["loss_chunk"])[1].backward()

    step(torch.randint(0, cfg["vocab_size"], (1, 16), generator=g).to(device))  # warm-up
    model.zero_grad(set_to_none=True)
    idx = torch.randint(0, cfg["vocab_size"], (1, T), generator=g).to(device)
    with common.PeakMemory(device) as pm:
        t = common.time_call(lambda: step(idx), device)
    return dict(model=kind, context=T, checkpointing=checkpointing, peak_bytes=pm.delta, mem_method=pm.method,
                time_s=t, param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))


def tables(result: Dict[str, Any]) -> str:
    plan, rows = result["plan"], result["rows"]
    cfg = CONFIGS[plan["config"]]
    by = {(r["model"], r["context"], r["checkpointing"]): r for r in rows}
    body = []
    for T in plan["contexts"]:
        for k in plan["models"]:
            off, on = by.get((k, T, False)), by.get((k, T, True))
            if off is None or on is None:
                continue
            body.append([k, fmt_tokens(T), fmt_bytes(off["peak_bytes"]), fmt_bytes(on["peak_bytes"]),
                         f"{on['peak_bytes'] / off['peak_bytes']:.2f}x" if off["peak_bytes"] else "-",
                         fmt_time(off["time_s"]), fmt_time(on["time_s"]),
                         f"{on['time_s'] / off['time_s']:.2f}x"])
    head = (f"**{plan['config']}: {cfg['depth']} layers, {cfg['num_heads']} heads, D {cfg['dim']}, vocabulary "
            f"{cfg['vocab_size']}, batch 1, chunked loss ({plan['loss_chunk']} positions per chunk)**\n")
    return head + "\n" + common.markdown_table(
        ["model", "context", "peak mem. without", "peak mem. with checkpointing", "with / without",
         "step time without", "step time with", "with / without"], body) + "\n"


def run(*, quick: bool = False, out_dir: Optional[Path] = None, overrides: Optional[Dict[str, Any]] = None,
        threads: Optional[int] = None, device: str = "cpu", command: str = "", timeout: float = 3600
        ) -> Dict[str, Any]:
    plan = dict(QUICK if quick else FULL, **(overrides or {}))
    out_dir = Path(out_dir) if out_dir is not None else common.default_out_dir(quick)
    info = common.machine_info(device)
    log(f"grad_checkpointing ({'quick' if quick else 'full'}): {common.machine_string(info)}, load {info['loadavg']}")
    env = common.row_env(command, device, threads)
    rows: List[Dict[str, Any]] = []
    for T in plan["contexts"]:
        for k in plan["models"]:
            for ckpt in (False, True):
                try:
                    r = common.run_isolated(memory_child, k, plan, T, ckpt, threads, device, timeout=timeout)
                except common.ChildFailed as e:
                    log(f"  {k} T={T} checkpointing={ckpt}: failed: {str(e).splitlines()[0]}")
                    continue
                r["env"] = env
                rows.append(r)
                log(f"  {k:9s} T={fmt_tokens(T)} checkpointing={ckpt!s:5s} peak {fmt_bytes(r['peak_bytes'])} "
                    f"time {fmt_time(r['time_s'])}")
    result = {"benchmark": "grad_checkpointing", "quick": quick, "plan": plan, "machine": info, "command": command,
              "loadavg_end": common.loadavg(), "rows": rows}
    if rows:
        common.write_results(out_dir, "grad_checkpointing", quick, result, tables(result))
    return result


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m benchmarks.grad_checkpointing")
    p.add_argument("--quick", action="store_true", help="tiny model, short context (seconds)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default benchmarks/results)")
    p.add_argument("--contexts", default=None, help="comma-separated contexts, e.g. 4096")
    p.add_argument("--models", default=None, help="comma-separated subset of tost,gpt_sdpa,gpt_softmax")
    p.add_argument("--threads", default="auto", help="torch threads per measuring process, or auto")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    ov: Dict[str, Any] = {}
    if a.contexts:
        ov["contexts"] = [int(c) for c in a.contexts.split(",")]
    if a.models:
        ov["models"] = a.models.split(",")
    return run(quick=a.quick, out_dir=a.out, overrides=ov, threads=common.resolve_threads(a.threads)[0],
               device=a.device, command=common.command_string("benchmarks.grad_checkpointing", argv),
               timeout=a.timeout)


if __name__ == "__main__":
    main()
