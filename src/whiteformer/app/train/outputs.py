"""Where the commands' output goes, without losing what the user has.

- :func:`remove_entry`: delete one directory entry; a symbolic link is unlinked, never followed,
  and a failure raises (nothing is silently left half-deleted).
- :func:`replace_entry`: put a freshly written file or directory in the place of an old one
  (a link there is replaced by the new entry; its target is left alone).
- :func:`check_output_dir` / :func:`staged_output`: an ``--out`` directory of ``compress`` and
  ``analyze`` must be missing or empty unless ``--overwrite``; the files are written into a new
  folder beside it, which replaces it as one unit only when the command has succeeded
  (:func:`whiteformer._files.staged_folder`), so a failed or killed command changes nothing and
  ``--overwrite`` replaces only the names it writes. A living command writing the same directory is
  an error naming it; what a killed one left is removed by the next one.
- :func:`say`: print a line; when stdout is a closed pipe (``whiteformer train ... | head``), stop
  printing and carry on: the run must not end because nobody reads its log.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator

from ..._files import folder_writer, staged_folder
from ..config import ConfigError, check_path_option

__all__ = ["remove_entry", "replace_entry", "check_output_dir", "staged_output", "say"]


def remove_entry(path) -> None:
    """Delete ``path``: a symbolic link (to anything) or a file is unlinked, a real directory is
    removed with its contents (links inside are unlinked, not followed). Errors raise."""
    p = Path(path)
    if p.is_symlink() or not p.is_dir():
        p.unlink()
    else:
        shutil.rmtree(p)


def replace_entry(src, dest) -> None:
    """Move the file or directory ``src`` to ``dest`` (same file system), replacing what is there:
    a file or a link is replaced (a link's target is untouched), an old directory is renamed aside
    and removed only once ``src`` took its place."""
    src, dest = Path(src), Path(dest)
    if not os.path.lexists(dest):
        os.rename(src, dest)
    elif dest.is_symlink() or not dest.is_dir():
        if src.is_dir():
            dest.unlink()
            os.rename(src, dest)
        else:
            os.replace(src, dest)
    else:
        trash = dest.with_name(f".trash-{dest.name}-{os.getpid()}")
        if os.path.lexists(trash):
            remove_entry(trash)
        os.rename(dest, trash)
        os.rename(src, dest)
        remove_entry(trash)


def check_output_dir(out, *, overwrite: bool, flag: str = "--out") -> Path:
    """``out`` as a Path when a command may write there: missing, an empty directory, or (only with
    ``overwrite``) a directory with files; anything else is a :class:`ConfigError` saying why. A living
    command writing the same directory is an error naming it."""
    check_path_option(flag, out)
    p = Path(out).expanduser()
    if os.path.lexists(p) and not p.is_dir():
        raise ConfigError(f"{flag} {str(out)!r} exists and is not a directory")
    busy = folder_writer(p)
    if busy:
        raise ConfigError(f"{flag} {str(out)!r} is in use by another command (writing {busy}); wait for it to "
                          f"finish, or choose another {flag}")
    entries = sorted(e.name for e in p.iterdir()) if p.is_dir() else []
    if entries and not overwrite:
        what = ", ".join(entries[:6]) + (", ..." if len(entries) > 6 else "")
        raise ConfigError(f"{flag} {str(out)!r} is not empty ({what}); choose another {flag}, or pass --overwrite to "
                          f"replace the files this command writes there (other files are kept)")
    return p


@contextlib.contextmanager
def staged_output(out, *, overwrite: bool, flag: str = "--out") -> Iterator[Path]:
    """Checked by :func:`check_output_dir`, then yields a new folder to write into; on success it
    replaces ``out`` as one unit (:func:`whiteformer._files.staged_folder`: the entries of ``out`` not
    written again are kept), on failure nothing in ``out`` changes."""
    p = check_output_dir(out, overwrite=overwrite, flag=flag)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{flag} {str(out)!r}: cannot create the directory ({err.strerror or err})") from err
    with staged_folder(p) as stage:
        yield stage


def say(msg: str) -> None:
    """``print(msg)`` to stdout; if stdout is a closed pipe, later output goes to the null device
    instead and the caller carries on."""
    try:
        print(msg, flush=True)
    except BrokenPipeError:
        _stdout_to_devnull()


def _stdout_to_devnull() -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, sys.stdout.fileno())  # the pending buffer then drains into the null device
    except (OSError, ValueError, AttributeError):
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
    finally:
        os.close(null)
