"""Builds and loads the fused CPU TSSA kernel (``tssa_cpu.cpp``, shipped as package data).

The extension is JIT-built once per environment with :func:`torch.utils.cpp_extension.load` (needs a
C++ compiler and ``ninja``; about a minute) into the user's cache,
``$WHITEFORMER_KERNEL_CACHE/<tag>`` (default ``$XDG_CACHE_HOME/whiteformer/kernels``, i.e.
``~/.cache/whiteformer/kernels``). ``<tag>`` is a key on everything the binary depends on
(:func:`build_environment`): the source text, the compiler flags (ISA, the epsilons of
:mod:`whiteformer.ops.constants`), the Python ABI, the torch version and the paths its headers and
libraries are read from (``build.ninja`` holds them: two virtual environments with the same torch
have different paths, so each gets its own directory instead of rebuilding the other's binary in
turn), ``sys.prefix`` and the compiler. The source is copied into that directory and built from
there, so another checkout using the same environment reuses the binary.

Concurrency and faults: the build runs under an OS file lock (``fcntl.flock`` on
``<tag>/build.lock``), which the kernel releases when its owner dies, even by SIGKILL. While
holding it, a ``lock`` file left in the directory by torch's own build lock (by a process killed
mid-build) is stale and is removed, so it can no longer hang later processes. A process that finds
the lock held for more than two seconds says so on stderr ("waiting for another process building the kernel…") and waits
at most ``WHITEFORMER_KERNEL_BUILD_TIMEOUT`` seconds (default 600); after that, like after a failed
build (no compiler, no ninja, ...), :func:`fast_path_available` is False, a warning says why once,
and the operators use their PyTorch path. Whenever a build runs (no binary yet, or ``ninja`` finds
it out of date) it says so on stderr ("building the fused TSSA kernel (once per environment,
~1 min)…").
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.resources
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from ..._files import atomic_write
from .. import constants
from .registry import kernels_disabled

__all__ = ["build_environment", "build_error", "build_key", "cache_root", "extension_dir", "fast_path_available",
           "load_cpp_extension", "load_extension", "needs_build"]

ENV_CACHE = "WHITEFORMER_KERNEL_CACHE"
ENV_TIMEOUT = "WHITEFORMER_KERNEL_BUILD_TIMEOUT"
DEFAULT_TIMEOUT = 600.0  # seconds a process waits for another one's build
QUIET_WAIT = 2.0  # seconds of waiting before the waiting message
LOCK_FILE = "build.lock"  # our OS lock (released on process death)
TORCH_LOCK_FILE = "lock"  # torch.utils.cpp_extension's lock file (left behind by a killed build)

_NAME = "whiteformer_tssa_cpu"
_SOURCE = "tssa_cpu.cpp"
_lock = threading.Lock()
_ext = None
_error: Optional[str] = None


# ------------------------------------------------------------------------------ build key


def cache_root() -> Path:
    root = os.environ.get(ENV_CACHE)
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "whiteformer", "kernels")
    return Path(root)


def build_environment() -> dict:
    """What a binary built here depends on besides its source and flags: the Python ABI, torch
    (version, build, the header / library paths and compiler standard ``build.ninja`` is written
    with), ``sys.prefix`` and the C++ compiler ``cpp_extension`` runs (``$CXX``, resolved)."""
    import shutil
    import sysconfig

    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    found = shutil.which(cxx)
    return {"python_abi": f"{sys.implementation.cache_tag}{sysconfig.get_config_var('EXT_SUFFIX') or ''}",
            "python_include": sysconfig.get_paths().get("include", ""), "prefix": sys.prefix,
            "torch": torch.__version__, "torch_git": getattr(torch.version, "git_version", ""),
            "torch_include": cpp_extension.include_paths(), "torch_lib": cpp_extension.library_paths(),
            "cxx11_abi": bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)),
            "cxx": os.path.realpath(found) if found else cxx}


def build_key(name: str, source: bytes, cflags: Sequence[str], ldflags: Sequence[str],
              environment: Optional[dict] = None) -> str:
    """The hex digest keying a build: name, source text, flags and :func:`build_environment`."""
    import json

    env = build_environment() if environment is None else environment
    key = json.dumps({"name": name, "source": hashlib.sha256(source).hexdigest(), "cflags": list(cflags),
                      "ldflags": list(ldflags), "environment": env}, sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()


def extension_dir(name: str, source: bytes, cflags: Sequence[str], ldflags: Sequence[str],
                  environment: Optional[dict] = None) -> Path:
    """``<cache>/<tag>``: the tag is :func:`build_key` (not where the source lives, so every
    checkout using one environment shares one binary; another environment has its own)."""
    digest = build_key(name, source, cflags, ldflags, environment)[:16]
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}_{digest}"
    return cache_root() / tag.replace("+", "_")


def needs_build(directory: Path, name: str) -> bool:
    """Whether loading ``name`` from ``directory`` compiles: no binary yet, no ``build.ninja``, or
    ``ninja -n`` (a dry run of the file torch wrote for it) finds work to do."""
    import subprocess

    binary = directory / f"{name}{'.pyd' if os.name == 'nt' else '.so'}"
    if not binary.exists() or not (directory / "build.ninja").exists():
        return True
    try:
        res = subprocess.run(["ninja", "-C", str(directory), "-n"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return True
    return res.returncode != 0 or "no work to do" not in res.stdout


def _timeout() -> float:
    raw = os.environ.get(ENV_TIMEOUT, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_TIMEOUT
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise ValueError(f"{ENV_TIMEOUT} must be a number of seconds >= 0, got {raw!r}")
    return value


# ------------------------------------------------------------------------------ OS lock


def _try_lock(fd: int) -> bool:
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


@contextlib.contextmanager
def build_lock(directory: Path, timeout: float) -> Iterator[None]:
    """Hold the OS lock of ``directory`` (created if needed); raise ``TimeoutError`` when another
    process holds it for more than ``timeout`` seconds. Released on exit and on process death."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _try_lock(fd):
            # the holder may only be loading the built binary (every process takes the lock): say so
            # only when the wait lasts
            start, announced = time.monotonic(), False
            while not _try_lock(fd):
                waited = time.monotonic() - start
                if not announced and waited >= min(QUIET_WAIT, timeout):
                    print(f"whiteformer: waiting for another process building the kernel… ({path}, at most "
                          f"{timeout:.0f} s, {ENV_TIMEOUT})", file=sys.stderr, flush=True)
                    announced = True
                if waited >= timeout:
                    raise TimeoutError(f"another process has held the kernel build lock {path} for more than "
                                       f"{timeout:.0f} s ({ENV_TIMEOUT})")
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())  # for people reading the directory
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


