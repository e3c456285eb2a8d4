"""The run directory: one writer at a time, and nothing in it that a run did not create is
deleted or overwritten.

- :class:`RunLock`: an exclusive ``fcntl.flock`` on ``RUN/.whiteformer-run.lock`` held for the
  life of a run. The kernel releases it when the process dies (even on SIGKILL), so a crashed run
  never blocks the next one; a second writer gets an error naming the holder (pid, host, command,
  start time), which the lock file records. The file stays behind as the mark of a directory
  written by ``whiteformer train``.
- :func:`check_run_dir`: what may be done with an existing directory (see its docstring); a
  finished run (``final/``) is never replaced without ``--overwrite``.
- ``--overwrite``: :func:`stash_run_files` moves the old run's files aside once the new run is
  built, :func:`drop_stashes` deletes them when the new run has its final model, and
  :func:`restore_stash` puts them back if it fails before its first checkpoint.
"""
from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Optional

from ..._files import is_stage, is_temporary
from ...models.factory import RUN_EMA_MODEL_DIR, RUN_MODEL_DIR, RUN_STASH_PREFIX
from ..config import ConfigError
from .checkpoint import list_checkpoints, list_quarantined
from .outputs import remove_entry

__all__ = ["RunLock", "LOCK_NAME", "RUN_FILES", "FINAL_DIRS", "open_run_dir", "check_run_dir", "run_created",
           "stash_run_files", "restore_stash", "drop_stashes"]

LOCK_NAME = ".whiteformer-run.lock"
#: what a run writes into its directory (everything else belongs to the user)
RUN_FILES = ("checkpoints", RUN_MODEL_DIR, RUN_EMA_MODEL_DIR, "tensorboard", "config.yaml", "metrics.jsonl", "metrics.csv",
             "report.md", "report.json", "curves.png", "coding_rate.png", "membership.png", "cls_attention.png",
             LOCK_NAME)
#: a directory holding one of these holds a finished run: a new run there needs --overwrite
FINAL_DIRS = (RUN_MODEL_DIR, RUN_EMA_MODEL_DIR)
#: the hidden directory where --overwrite keeps the replaced run until the new one has its model, renamed
#: ``.restoring-*`` while it is put back; the stopped run's files wait in ``.discarded-*`` meanwhile
STASH_PREFIX, RESTORING_PREFIX, DISCARDED_PREFIX = RUN_STASH_PREFIX, ".restoring-", ".discarded-"


class RunLock:
    """Exclusive lock of a run directory (created if missing); ``release()`` or process death frees it."""

    def __init__(self, run_dir, command: str = ""):
        import fcntl

        self.path = Path(run_dir) / LOCK_NAME
        if self.path.is_symlink():  # opening it would truncate and write the link's target
            raise ConfigError(f"--out {str(run_dir)!r}: its lock file {LOCK_NAME} is a symbolic link (to "
                              f"{os.readlink(self.path)!r}); a run never writes through a link: remove the link, or "
                              f"choose another --out")
        try:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self.fd: Optional[int] = os.open(str(self.path), os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0),
                                             0o644)
        except OSError as err:
            raise ConfigError(f"--out {str(run_dir)!r}: cannot create the run directory ({err.strerror or err})") \
                from err
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read_holder()
            os.close(self.fd)
            self.fd = None
            raise ConfigError(f"run directory {str(run_dir)!r} is in use by another run ({holder}); wait for it to "
                              f"finish or stop it, or choose another --out") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
                "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(info) + "\n").encode(), 0)

    def _read_holder(self) -> str:
        try:
            with open(self.path, encoding="utf-8") as f:
                info = json.loads(f.read() or "{}")
        except (OSError, ValueError):
            return "holder unknown"
        return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {info.get('started', '?')}, "
                f"command: {info.get('command') or '?'}")

    def release(self) -> None:
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def run_created(run_dir) -> List[Path]:
    """The entries of ``run_dir`` a run creates (the names in :data:`RUN_FILES`; a link counts)."""
    return [Path(run_dir) / n for n in RUN_FILES if os.path.lexists(Path(run_dir) / n) and n != LOCK_NAME]


def _is_stash(name: str) -> bool:
    return name.startswith((STASH_PREFIX, RESTORING_PREFIX, DISCARDED_PREFIX))


