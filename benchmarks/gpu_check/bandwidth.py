"""Part (e) of the GPU check: the device's copy bandwidth, and the traffic model of the Triton
kernels at the operator benchmark's shape.

Copy bandwidth: ``x.clone()`` of a large tensor moves ``2 * bytes(x)`` (one read, one write);
the best of the medians over a few sizes. The model (:func:`benchmarks.gpu.op_model_bytes`) gives
the bytes each op moves forward and backward; with the op's measured time (part "ops") the
summary reports the achieved bandwidth (modelled bytes / time) as a percentage of the copy
bandwidth, next to the model's prediction of the op's time in units of ``w.clone()``
(modelled bytes / ``2 * bytes(w)``)."""
from __future__ import annotations

import statistics
from typing import Any, Dict

import torch

from .. import gpu
from .record import describe

FULL_COPY_MIB = [256, 1024, 4096]
DRY_COPY_MIB = [1, 4]


def copy_bandwidth(device: str, sizes_mib, repeats: int) -> Dict[str, Any]:
    rows = []
    for mib in sizes_mib:
        x = torch.empty(mib * 2**20 // 2, dtype=torch.bfloat16, device=device).normal_()
        x.clone()
        t = statistics.median(gpu.cuda_time(lambda x=x: x.clone(), device) for _ in range(repeats))
        rows.append({"mib": mib, "time_s": t, "bytes_per_s": 2 * x.nbytes / t})
        del x
        gpu.empty_cache(device)
    return {"sizes": rows, "bytes_per_s": max(r["bytes_per_s"] for r in rows)}


def run(cfg: Dict[str, Any], rec) -> None:
    device, dry = cfg["device"], cfg["dry_run"]
    rec.set(copy=copy_bandwidth(device, DRY_COPY_MIB if dry else FULL_COPY_MIB, 3 if dry else 20))
    a = cfg["ops_args"]
    for op in ("tssa", "causal_tssa"):
        row: Dict[str, Any] = {"op": op, **{k: a[k] for k in ("batch", "heads", "n", "head_dim", "dtype")}}
        try:
            row.update(gpu.op_model_bytes(op, batch=a["batch"], heads=a["heads"], n=a["n"], head_dim=a["head_dim"],
                                          dtype=gpu.DTYPES[a["dtype"]]))
            row["w_bytes"] = a["batch"] * a["heads"] * a["n"] * a["head_dim"] * gpu.DTYPES[a["dtype"]].itemsize
        except Exception as e:  # noqa: BLE001 - e.g. triton missing: the copy bandwidth still stands
            row["status"] = f"failed: {describe(e)}"
        rec.add(row)
