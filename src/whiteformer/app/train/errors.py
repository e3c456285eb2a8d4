"""Which failures the user caused, and the one line that says so (``whiteformer`` prints it as
``error: ...`` with exit code 2; anything else is a bug and keeps its traceback)."""
from __future__ import annotations

from typing import Optional

__all__ = ["user_error", "debug_requested", "is_panic", "panic_message"]


def is_panic(err: BaseException) -> bool:
    """A native library's panic (:func:`whiteformer.app.data.tokenizer.is_panic`)."""
    from ..data.tokenizer import is_panic as panic

    return panic(err)


def panic_message(err: BaseException) -> str:
    """One line for a native library's panic."""
    from ..data.tokenizer import describe_panic

    return f"a native library failed: {describe_panic(err)}"


def user_error(err: BaseException) -> Optional[str]:
    """The one-line message of a failure the user caused (bad option, data, file, disk), else None
    (a bug: the traceback is shown)."""
    import errno
    import pickle

    from ...models.read import CheckpointFileError
    from ..config import ConfigError
    from ..data.tokens import TokenFileError
    from .checkpoint import CheckpointError
    from .tasks.lm import NoTargetsError

    if isinstance(err, (ConfigError, CheckpointError, CheckpointFileError, ImportError, FloatingPointError,
                        TokenFileError, NoTargetsError)):
        return str(err)
    if isinstance(err, pickle.UnpicklingError):
        if str(err).startswith("refused to load"):  # models.read's own message, naming the file
            return str(err).splitlines()[0]
        return (f"refused to load a pickled file: it holds objects other than tensors, which could run code "
                f"({str(err).splitlines()[0]})")
    if isinstance(err, OSError) and err.errno is None and err.args:
        return str(err)  # raised with a message of its own (e.g. "checkpoint directory ... has no ...")
    if isinstance(err, OSError) and err.errno is not None:
        where = f": {err.filename!r}" if err.filename else ""
        hint = {errno.ENOSPC: " (the disk is full: free space or choose another --out)",
                errno.EROFS: " (read-only file system: choose another --out)",
                errno.EACCES: " (no permission: choose another --out)"}.get(err.errno, "")
        return f"{err.strerror or err}{where}{hint}"
    if type(err).__name__ == "SafetensorError":
        msg = str(err)
        if "No space left" in msg or "os error 28" in msg:
            return f"the disk is full while writing a safetensors file ({msg}); free space or choose another --out"
        return f"cannot read or write a safetensors file (truncated or corrupt?): {msg}"
    if _out_of_memory(err):
        return (f"out of memory: {str(err).splitlines()[0]} (the sizes asked for do not fit: use a smaller batch, "
                f"model or input, or another device)")
    if isinstance(err, (UnicodeDecodeError, EOFError)):
        return f"a file is truncated or not in the expected format: {type(err).__name__}: {err}"
    return None


def _out_of_memory(err: BaseException) -> bool:
    """torch's allocation failures: ``torch.OutOfMemoryError`` (a GPU) or the CPU allocator's
    ``RuntimeError`` ("DefaultCPUAllocator: can't allocate memory")."""
    import sys

    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return ((oom is not None and isinstance(err, oom))
            or (isinstance(err, RuntimeError) and "can't allocate memory" in str(err)))


def debug_requested(argv) -> bool:
    """``--debug`` in ``argv`` (removed from it) or ``WHITEFORMER_DEBUG`` set: show tracebacks."""
    import os

    flag = "--debug" in argv
    while "--debug" in argv:
        argv.remove("--debug")
    return flag or os.environ.get("WHITEFORMER_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")
