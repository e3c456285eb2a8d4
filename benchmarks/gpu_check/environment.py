"""Part "env" of the GPU check: what it runs on (versions of torch, Triton, transformers,
flash-linear-attention; the GPU; where each package was imported from)."""
from __future__ import annotations

import importlib
import platform
import sys
from typing import Any, Dict

from .record import describe

PACKAGES = ("torch", "triton", "transformers", "fla", "entmax", "einops", "tensorly", "whiteformer")


def run(cfg: Dict[str, Any], rec) -> None:
    import torch

    packages: Dict[str, Any] = {}
    for name in PACKAGES:
        try:
            mod = importlib.import_module(name)
            packages[name] = {"version": getattr(mod, "__version__", "?"), "file": getattr(mod, "__file__", None)}
        except Exception as e:  # noqa: BLE001 - a missing or broken package is a fact to record
            packages[name] = {"missing": describe(e)}
    info: Dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(), "packages": packages,
                            "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory,
                    capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count)
    from whiteformer.ops._kernels.triton import triton_available

    info["triton_backend_available"] = triton_available()
    rec.set(**info)
