"""Loader of the fused CPU TSSA kernels (``tssa_cpu.cpp``, shipped as package data).

The extension is JIT-built once per machine with :func:`torch.utils.cpp_extension.load`
(needs a C++ compiler and ``ninja``; ~30-60 s) into the user's cache,
``$XDG_CACHE_HOME/whiteformer/kernels/<tag>`` (default ``~/.cache/...``; override with
``WHITEFORMER_KERNEL_CACHE``), where ``<tag>`` names the Python, torch, source and ISA flags, so
changed sources or another machine type rebuild instead of reusing a stale binary.
If the build fails (no compiler, no ninja, ...) :func:`fast_path_available` returns False, a
warning says why once, and the operators use their pure-PyTorch path.
"""
from __future__ import annotations

import hashlib
import importlib.resources
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

from .. import constants
from . import kernels_disabled

__all__ = ["fast_path_available", "load_extension", "build_error"]

_SOURCE = "tssa_cpu.cpp"
_lock = threading.Lock()
_ext = None
_error: Optional[str] = None


def _source_path() -> Path:
    return Path(str(importlib.resources.files(__package__).joinpath(_SOURCE)))


def _isa_flags() -> list:
    # the vector ISA torch itself dispatches to on this CPU (never -march=native)
    cap = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "DEFAULT"
    if cap == "AVX512":
        return ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mprefer-vector-width=512"]
    return ["-mavx2", "-mfma"] if cap == "AVX2" else []


def _constant_flags() -> list:
    # the epsilons of whiteformer.ops.constants, compiled in (part of the build key)
    return [f"-DWF_{name}={getattr(constants, name)!r}" for name in ("NORM_EPS", "PI_EPS", "RATIO_EPS")]


def _build_dir(src: Path, flags: list) -> Path:
    root = os.environ.get("WHITEFORMER_KERNEL_CACHE")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "whiteformer", "kernels")
    digest = hashlib.sha1(src.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}_{digest}"
    path = Path(root) / tag.replace("+", "_")
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_extension():
    """Build (first call on a machine) and import the extension; returns the module or None."""
    global _ext, _error
    if _ext is not None or _error is not None:
        return _ext
    with _lock:
        if _ext is not None or _error is not None:
            return _ext
        try:
            from torch.utils import cpp_extension

            src = _source_path()
            flags = ["-O3", "-fno-trapping-math", "-fopenmp", *_isa_flags(), *_constant_flags()]
            _ext = cpp_extension.load(
                name="whiteformer_tssa_cpu",
                sources=[str(src)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(_build_dir(src, flags)),
                verbose=False,
            )
        except Exception as exc:  # no compiler / ninja / headers: use the torch path
            _error = f"{type(exc).__name__}: {exc}".strip()[:2000]
            warnings.warn(
                "whiteformer: could not build the fused CPU TSSA kernel, using the pure-PyTorch path "
                f"({_error.splitlines()[0] if _error else ''})",
                RuntimeWarning,
                stacklevel=3,
            )
    return _ext


def build_error() -> Optional[str]:
    """Why the extension could not be built (None if it was built or never tried)."""
    return _error


def fast_path_available() -> bool:
    """True when the fused CPU kernel can be used (not disabled by
    ``WHITEFORMER_DISABLE_KERNELS=1`` and the extension builds/loads on this machine)."""
    if kernels_disabled():
        return False
    return load_extension() is not None