def _is_unfinished_final(name: str) -> bool:
    """A ``final*/`` being written or replaced when the run was killed (the trainer's own names), or
    the temporary file of one of the run's files (``config.yaml``, the report, ...) it was writing."""
    return (any(name.startswith(f"{pre}{n}-") for pre in (".tmp-", ".trash-") for n in FINAL_DIRS)
            or any(is_temporary(name, n) or is_stage(name, n) for n in RUN_FILES))


def remove_unfinished_finals(run_dir) -> None:
    """Delete what a killed run left of writing its ``final*/`` or its other files (links unlinked,
    never followed)."""
    for p in Path(run_dir).iterdir():
        if _is_unfinished_final(p.name):
            remove_entry(p)


def stash_run_files(run_dir, say: Callable[[str], None]) -> Optional[Path]:
    """``--overwrite``: move what a run created in ``run_dir`` (never the user's other files) into a
    hidden ``.overwritten-*`` directory there, saying what. Renaming moves a link, not its target.
    Deleted by :func:`drop_stashes` once the new run has written its final model, put back by
    :func:`restore_stash` if the new run fails before its first checkpoint."""
    gone = run_created(run_dir)
    if not gone:
        return None
    stash = Path(tempfile.mkdtemp(prefix=f"{STASH_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-", dir=str(run_dir)))
    for p in gone:
        os.rename(p, stash / p.name)
    say(f"overwrite: moved {', '.join(p.name for p in gone)} in {str(run_dir)!r} aside to {stash.name}; deleted once "
        f"this run has written its final model")
    return stash


def restore_stash(run_dir, stash: Path, say: Callable[[str], None], why: str = "this run failed before its first "
                  "checkpoint") -> None:
    """Undo :func:`stash_run_files`: the new run's files go, the old come back. Each step can be redone
    after a kill: the new run's files are first moved into ``.discarded-*``, then the stash is renamed
    ``.restoring-*`` (from then on its entries only move back) and emptied, then the discarded files go."""
    run_dir, stash = Path(run_dir), Path(stash)
    tag = stash.name.split("-", 1)[1]
    discarded, restoring = run_dir / f"{DISCARDED_PREFIX}{tag}", run_dir / f"{RESTORING_PREFIX}{tag}"
    if stash.name.startswith(STASH_PREFIX):
        discarded.mkdir(exist_ok=True)
        for p in run_created(run_dir):
            os.rename(p, discarded / p.name)
        os.rename(stash, restoring)
    for p in sorted(restoring.iterdir()):
        if not os.path.lexists(run_dir / p.name):
            os.rename(p, run_dir / p.name)
    remove_entry(restoring)
    if os.path.lexists(discarded):
        remove_entry(discarded)
    say(f"overwrite: {why}; the previous run's files are back in {str(run_dir)!r}")


def recover_stash(run_dir, *, resume: bool, say: Callable[[str], None]) -> None:
    """What a run started with ``--overwrite`` and stopped (killed) left: the replaced run, hidden in
    ``.overwritten-*``. Without a final model of the stopped run it is put back (:func:`restore_stash`),
    unless ``resume`` continues the stopped run's checkpoints (then it is kept, and said where); beside a
    final model it is kept and named. Never deleted silently."""
    p = Path(run_dir)
    if not p.is_dir():
        return
    hidden = sorted(e for e in p.iterdir() if e.name.startswith((STASH_PREFIX, RESTORING_PREFIX))
                    and e.is_dir() and not e.is_symlink())
    finished = any(os.path.lexists(p / n) for n in FINAL_DIRS)
    for stash in hidden:
        if stash.name.startswith(STASH_PREFIX) and finished:
            say(f"note: {str(stash)!r} holds the files of a run replaced under --overwrite (the run that replaced "
                f"it finished, but was stopped before deleting them); kept: delete it yourself if you do not need "
                f"it")
        elif stash.name.startswith(STASH_PREFIX) and resume and list_checkpoints(p / "checkpoints"):
            say(f"overwrite: the run replaced by the run this continues waits in {str(stash)!r}; deleted once "
                f"this run has written its final model")
        else:
            restore_stash(p, stash, say, why="a run started with --overwrite was stopped before writing its final "
                                              "model")
    for e in p.iterdir():  # what a restore stopped after emptying its stash left
        if e.name.startswith(DISCARDED_PREFIX) and not (p / (STASH_PREFIX + e.name[len(DISCARDED_PREFIX):])).exists():
            remove_entry(e)


