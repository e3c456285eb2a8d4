"""Progress bars of the long commands (eval, analyze, compress): tqdm on stderr, only on a terminal.

A bar is drawn when it is enabled (no ``--quiet`` / ``--no-progress``) and its stream is a terminal,
as ``whiteformer train`` does: a log file or a pipe gets no redrawn bar. Otherwise :func:`progress_bar`
returns :data:`NO_BAR`, which takes the same calls and does nothing, so callers never branch.
"""
from __future__ import annotations

import sys
from typing import Optional, TextIO

__all__ = ["progress_bar", "is_terminal", "NO_BAR"]


def is_terminal(file: Optional[TextIO] = None) -> bool:
    """Whether ``file`` (default ``sys.stderr``) is a terminal."""
    file = sys.stderr if file is None else file
    return bool(getattr(file, "isatty", lambda: False)())


class _NoBar:
    """Takes a tqdm bar's calls and does nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_description_str(self, desc: str, refresh: bool = True) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc) -> None:
        pass


NO_BAR = _NoBar()


def progress_bar(total: int, desc: str, unit: str = "it", *, enabled: bool = True,
                 file: Optional[TextIO] = None):
    """A tqdm bar of ``total`` steps (elapsed time, rate and ETA) on ``file`` (default ``sys.stderr``)
    when ``enabled`` and that stream is a terminal; else :data:`NO_BAR`."""
    file = sys.stderr if file is None else file
    if not (enabled and total and is_terminal(file)):
        return NO_BAR
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, file=file)
