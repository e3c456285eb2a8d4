"""Kernel backends of the TSSA operators (``tssa``, ``causal_tssa``, ``causal_tssa_step``): the
one place that decides which implementation runs.

Order of choice, at every call (eager; fixed when a graph is compiled):

1. ``WHITEFORMER_DISABLE_KERNELS=1`` (or ``WHITEFORMER_BACKEND=torch``), or a graph being exported
   (``torch.export``, ``torch.onnx.export``: :func:`~.registry.exporting`): the PyTorch path
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
    causal_tssa(w, temp, logit_bias, attn_mask) -> (out, pi, sum_sq, sum_pi, sum_sq_pi, scale)
        logit_bias (H, N) or (B, H, N) or None (``p * pos_bias`` at each token's position);
        the final sums have shapes (B, H, p), (B, H), (B, H, p), the sums of squares in units of
        scale (B, H, p), the power of two per feature of :mod:`whiteformer.ops.scaling` (a kernel that returns
        the three sums only is taken to return them in w's units, scale 1)
    causal_tssa_step(w_t, sum_sq, sum_pi, sum_sq_pi, temp, logit_bias, scale) -> (out_t, pi_t, sums..., scale)
        w_t (B, H, p), the sums of the earlier tokens in units of scale (B, H, p) (or None: 1),
        logit_bias (H, 1) or (B, H, 1) or None; the new sums in units of the new scale, the
        larger of ``scale`` and w_t's own

The reference semantics are the PyTorch paths named in 1 (and the literal formulas in
:mod:`whiteformer.ops.reference`); the numerical constants are in :mod:`whiteformer.ops.constants`.
Instead of ``kernels``, a backend may register device kernels on the custom ops of :mod:`.fused`
(``_tssa_fwd.register_kernel("cuda")`` ...) and call ``register_backend`` without ``kernels``.
"""
from __future__ import annotations

import torch

from . import build as _build
from .registry import (BACKENDS, ENV_BACKEND, ENV_DISABLE, OPS, Backend, exporting, fused_supported, has_kernel,
                       kernel_for, kernels_disabled, register_backend)

__all__ = ["BACKENDS", "ENV_BACKEND", "ENV_DISABLE", "OPS", "Backend", "exporting", "fused_supported", "has_kernel",
           "kernel_for", "kernels_disabled", "register_backend"]


def _cpu_ready() -> bool:
    # called by the backend choice after its own check of the switches (kernels_disabled): the
    # extension alone, not build.fast_path_available, which checks them again
    return _build.load_extension() is not None


register_backend("cpu", (torch.float32, torch.float64), _cpu_ready, name="cpu")

# the Triton kernels (CUDA; any device with WHITEFORMER_BACKEND=triton); importing triton is deferred
from .triton import register as _register_triton  # noqa: E402

_register_triton()
