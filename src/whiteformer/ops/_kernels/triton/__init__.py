"""Triton kernels for TSSA, causal TSSA and the causal TSSA step (the GPU path).

One module per operator: :mod:`.tssa`, :mod:`.causal_tssa`, :mod:`.causal_tssa_step`, each with
its kernels, a ``torch.library`` custom op pair (forward, backward) with a fake implementation
and a registered autograd formula, and a function with the kernel signature of
:mod:`whiteformer.ops._kernels`; the shared tile helpers are in :mod:`._tiles`.

:func:`register` declares them as the backend ``"triton"`` for CUDA tensors of float16,
bfloat16, float32 and float64 (statistics in float32, float64 for float64). Which path runs is
decided by :mod:`whiteformer.ops._kernels`:

- CUDA tensors use these kernels when ``triton`` imports, else the PyTorch path; on a Triton the
  kernels cannot use (older than 3.3, or a kernel that fails to compile with it), the PyTorch
  path too, after one warning naming the Triton version (version differences: :mod:`._compat`);
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
import importlib
import importlib.util
import os
import sys
import warnings

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
    """Whether the backend is offered: ``triton`` imports and can run the kernels, or
    ``WHITEFORMER_BACKEND=triton`` forces it (then a kernel that cannot run raises a clear error
    instead of falling back). An installed Triton the kernels cannot use (too old, or a kernel
    failed to compile) is not offered: the PyTorch path runs, after one warning naming it."""
    return _forced() or not (_import_error() or _unusable())


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


_broken: list = []  # why the kernels failed to compile here (set once: too old, or a compile failure)


def _unusable() -> str:
    """'' when the installed Triton can run the kernels, else why not (warned once)."""
    if not _broken:
        from ._compat import unsupported

        reason = unsupported()
        if not reason:
            return ""
        _broken.append(reason)
        _warn_fallback(reason)
    return _broken[0]


def _warn_fallback(reason: str) -> None:
    warnings.warn(f"whiteformer: {reason}; the TSSA ops use the PyTorch path instead of the Triton kernels",
                  RuntimeWarning, stacklevel=5)


def _kernel(op: str, torch_path: str):
    """The registered kernel of ``op``: ``<op>_triton`` of the module ``.<op>``, unless it fails to
    compile on this Triton: then, unless the backend is forced, one warning naming the Triton
    version and the error, and ``torch_path`` (``module:function`` in :mod:`whiteformer.ops`, the
    PyTorch path with the kernel's signature) for this call and every later one."""
    def run(*args):
        check_runnable(args[0].device)
        from ._compat import compile_errors

        try:
            return getattr(importlib.import_module(f"{__name__}.{op}"), f"{op}_triton")(*args)
        except compile_errors() as e:
            if _forced():
                raise
            import triton

            last = (str(e).strip().splitlines() or [""])[-1][:300]
            _broken.append(f"the Triton kernels do not compile with Triton {triton.__version__} "
                           f"({type(e).__name__}: {last})")
            _warn_fallback(_broken[0])
        module, name = torch_path.split(":")
        return getattr(importlib.import_module(f"whiteformer.ops.{module}"), name)(*args)

    run.__name__ = f"_{op}"
    return run


def register() -> None:
    """Declare the kernels as the ``"triton"`` backend of CUDA tensors (called by
    :mod:`whiteformer.ops._kernels` at import)."""
    from ..registry import register_backend

    register_backend("cuda", DTYPES, triton_available, name=NAME,
                     kernels={"tssa": _kernel("tssa", "tssa.parallel:tssa_parallel"),
                              "causal_tssa": _kernel("causal_tssa", "causal_tssa.parallel:causal_tssa_parallel"),
                              "causal_tssa_step": _kernel("causal_tssa_step",
                                                          "causal_tssa.recurrent:causal_tssa_recurrent")})
