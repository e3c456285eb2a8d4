"""Files written whole or not at all: :func:`atomic_write` (a temporary file in the same directory,
then ``os.replace``), :func:`write_text`, :func:`write_csv` and :func:`save_figure`. Replacing the name also means a link found there is
replaced, never written through: what it points to stays as it was. The file gets the permissions of any
new file (``0o666`` less the umask), as ``open(path, "w")`` would give it. :func:`is_temporary` names the
temporary files a writer killed mid-write left behind."""
from __future__ import annotations

import csv
import os
import re
import secrets
from pathlib import Path
from typing import Any, Callable, Dict, Sequence, Union

__all__ = ["atomic_write", "is_temporary", "save_figure", "write_csv", "write_text"]


def _temporary(path: Path) -> str:
    """A new empty file ``.NAME.<random>.tmp`` beside ``path``, created with mode 0o666 less the umask."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            os.close(os.open(str(tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return str(tmp)
    raise FileExistsError(f"no free temporary name beside {str(path)!r}")


def is_temporary(name: str, of: str) -> bool:
    """Whether the directory entry ``name`` is a temporary file of :func:`atomic_write` writing ``of``
    (what a writer killed mid-write leaves beside the untouched ``of``)."""
    return re.fullmatch(rf"\.{re.escape(of)}\.[0-9a-f]{{8}}\.tmp", name) is not None


def atomic_write(path: Union[str, Path], write: Callable[[str], None]) -> Path:
    """``write(tmp_path)`` then ``os.replace(tmp_path, path)``; on any failure the temporary file is
    removed and ``path`` is untouched. Returns ``path``."""
    path = Path(path)
    tmp = _temporary(path)
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


def write_csv(path: Union[str, Path], rows: Sequence[Dict[str, Any]]) -> Path:
    """:func:`atomic_write` of ``rows`` as CSV with a header: the columns are every key of the rows in
    order of first appearance; a value a row lacks (or None) is written empty."""
    keys = list(dict.fromkeys(k for r in rows for k in r))

    def write(tmp: str) -> None:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)

    return atomic_write(path, write)


def save_figure(fig, path: Union[str, Path], **kwargs) -> Path:
    """``fig.savefig`` through :func:`atomic_write`; the format is the suffix of ``path`` (png by
    default), since the temporary name has none."""
    kwargs.setdefault("format", Path(path).suffix.lstrip(".") or "png")
    return atomic_write(path, lambda tmp: fig.savefig(tmp, **kwargs))
