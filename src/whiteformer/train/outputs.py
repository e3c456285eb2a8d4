"""Where the commands' output goes, without losing what the user has.

- :func:`remove_entry`: delete one directory entry; a symbolic link is unlinked, never followed,
  and a failure raises (nothing is silently left half-deleted).
- :func:`replace_entry`: put a freshly written file or directory in the place of an old one
  (a link there is replaced by the new entry; its target is left alone).
- :func:`check_output_dir` / :func:`staged_output`: an ``--out`` directory of ``compress`` and
  ``analyze`` must be missing or empty unless ``--overwrite``; the files are written into a hidden
  directory inside it first and moved into place only when the command has succeeded, so a
  failed command changes nothing and ``--overwrite`` replaces only the names it writes. The hidden
  directory is locked (``flock``) while its command lives: one left by a killed command is not
  counted as the user's and is removed by the next one; one in use is an error naming it.
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

from .configuration import ConfigError

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


STAGE_PREFIX = ".tmp-output-"


def _lock_stage(path: Path):
    """An exclusive ``flock`` on the staging directory ``path``: its descriptor, or None when a living
    command holds it (the kernel frees it when that command dies, even on SIGKILL)."""
    import fcntl

    fd = os.open(str(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _stages(p: Path):
    """``(left, busy)``: the staging directories in ``p`` that a killed command left, and the names of
    those a living command is writing."""
    left, busy = [], []
    for e in p.iterdir():
        if e.name.startswith(STAGE_PREFIX) and not e.is_symlink() and e.is_dir():
            fd = _lock_stage(e)
            if fd is None:
                busy.append(e.name)
            else:
                os.close(fd)
                left.append(e)
    return left, busy


def check_output_dir(out, *, overwrite: bool, flag: str = "--out") -> Path:
    """``out`` as a Path when a command may write there: missing, an empty directory, or (only with
    ``overwrite``) a directory with files; anything else is a :class:`ConfigError` saying why. What a
    killed command left of its staging directory does not count; one in use by a living command is
    an error."""
    p = Path(out).expanduser()
    if os.path.lexists(p) and not p.is_dir():
        raise ConfigError(f"{flag} {str(out)!r} exists and is not a directory")
    left, busy = _stages(p) if p.is_dir() else ([], [])
    if busy:
        raise ConfigError(f"{flag} {str(out)!r} is in use by another command (writing {busy[0]}); wait for it to "
                          f"finish, or choose another {flag}")
    entries = sorted(e.name for e in p.iterdir() if e not in left) if p.is_dir() else []
    if entries and not overwrite:
        what = ", ".join(entries[:6]) + (", ..." if len(entries) > 6 else "")
        raise ConfigError(f"{flag} {str(out)!r} is not empty ({what}); choose another {flag}, or pass --overwrite to "
                          f"replace the files this command writes there (other files are kept)")
    return p


@contextlib.contextmanager
def staged_output(out, *, overwrite: bool, flag: str = "--out") -> Iterator[Path]:
    """Checked by :func:`check_output_dir`, then yields a hidden directory inside ``out`` to write
    into; on success each entry written there replaces the one of the same name in ``out`` (other
    files are kept), on failure nothing in ``out`` changes (a directory created for it is removed)."""
    p = check_output_dir(out, overwrite=overwrite, flag=flag)
    created = not p.exists()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{flag} {str(out)!r}: cannot create the directory ({err.strerror or err})") from err
    stage = p / f"{STAGE_PREFIX}{os.getpid()}"
    if os.path.lexists(stage):
        remove_entry(stage)
    stage.mkdir()
    fd = _lock_stage(stage)
    try:
        for old in _stages(p)[0]:  # what killed commands left
            if old != stage:
                remove_entry(old)
        yield stage
        for entry in sorted(stage.iterdir()):
            replace_entry(entry, p / entry.name)
    finally:
        if os.path.lexists(stage):
            remove_entry(stage)
        if fd is not None:
            os.close(fd)
        if created and not any(p.iterdir()):
            p.rmdir()


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
