"""Triton kernels for TSSA, causal TSSA and the causal TSSA step (the GPU path).

One module per operator: :mod:`.tssa`, :mod:`.causal_tssa`, :mod:`.causal_tssa_step`, each with
its kernels, a ``torch.library`` custom op pair (forward, backward) with a fake implementation
and a registered autograd formula, and a function with the kernel signature of
:mod:`whiteformer.ops._kernels`; the shared tile helpers are in :mod:`._tiles`.

:func:`register` declares them as the backend ``"triton"`` for CUDA tensors of float16,
bfloat16, float32 and float64 (statistics in float32, float64 for float64). Which path runs is
decided by :mod:`whiteformer.ops._kernels`:

- CUDA tensors use these kernels when ``triton`` imports, else the PyTorch path;
  ``WHITEFORMER_DISABLE_KERNELS=1`` or ``WHITEFORMER_BACKEND=torch`` forces the PyTorch path;
- ``WHITEFORMER_BACKEND=triton`` (read at each call) forces them on any device: CPU tensors then
  run through Triton's interpreter, which needs ``TRITON_INTERPRET=1`` in the environment before
  the kernels are first used (Triton reads it when a kernel is decorated, i.e. when the kernel
  modules are imported). Forced without ``triton`` installed, or on CPU without the interpreter,
  the ops raise a RuntimeError saying so.

Nothing here imports ``triton`` until a kernel runs.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch

__all__ = ["DTYPES", "register", "triton_available"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
NAME = "triton"


@functools.lru_cache(maxsize=None)
def _import_error() -> str:
    """'' when ``import triton`` works, else why not (tried once per process)."""
    if importlib.util.find_spec("triton") is None:
        return "the 'triton' package is not installed (pip install 'whiteformer[triton]')"
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken install: report it, use the PyTorch path
        return f"'import triton' failed: {type(e).__name__}: {e}"
    return ""


def _forced() -> bool:
    from ..registry import ENV_BACKEND

    return os.environ.get(ENV_BACKEND, "").strip().lower() == NAME


def triton_available() -> bool:
    """Whether the backend is offered: ``triton`` imports, or ``WHITEFORMER_BACKEND=triton``
    forces it (then a kernel that cannot run raises a clear error instead of falling back)."""
    return _forced() or not _import_error()


def _interpreted() -> bool:
    """Whether the kernels run (or, imported now, would run) in Triton's interpreter. Triton reads
    ``TRITON_INTERPRET`` when it decorates a kernel: its own library at ``import triton``, ours
    when :mod:`._tiles` and the kernel modules are imported."""
    tiles = sys.modules.get(__name__ + "._tiles")
    if tiles is not None:
        return tiles.kernels_interpreted()
    if os.environ.get("TRITON_INTERPRET", "").strip().lower() not in ("1", "true", "on", "yes"):
        return False
    if "triton" in sys.modules:  # imported before the variable was set?
        import triton
        import triton.language as tl

        return not isinstance(tl.standard.sum, triton.runtime.JITFunction)
    return True


def check_runnable(device: torch.device) -> None:
    """Raise a RuntimeError naming the fix when the kernels cannot run on ``device``."""
    error = _import_error()
    if error:
        raise RuntimeError(f"WHITEFORMER_BACKEND={NAME}: {error}")
    if device.type != "cuda" and not _interpreted():
        raise RuntimeError(
            f"WHITEFORMER_BACKEND={NAME} on {device.type} tensors runs Triton's interpreter: set "
            "TRITON_INTERPRET=1 in the environment before triton is first imported (Triton reads it "
            "when it decorates its kernels, at import)"
        )


def _tssa(w, temp, attn_mask):
    check_runnable(w.device)
    from .tssa import tssa_triton

    return tssa_triton(w, temp, attn_mask)


def _causal_tssa(w, temp, logit_bias, attn_mask):
    check_runnable(w.device)
    from .causal_tssa import causal_tssa_triton

    return causal_tssa_triton(w, temp, logit_bias, attn_mask)


def _causal_tssa_step(w_t, sum_sq, sum_pi, sum_sq_pi, temp, logit_bias):
    check_runnable(w_t.device)
    from .causal_tssa_step import causal_tssa_step_triton

    return causal_tssa_step_triton(w_t, sum_sq, sum_pi, sum_sq_pi, temp, logit_bias)


def register() -> None:
    """Declare the kernels as the ``"triton"`` backend of CUDA tensors (called by
    :mod:`whiteformer.ops._kernels` at import)."""
    from ..registry import register_backend

    register_backend("cuda", DTYPES, triton_available, name=NAME,
                     kernels={"tssa": _tssa, "causal_tssa": _causal_tssa, "causal_tssa_step": _causal_tssa_step})