# ------------------------------------------------------------------------------ build and load


def load_cpp_extension(name: str, source: Path, cflags: Sequence[str] = (), ldflags: Sequence[str] = (),
                       timeout: Optional[float] = None, what: str = "kernel"):
    """Build (once per environment) and import the extension ``name`` from one C++ ``source`` file,
    under the OS lock of its cache directory (see the module docstring). Raises on failure."""
    from torch.utils import cpp_extension

    text = source.read_bytes()
    directory = extension_dir(name, text, cflags, ldflags)
    with build_lock(directory, _timeout() if timeout is None else timeout):
        # we hold the OS lock: no other process is inside cpp_extension.load for this directory,
        # so torch's own lock file, if present, was left by a killed process
        (directory / TORCH_LOCK_FILE).unlink(missing_ok=True)
        local = directory / source.name
        if not local.exists() or local.read_bytes() != text:
            atomic_write(local, lambda tmp: Path(tmp).write_bytes(text))
        if needs_build(directory, name):
            print(f"whiteformer: building the {what} (once per environment, ~1 min)… ({directory})",
                  file=sys.stderr, flush=True)
        return cpp_extension.load(name=name, sources=[str(local)], extra_cflags=list(cflags),
                                  extra_ldflags=list(ldflags), build_directory=str(directory), verbose=False)


def _source_path() -> Path:
    return Path(str(importlib.resources.files(__package__).joinpath(_SOURCE)))


def _isa_flags() -> list:
    # the vector ISA torch itself dispatches to on this CPU (never -march=native)
    cap = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "DEFAULT"
    if cap == "AVX512":
        return ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mprefer-vector-width=512"]
    return ["-mavx2", "-mfma"] if cap == "AVX2" else []


def _constant_flags() -> list:
    # the epsilons and the input range of whiteformer.ops.constants, compiled in (part of the build key)
    return [f"-DWF_{name}={getattr(constants, name)!r}" for name in ("NORM_EPS", "PI_EPS", "RATIO_EPS", "SAFE_MAX")]


def tssa_build_args() -> dict:
    """name, source and flags of the fused TSSA CPU kernel (for :func:`load_cpp_extension`)."""
    return dict(name=_NAME, source=_source_path(),
                cflags=["-O3", "-fno-trapping-math", "-fopenmp", *_isa_flags(), *_constant_flags()],
                ldflags=["-fopenmp"], what="fused TSSA kernel")


def load_extension():
    """Build (first call on a machine) and import the extension; returns the module or None."""
    global _ext, _error
    if _ext is not None or _error is not None:
        return _ext
    with _lock:
        if _ext is not None or _error is not None:
            return _ext
        try:
            _ext = load_cpp_extension(**tssa_build_args())
        except Exception as exc:  # no compiler / ninja / headers, or the wait timed out: torch path
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
