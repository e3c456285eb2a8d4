"""The kernel-backend registry: :class:`Backend`, :data:`BACKENDS`, :func:`register_backend`, the
environment switches (``WHITEFORMER_DISABLE_KERNELS``, ``WHITEFORMER_BACKEND``), the export switch
(:func:`exporting`) and the choice of a kernel at each call (:func:`kernel_for`, :func:`fused_supported`). It imports no backend: the
plug (:mod:`whiteformer.ops._kernels`, whose docstring describes the order of choice and the
kernel signatures), the C++ build and the Triton package all import it, never each other.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch
import torch.onnx

from ..._registry import Registry

try:  # the dynamo ONNX exporter's state (a private module: absent from some torch versions)
    from torch.onnx._internal.exporter import _flags as _onnx_flags
except ImportError:  # pragma: no cover - depends on the torch version
    _onnx_flags = None
try:  # the TorchScript exporter's state, read by torch.onnx.is_in_onnx_export (which imports it per call)
    from torch.onnx._internal.torchscript_exporter._globals import GLOBALS as _onnx_globals
except ImportError:  # pragma: no cover - depends on the torch version
    _onnx_globals = None

__all__ = ["BACKENDS", "ENV_BACKEND", "ENV_DISABLE", "OPS", "Backend", "exporting", "fused_supported", "has_kernel",
           "kernel_for", "kernels_disabled", "register_backend"]

ENV_DISABLE = "WHITEFORMER_DISABLE_KERNELS"
ENV_BACKEND = "WHITEFORMER_BACKEND"
OPS = ("tssa", "causal_tssa", "causal_tssa_step")


@dataclass
class Backend:
    """Kernels for one device type: ``dtypes`` they accept, ``available()`` (cheap after the
    first call: e.g. a one-time build or import), an optional ``name`` for
    ``WHITEFORMER_BACKEND`` and the ``kernels`` by op name (see :mod:`whiteformer.ops._kernels`)."""

    device_type: str
    dtypes: tuple
    available: Callable[[], bool]
    name: Optional[str] = None
    kernels: Dict[str, Callable] = field(default_factory=dict)


#: the registered backends by device type (filled by :mod:`whiteformer.ops._kernels` at import)
BACKENDS = Registry("kernel backend", replace=True)  # device type -> Backend (a new one replaces)


def register_backend(device_type: str, dtypes: tuple, available: Callable[[], bool], *,
                     name: Optional[str] = None, kernels: Optional[Dict[str, Callable]] = None) -> Backend:
    """Declare kernels for ``device_type`` and ``dtypes`` (replaces an earlier entry for that
    device type). ``kernels`` maps op names (:data:`OPS`) to implementations; without it, the
    custom ops of :mod:`.fused` must have kernels registered for ``device_type``."""
    unknown = set(kernels or ()) - set(OPS)
    if unknown:
        raise ValueError(f"kernels has unknown op names {sorted(unknown)}; expected some of {OPS}")
    backend = Backend(device_type, tuple(dtypes), available, name, dict(kernels or {}))
    BACKENDS.register(device_type, backend, name=name)
    return backend


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def exporting() -> bool:
    """True while a graph is being exported: ``torch.export`` (also under ``torch.onnx.export(...,
    dynamo=True)``) or the TorchScript-based ``torch.onnx.export``. The ops then take their PyTorch
    path, so an exported program holds standard operators only: ONNX needs no custom-op
    translation, and a saved ``.pt2`` loads and runs where whiteformer is not installed."""
    return torch.compiler.is_exporting() or onnx_exporting()


def onnx_exporting() -> bool:
    """True while ``torch.onnx.export`` runs (either exporter): for the operations that ONNX has no
    operator for (e.g. a Cholesky factorisation), which ``torch.export`` keeps."""
    if not torch.compiler.is_dynamo_compiling():
        if _onnx_globals is not None and _onnx_flags is not None:  # what is_in_onnx_export reads, without
            return bool(_onnx_globals.in_onnx_export or _onnx_flags._is_onnx_exporting)  # its imports
        return torch.onnx.is_in_onnx_export()
    # Dynamo folds is_in_onnx_export() to False while it traces (the strict torch.export capture that
    # torch.onnx.export(dynamo=True) falls back to): read the flag of the dynamo exporter instead, from
    # the module imported with this one (a lookup in sys.modules would be a guard that the first
    # compile, importing that module while it traces, breaks)
    return bool(getattr(_onnx_flags, "_is_onnx_exporting", False))


def kernels_disabled() -> bool:
    """True when ``WHITEFORMER_DISABLE_KERNELS`` is set to anything but ``""``/``0``/``false``/``no``/``off``,
    or ``WHITEFORMER_BACKEND=torch``, or while a graph is being exported (:func:`exporting`)."""
    return (_env_flag(ENV_DISABLE) or os.environ.get(ENV_BACKEND, "").strip().lower() == "torch"
            or exporting())


_warned = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


@torch.compiler.assume_constant_result
def _forced_name() -> str:
    return os.environ.get(ENV_BACKEND, "").strip().lower()


@torch.compiler.assume_constant_result
def _backend_ready(device_type: str) -> bool:
    # evaluated eagerly (also while tracing a compiled graph): env var + one-time build
    entry = BACKENDS.get(device_type, None)
    return entry is not None and not kernels_disabled() and bool(entry.available())


def _forced_backend() -> Optional[Backend]:
    name = _forced_name()
    if name in ("", "auto", "torch"):
        return None
    for backend in BACKENDS.values():
        if backend.name == name:
            return backend
    known = sorted(b.name for b in BACKENDS.values() if b.name)
    raise ValueError(f"{ENV_BACKEND}={name!r} names no registered kernel backend; known: "
                     f"{', '.join(['auto', 'torch', *known])}")


def kernel_for(op: str, w: torch.Tensor) -> Optional[Callable]:
    """The registered kernel (a backend's ``kernels[op]``) that runs ``op`` on ``w``, or None
    (then: the custom ops of :mod:`.fused` if :func:`fused_supported`, else the PyTorch path)."""
    name = _forced_name()
    entry = BACKENDS.get(w.device.type, None)
    if name in ("", "auto") and (entry is None or op not in entry.kernels):
        return None  # no registered kernel to choose from: the switches need not be read
    if kernels_disabled():
        return None
    forced = _forced_backend()
    if forced is not None and op in forced.kernels:
        if w.dtype not in forced.dtypes:
            _warn_once(f"whiteformer: {ENV_BACKEND}={forced.name} has no {op} kernel for {w.dtype}; "
                       "using the default kernel choice")
        elif not forced.available():
            _warn_once(f"whiteformer: {ENV_BACKEND}={forced.name} is not available on this machine; "
                       "using the default kernel choice")
        else:
            return forced.kernels[op]
    if entry is None or op not in entry.kernels or w.dtype not in entry.dtypes:
        return None
    return entry.kernels[op] if _backend_ready(w.device.type) else None


def fused_supported(w: torch.Tensor) -> bool:
    """Whether the custom ops of :mod:`.fused` can run on ``w``: a backend without ``kernels``
    is registered for its device type and dtype, is available, and kernels are not disabled."""
    entry = BACKENDS.get(w.device.type, None)
    if entry is None or entry.kernels or w.dtype not in entry.dtypes:
        return False
    return _backend_ready(w.device.type)



def has_kernel(op: str, w: torch.Tensor, pytorch_only=False) -> bool:
    """Whether ``op`` on ``w`` runs a kernel (:func:`kernel_for` or the custom ops of :mod:`.fused`)
    rather than the PyTorch path; ``pytorch_only`` truthy (dropout, an option the kernels lack)
    forces the PyTorch path."""
    return not pytorch_only and (kernel_for(op, w) is not None or fused_supported(w))
