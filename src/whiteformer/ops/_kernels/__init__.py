"""Fused-kernel backends for the TSSA operators, chosen by device type.

``BACKENDS`` maps a device type to a predicate "can the fused op run on this tensor?".
Only ``"cpu"`` is registered (the C++/OpenMP extension of :mod:`.cpu`, float32/float64); any
other device (CUDA, ...) uses the pure-PyTorch path. A GPU kernel is added later by
registering a device implementation of the custom ops in :mod:`whiteformer.ops.tssa_fused`
(``op.register_kernel("cuda")``) and a predicate here, without touching the callers.

Set the environment variable ``WHITEFORMER_DISABLE_KERNELS=1`` to force the pure-PyTorch path
(read at each call in eager mode; fixed when a graph is compiled).
"""
from __future__ import annotations

import os
from typing import Callable, Dict

import torch

__all__ = ["BACKENDS", "kernels_disabled", "register_backend", "fused_supported"]

ENV_DISABLE = "WHITEFORMER_DISABLE_KERNELS"


def kernels_disabled() -> bool:
    """True when ``WHITEFORMER_DISABLE_KERNELS`` is set to anything but ``""``/``0``/``false``/``no``."""
    return os.environ.get(ENV_DISABLE, "").strip().lower() not in ("", "0", "false", "no", "off")


def _cpu_ready() -> bool:
    from .cpu import fast_path_available

    return fast_path_available()


# device type -> (supported dtypes, availability check without arguments)
BACKENDS: Dict[str, tuple] = {"cpu": ((torch.float32, torch.float64), _cpu_ready)}


def register_backend(device_type: str, dtypes: tuple, available: Callable[[], bool]) -> None:
    """Declare that the fused ops have an implementation for ``device_type`` and ``dtypes``."""
    BACKENDS[device_type] = (tuple(dtypes), available)


@torch.compiler.assume_constant_result
def _backend_ready(device_type: str) -> bool:
    # evaluated eagerly (also while tracing a compiled graph): env var + one-time build
    entry = BACKENDS.get(device_type)
    return entry is not None and not kernels_disabled() and bool(entry[1]())


def fused_supported(w: torch.Tensor) -> bool:
    """Whether the fused TSSA ops can run on ``w`` (device type and dtype, kernel built)."""
    entry = BACKENDS.get(w.device.type)
    if entry is None or w.dtype not in entry[0]:
        return False
    return _backend_ready(w.device.type)
