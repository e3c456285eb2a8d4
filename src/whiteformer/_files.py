"""Files written whole or not at all: :func:`atomic_write` (a temporary file in the same directory,
then ``os.replace``), :func:`write_text` and :func:`save_figure`. Replacing the name also means a link found there is
replaced, never written through: what it points to stays as it was."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, Union

__all__ = ["atomic_write", "save_figure", "write_text"]


def atomic_write(path: Union[str, Path], write: Callable[[str], None]) -> Path:
    """``write(tmp_path)`` then ``os.replace(tmp_path, path)``; on any failure the temporary file is
    removed and ``path`` is untouched. Returns ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_text(path: Union[str, Path], text: str) -> Path:
    """:func:`atomic_write` of a UTF-8 text."""
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def save_figure(fig, path: Union[str, Path], **kwargs) -> Path:
    """``fig.savefig`` through :func:`atomic_write`; the format is the suffix of ``path`` (png by
    default), since the temporary name has none."""
    kwargs.setdefault("format", Path(path).suffix.lstrip(".") or "png")
    return atomic_write(path, lambda tmp: fig.savefig(tmp, **kwargs))