def drop_stashes(run_dir, say: Callable[[str], None]) -> None:
    """Delete the runs replaced under ``--overwrite`` (every ``.overwritten-*`` entry), saying so; links
    unlinked and never followed; a failure is reported, not hidden, and does not fail the finished run."""
    for p in sorted(Path(run_dir).iterdir()):
        if p.name.startswith(STASH_PREFIX):
            try:
                remove_entry(p)
                say(f"overwrite: deleted the replaced run's files ({p.name})")
            except OSError as err:
                say(f"warning: could not delete the replaced run's files {str(p)!r}: {err}")


def open_run_dir(run_dir, *, resume: bool, overwrite: bool, command: str = "", say: Callable[[str], None] = print):
    """Lock ``run_dir`` and decide what to do with it: ``(RunLock, mode)`` (see :func:`check_run_dir`).
    A directory locked by a live run gives an error naming it before anything else is checked; what a
    stopped ``--overwrite`` run left is recovered first (:func:`recover_stash`)."""
    marked = (Path(run_dir) / LOCK_NAME).is_file()
    lock = RunLock(run_dir, command) if marked else None
    try:
        if lock is not None:
            recover_stash(run_dir, resume=resume, say=say)
        mode = check_run_dir(run_dir, resume=resume, overwrite=overwrite, marked=marked)
        if lock is None:
            lock = RunLock(run_dir, command)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock, mode


def check_run_dir(run_dir, *, resume: bool, overwrite: bool, marked: Optional[bool] = None) -> str:
    """What to do with ``run_dir`` before a run writes into it; returns ``"fresh"`` (nothing to
    keep), ``"resume"`` (continue its checkpoints) or ``"clear"`` (move the run's own files aside,
    :func:`stash_run_files`; they are deleted once the new run has its final model).

    - missing or empty (or holding only the lock file): fresh;
    - with checkpoints: ``resume`` continues them, ``overwrite`` clears the run's files, else an error;
    - ``overwrite`` clears any other directory too, keeping the files a run does not write;
    - a finished run (``final/``, ``final_ema/``) without checkpoints to continue, or a run whose
      checkpoints were all found corrupt (``corrupt-step_*``): an error, nothing is replaced;
    - without checkpoints, written by a run (``marked``: the lock file was there; default: look)
      and holding nothing else: a run that never checkpointed, started afresh;
    - anything else (files a run did not write, or no mark of a run): an error.
    """
    p = Path(run_dir)
    if marked is None:
        marked = (p / LOCK_NAME).is_file()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"--out {str(run_dir)!r} exists and is not a directory")
    entries = sorted(e.name for e in p.iterdir()) if p.is_dir() else []
    if not entries or entries == [LOCK_NAME]:
        return "fresh"
    if list_checkpoints(p / "checkpoints"):
        if resume:
            return "resume"
        if overwrite:
            return "clear"
        raise ConfigError(f"run directory {str(run_dir)!r} already has checkpoints; pass --resume to continue it, "
                          f"--overwrite to start afresh, or choose another --out")
    if overwrite:
        return "clear"
    corrupt = list_quarantined(p / "checkpoints")
    if corrupt:
        raise no_intact_checkpoint(run_dir, corrupt)
    foreign = [n for n in entries if n not in RUN_FILES and not _is_stash(n) and not _is_unfinished_final(n)]
    if not foreign and marked:
        finished = [n + "/" for n in FINAL_DIRS if os.path.lexists(p / n)]
        if finished:
            why = "but no checkpoint to continue it from" if resume else "(and no checkpoints)"
            raise ConfigError(f"run directory {str(run_dir)!r} holds a finished run ({', '.join(finished)}) {why}; "
                              f"choose another --out, or pass --overwrite to replace it")
        return "clear"
    what = ", ".join(entries[:6]) + (", ..." if len(entries) > 6 else "")
    raise ConfigError(f"--out {str(run_dir)!r} is not empty ({what}) and is not a run to resume (no checkpoints); "
                      f"choose another --out, or pass --overwrite to delete the files a run writes "
                      f"({', '.join(n for n in RUN_FILES if n != LOCK_NAME)}) and keep the others")


def no_intact_checkpoint(run_dir, corrupt: List[str]) -> ConfigError:
    """The error of a run whose checkpoints are all corrupt (``--resume`` never starts it over)."""
    return ConfigError(f"run directory {str(run_dir)!r} has no intact checkpoint: the corrupt ones were moved to "
                       f"{', '.join('checkpoints/' + n for n in corrupt)} (kept for inspection) and nothing else was "
                       f"changed; pass --overwrite to start afresh (deleting them and the run's other files), or "
                       f"choose another --out")
