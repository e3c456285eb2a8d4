"""Kernel backends of the TSSA operators (``tssa``, ``causal_tssa``, ``causal_tssa_step``): the
one place that decides which implementation runs.

Order of choice, at every call (eager; fixed when a graph is compiled):

1. ``WHITEFORMER_DISABLE_KERNELS=1`` (or ``WHITEFORMER_BACKEND=torch``): the PyTorch path
   (:mod:`whiteformer.ops.tssa.parallel`, :mod:`whiteformer.ops.causal_tssa.parallel`).
2. ``WHITEFORMER_BACKEND=<name>``: the kernels of the backend registered under that name, on
   any device (e.g. ``triton`` on CPU tensors with ``TRITON_INTERPRET=1``), for the ops it
   provides and the dtypes it declares; an unknown name raises ``ValueError``, an unavailable
   backend warns once and the choice goes on.
3. The backend registered for the tensor's device type and dtype: its ``kernels[op]`` if it has
   one, else the custom ops of :mod:`.fused` (``whiteformer::tssa_fused_fwd`` ...), which torch
   dispatches by device to the kernel registered on them.
4. Otherwise (dropout in training, other dtypes/devices, build failed): the PyTorch path.

Registered here: ``"cpu"`` (float32/float64), the C++/OpenMP extension ``tssa_cpu.cpp`` built
by :mod:`.build` and registered on the custom ops in :mod:`.fused` (no fused step: the step is a
handful of O(B H p) ops), and ``"cuda"`` named ``triton`` (float16/bfloat16/float32/float64), the
Triton kernels of :mod:`.triton` for all three ops (also on CPU tensors through Triton's
interpreter with ``WHITEFORMER_BACKEND=triton`` and ``TRITON_INTERPRET=1``).

**Adding a backend** (e.g. Triton on CUDA)::

    register_backend("cuda", (torch.float16, torch.bfloat16, torch.float32), triton_available,
                     name="triton", kernels={"tssa": ..., "causal_tssa": ..., "causal_tssa_step": ...})

with the kernel signatures (inputs validated and on one device; outputs differentiable with
respect to w, temp and logit_bias; sums in float32 or wider)::

    tssa(w, temp, attn_mask) -> (out, pi)
        w (B, H, N, p), temp (H, 1), attn_mask (B, N) bool or None; out like w, pi (B, H, N)
    causal_tssa(w, temp, logit_bias, attn_mask) -> (out, pi, sum_sq, sum_pi, sum_sq_pi)
        logit_bias (H, N) or (B, H, N) or None (``p * pos_bias`` at each token's position);
        the final sums have shapes (B, H, p), (B, H), (B, H, p)
    causal_tssa_step(w_t, sum_sq, sum_pi, sum_sq_pi, temp, logit_bias) -> (out_t, pi_t, sums...)
        w_t (B, H, p), the sums of the earlier tokens, logit_bias (H, 1) or (B, H, 1) or None

The reference semantics are the PyTorch paths named in 1 (and the literal formulas in
:mod:`whiteformer.ops.reference`); the numerical constants are in :mod:`whiteformer.ops.constants`.
Instead of ``kernels``, a backend may register device kernels on the custom ops of :mod:`.fused`
(``_tssa_fwd.register_kernel("cuda")`` ...) and call ``register_backend`` without ``kernels``.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

__all__ = ["BACKENDS", "ENV_BACKEND", "ENV_DISABLE", "OPS", "Backend", "fused_supported", "kernel_for",
           "kernels_disabled", "register_backend"]

ENV_DISABLE = "WHITEFORMER_DISABLE_KERNELS"
ENV_BACKEND = "WHITEFORMER_BACKEND"
OPS = ("tssa", "causal_tssa", "causal_tssa_step")


@dataclass
class Backend:
    """Kernels for one device type: ``dtypes`` they accept, ``available()`` (cheap after the
    first call: e.g. a one-time build or import), an optional ``name`` for
    ``WHITEFORMER_BACKEND`` and the ``kernels`` by op name (see the module docstring)."""

    device_type: str
    dtypes: tuple
    available: Callable[[], bool]
    name: Optional[str] = None
    kernels: Dict[str, Callable] = field(default_factory=dict)


def _cpu_ready() -> bool:
    from .build import fast_path_available

    return fast_path_available()


BACKENDS: Dict[str, Backend] = {"cpu": Backend("cpu", (torch.float32, torch.float64), _cpu_ready, name="cpu")}


def register_backend(device_type: str, dtypes: tuple, available: Callable[[], bool], *,
                     name: Optional[str] = None, kernels: Optional[Dict[str, Callable]] = None) -> Backend:
    """Declare kernels for ``device_type`` and ``dtypes`` (replaces an earlier entry for that
    device type). ``kernels`` maps op names (:data:`OPS`) to implementations; without it, the
    custom ops of :mod:`.fused` must have kernels registered for ``device_type``."""
    unknown = set(kernels or ()) - set(OPS)
    if unknown:
        raise ValueError(f"kernels has unknown op names {sorted(unknown)}; expected some of {OPS}")
    backend = Backend(device_type, tuple(dtypes), available, name, dict(kernels or {}))
    BACKENDS[device_type] = backend
    return backend


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def kernels_disabled() -> bool:
    """True when ``WHITEFORMER_DISABLE_KERNELS`` is set to anything but ``""``/``0``/``false``/``no``/``off``,
    or ``WHITEFORMER_BACKEND=torch``."""
    return _env_flag(ENV_DISABLE) or os.environ.get(ENV_BACKEND, "").strip().lower() == "torch"


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
    entry = BACKENDS.get(device_type)
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
    entry = BACKENDS.get(w.device.type)
    if entry is None or op not in entry.kernels or w.dtype not in entry.dtypes:
        return None
    return entry.kernels[op] if _backend_ready(w.device.type) else None


def fused_supported(w: torch.Tensor) -> bool:
    """Whether the custom ops of :mod:`.fused` can run on ``w``: a backend without ``kernels``
    is registered for its device type and dtype, is available, and kernels are not disabled."""
    entry = BACKENDS.get(w.device.type)
    if entry is None or entry.kernels or w.dtype not in entry.dtypes:
        return False
    return _backend_ready(w.device.type)


# the Triton kernels (CUDA; any device with WHITEFORMER_BACKEND=triton); importing triton is deferred
from .triton import register as _register_triton  # noqa: E402

_register_triton()
