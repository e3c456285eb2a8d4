"""Part (b) of the GPU check, through :mod:`benchmarks.gpu`: each op as a multiple of
``w.clone()`` (Triton, PyTorch path, ``torch.compile``), and the 12-layer stacks (TSSA on both
paths, MHSA through SDPA) over the token counts, time and peak memory. One implementation or
stack method at a time, saved as it finishes."""
from __future__ import annotations

import argparse
from typing import Any, Dict

from .. import gpu


def _args(cfg: Dict[str, Any]) -> argparse.Namespace:
    return argparse.Namespace(**cfg["ops_args"])


def run_ops(cfg: Dict[str, Any], rec) -> None:
    args = _args(cfg)
    rec.set(config=cfg["ops_args"], targets=cfg["targets"])
    for impl in gpu.IMPLS:
        if impl in cfg["skip_impls"]:
            rec.add({"impl": impl, "status": f"skipped: {cfg['skip_impls'][impl]}"})
            continue
        rec.add(gpu.bench_ops(args, gpu.DTYPES[args.dtype], cfg["device"], [impl])[0])


def run_stack(cfg: Dict[str, Any], rec) -> None:
    args = _args(cfg)
    rec.set(config={k: cfg["ops_args"][k] for k in ("heads", "head_dim", "depth", "stack_n", "dtype")})
    for label in gpu.STACK_METHODS:
        for row in gpu.bench_stack(args, gpu.DTYPES[args.dtype], cfg["device"], [label]):
            rec.add(row)
