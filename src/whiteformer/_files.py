"""Files and folders written whole or not at all.

- :func:`atomic_write` (a temporary file in the same directory, then ``os.replace``), :func:`write_text`,
  :func:`write_csv` and :func:`save_figure`. Replacing the name also means a link found there is
  replaced, never written through: what it points to stays as it was. The file gets the permissions of
  any new file (``0o666`` less the umask), as ``open(path, "w")`` would give it.
- :func:`staged_folder` / :func:`replace_folder`: a folder (a model: weights, config, code) replaced as
  one unit. The new folder is written beside the old one (``.NAME.<random>.tmp``), the old folder's other
  entries are carried over (hard links), and one atomic exchange (``renameat2(RENAME_EXCHANGE)``) puts
  it in place: a reader sees the old folder or the new one, never a mix; what another process added to
  the old folder meanwhile, in any subfolder, is then moved into the new one; a failed or killed writer leaves
  the old folder as it was; a second writer on the same folder while one is writing is refused
  (:class:`FolderInUseError`); what a killed writer left is removed by the next one.
- :func:`is_temporary` names the temporaries a writer killed mid-write left behind.
- :func:`check_path`: the check of every path a user gives (an empty one is refused).
"""
from __future__ import annotations

import contextlib
import csv
import errno
import os
import re
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any, Callable, Dict, FrozenSet, Iterator, Optional, Sequence, Tuple, Union

__all__ = ["EMPTY_PATH", "FolderInUseError", "atomic_write", "check_path", "folder_writer", "is_stage", "is_temporary",
           "new_file_mode", "replace_folder", "save_figure", "staged_folder", "write_csv", "write_text"]


#: why an empty path is refused: the system reads it as no file, ``pathlib`` (``Path("")``) as the working directory
EMPTY_PATH = "an empty path names no file or folder (write . for the working directory)"


def check_path(value, name: str) -> Union[str, "os.PathLike"]:
    """``value`` is a path (``str`` or ``os.PathLike``) that is not empty, else a ``TypeError`` /
    ``ValueError`` naming ``name``: ``""`` (an unset shell variable, a missing setting) would otherwise
    be read as the working directory, and a save replace it or a reader take in all its files.
    Returns ``value``."""
    if isinstance(value, bytes) or not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {type(value).__name__}")
    if os.fspath(value) == "":
        raise ValueError(f"{name}: {EMPTY_PATH}")
    return value


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


def is_stage(name: str, prefix: str = "") -> bool:
    """Whether the directory entry ``name`` is what a :func:`staged_folder` writer of a folder whose
    name starts with ``prefix`` left when it was killed (its new folder, or the old one it replaced)."""
    return re.fullmatch(rf"\.{re.escape(prefix)}.*\.[0-9a-f]{{8}}\.(tmp|old)", name) is not None


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


# ----------------------------------------------------------------------------- folders
class FolderInUseError(OSError):
    """Another living process is writing the same folder (raised with a message only: ``errno`` is None)."""


def new_file_mode(directory: bool = False) -> int:
    """The permissions a new file (``0o666``) or directory (``0o777``) gets under the current umask."""
    mask = None
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    mask = int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    if mask is None:  # no /proc: read it by setting it (and back at once)
        mask = os.umask(0o022)
        os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


def _lock(path: str) -> Optional[int]:
    """An exclusive ``flock`` on the directory ``path``: its descriptor, or None when a living process
    holds it (the kernel frees it when that process dies, even on SIGKILL)."""
    import fcntl

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _exchange(a: str, b: str) -> None:
    """Swap the directory entries ``a`` and ``b`` in one atomic step (Linux ``renameat2``); an
    ``OSError`` with ``ENOSYS`` / ``EINVAL`` where the system or the file system cannot."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), a, None, b)


def _remove(path: str) -> None:
    """Delete one entry: a link or file is unlinked, a directory removed with its contents (links inside
    unlinked, never followed)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _link_tree(src: str, dst: str, linked: Optional[Dict[str, Tuple[int, int]]] = None, rel: str = "") -> None:
    """A copy of the entry ``src`` at ``dst`` that costs no space: files hard-linked (copied where the file
    system cannot link), directories recreated, links recreated (never followed); other kinds skipped, and
    so is an entry that another process removes meanwhile. ``linked``: each file or link copied, by its
    path ``rel``, gets ``(inode of src, inode of dst)`` (to tell later whether either was replaced)."""
    try:
        st = os.lstat(src)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(src), dst)
        elif stat.S_ISDIR(st.st_mode):
            os.mkdir(dst)
            for e in list(os.scandir(src)):
                _link_tree(e.path, os.path.join(dst, e.name), linked, os.path.join(rel, e.name))
            os.chmod(dst, stat.S_IMODE(st.st_mode))
            return
        elif stat.S_ISREG(st.st_mode):
            try:
                os.link(src, dst, follow_symlinks=False)
            except FileNotFoundError:
                return
            except OSError:
                shutil.copy2(src, dst, follow_symlinks=False)
        else:
            return
        if linked is not None:
            linked[rel] = (st.st_ino, os.lstat(dst).st_ino)
    except FileNotFoundError:
        pass


def _fsync(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _settle(stage: str) -> None:
    """The writer's files get the mode of a new file (``safetensors`` writes 0o600), and reach the disk."""
    file_mode, dir_mode = new_file_mode(), new_file_mode(directory=True)
    for dirpath, dirnames, filenames in os.walk(stage):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), dir_mode)
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, file_mode)
                _fsync(p)


def _carry(old: str, new: str, keep: Callable[[str], bool], move: bool = False,
           linked: Optional[Dict[str, Tuple[int, int]]] = None) -> None:
    """The entries of ``old`` that ``new`` lacks and ``keep`` accepts: linked into ``new``
    (:func:`_link_tree`, recording into ``linked``), or, with ``move``, renamed into it."""
    for e in os.scandir(old):
        dst = os.path.join(new, e.name)
        if keep(e.name) and not os.path.lexists(dst):
            if move:
                os.rename(e.path, dst)
            else:
                _link_tree(e.path, dst, linked, e.name)


def _tree(root: str) -> FrozenSet[str]:
    """The relative paths of every entry below the folder ``root`` (links never followed)."""
    found = set()

    def walk(path: str, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for e in list(os.scandir(path)):
                r = os.path.join(rel, e.name)
                found.add(r)
                if e.is_dir(follow_symlinks=False):
                    walk(e.path, r)

    walk(root, "")
    return frozenset(found)


def _replaced(linked: Dict[str, Tuple[int, int]], rel: str, old: str, new: str) -> bool:
    """Whether the old folder's file or link ``old`` (at ``rel``) was replaced by another writer after
    :func:`_link_tree` copied it to ``new``, which still holds that copy."""
    return rel in linked and os.lstat(old).st_ino != linked[rel][0] and os.lstat(new).st_ino == linked[rel][1]


def _carry_back(old: str, new: str, keep: Callable[[str], bool], known: FrozenSet[str],
                linked: Dict[str, Tuple[int, int]], rel: str = "") -> None:
    """After the swap, what the old folder ``old`` holds and ``new`` lacks goes into ``new``: every entry
    added while the new folder was written (not in ``known``, the old tree when the stage began:
    :func:`_tree`), at any depth, and the top-level entries ``keep`` accepts. So what another writer
    added during the save is kept, in subfolders too, and what the new folder dropped stays dropped.
    A file or link another writer replaced after it was linked into the new folder (``linked``, from
    :func:`_link_tree`; the new folder's copy untouched) is replaced by its new version too.
    Into ``new``'s real folders only, links never followed; moved, not linked (a file still open keeps
    being written in place); an entry removed meanwhile is skipped."""
    try:
        entries = list(os.scandir(old))
    except (FileNotFoundError, NotADirectoryError):
        return
    for e in entries:
        r = os.path.join(rel, e.name)
        dst = os.path.join(new, e.name)
        with contextlib.suppress(FileNotFoundError):
            if not os.path.lexists(dst):
                if r not in known or (not rel and keep(e.name)):
                    os.rename(e.path, dst)
            elif e.is_dir(follow_symlinks=False):
                if os.path.isdir(dst) and not os.path.islink(dst):
                    _carry_back(e.path, dst, keep, known, linked, r)
            elif _replaced(linked, r, e.path, dst):
                os.replace(e.path, dst)


def _leftovers(dest: Path) -> Iterator[str]:
    """The stages of ``dest`` in its parent (``.NAME.<random>.tmp``), and their old counterparts."""
    for e in os.scandir(dest.parent):
        if is_temporary(e.name, dest.name) or re.fullmatch(rf"\.{re.escape(dest.name)}\.[0-9a-f]{{8}}\.old", e.name):
            if e.is_dir(follow_symlinks=False):
                yield e.path


def folder_writer(dest: Union[str, Path]) -> Optional[str]:
    """The name of the new folder a living :func:`staged_folder` writer of ``dest`` is writing, or None."""
    dest = Path(os.path.abspath(dest))
    if not dest.name or not dest.parent.is_dir():
        return None
    for path in _leftovers(dest):
        try:
            fd = _lock(path)
        except OSError:  # gone meanwhile
            continue
        if fd is None:
            return os.path.basename(path)
        os.close(fd)
    return None


def _clear_leftovers(dest: Path, own: str, keep: Callable[[str], bool]) -> None:
    """Remove what killed writers of ``dest`` left (their user entries the folder lacks moved back in
    first: nothing of the user's goes with them). A stage a living writer holds is an error, unless
    that writer will refuse itself when it sees this one (the names decide, so that of two writers
    starting together one goes on); two that both go on each swap in a whole folder, the last wins."""
    for path in _leftovers(dest):
        if path == own:
            continue
        fd = _lock(path)
        if fd is None and os.path.basename(path) > os.path.basename(own):
            continue
        if fd is None:
            raise FolderInUseError(f"{str(dest)!r} is being written by another process (its new files are in "
                                   f"{os.path.basename(path)!r}); wait for it to finish, or write elsewhere")
        try:
            if path.endswith(".old") and not os.path.lexists(dest):
                os.rename(path, dest)  # killed between the two renames of a system without an exchange
                continue
            if os.path.isdir(dest) and not os.path.islink(dest):
                _carry(path, str(dest), keep, move=True)
            _remove(path)
        finally:
            os.close(fd)


#: temporaries of an interrupted in-place write: atomic_write's ``.NAME.<random>.tmp``, safetensors' ``.tmpXXXXXX``
_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{8}\.tmp|\.tmp[A-Za-z0-9_]{6}")


def _new_stage(dest: Path):
    """A new empty directory ``.NAME.<random>.tmp`` beside ``dest``, locked: ``(path, descriptor)``."""
    for _ in range(100):
        stage = str(dest.parent / f".{dest.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.mkdir(stage, 0o777)
            fd = _lock(stage)
        except (FileExistsError, FileNotFoundError):  # taken, or removed at once by a writer clearing leftovers
            continue
        if fd is not None:
            return stage, fd
    raise FileExistsError(f"no free temporary name beside {str(dest)!r}")


def _swap_in(stage: str, dest: Path, keep: Callable[[str], bool], known: FrozenSet[str],
             linked: Dict[str, Tuple[int, int]]) -> None:
    """Put the folder ``stage`` at ``dest`` (the old ``dest`` then at ``stage``), atomically where the
    system can exchange two names; else with two renames (the old one kept as ``.NAME.<random>.old``
    until the new one is in place), or, for a mount point, entry by entry (an old subfolder's entries
    added meanwhile carried into its replacement first: :func:`_carry_back`)."""
    if not os.path.lexists(dest):
        os.rename(stage, dest)
        return
    try:
        _exchange(stage, str(dest))
        return
    except OSError as err:
        if err.errno not in (errno.ENOSYS, errno.EINVAL, errno.EBUSY, errno.EXDEV):
            raise
        busy = err.errno == errno.EBUSY
    if busy:  # a mount point cannot be renamed: its entries are replaced one by one (not atomic)
        new = set(os.listdir(stage))
        for e in sorted(os.scandir(stage), key=lambda e: e.name == "config.json"):
            target = dest / e.name
            if os.path.isdir(target) and not os.path.islink(target):
                if e.is_dir(follow_symlinks=False):
                    _carry_back(str(target), e.path, keep, known, linked, rel=e.name)
                shutil.rmtree(target)
            elif os.path.lexists(target) and _replaced(linked, e.name, str(target), e.path):
                continue  # the newer version stays
            os.replace(e.path, target)
        for e in os.scandir(dest):  # what the new folder does not hold goes with the stage
            if e.name not in new:
                os.rename(e.path, os.path.join(stage, e.name))
        return
    old = stage[: -len(".tmp")] + ".old"
    os.rename(dest, old)
    os.rename(stage, dest)
    os.rename(old, stage)


@contextlib.contextmanager
def staged_folder(dest: Union[str, Path], *, keep: Union[bool, Callable[[str], bool]] = True) -> Iterator[Path]:
    """Yields a new empty folder to write ``dest``'s new contents into; when the block ends without an
    exception, that folder takes the place of ``dest`` as one unit (see the module docstring).

    ``keep``: which entries of the old ``dest`` the new folder takes over when it has none of that name
    (hard links, so the user's other files stay): ``True`` all, ``False`` none, or a predicate on the
    name. An entry another process adds to the old folder while the new one is written is kept
    whatever ``keep`` says, in subfolders too (also in a subfolder the new folder writes itself, whose
    earlier entries are dropped). Written files get the mode of a
    new file under the umask; the folder keeps the old one's mode. A link at ``dest`` is replaced,
    never written through. On failure ``dest`` is untouched and the new folder removed."""
    dest = Path(os.path.abspath(dest))
    if os.path.lexists(dest) and not os.path.islink(dest) and not os.path.isdir(dest):
        raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory", str(dest))
    if not dest.name:
        raise ValueError(f"cannot replace the root directory {str(dest)!r}")
    keep_fn: Callable[[str], bool] = keep if callable(keep) else (lambda _n, k=bool(keep): k)
    carried = lambda n: keep_fn(n) and not _TEMPORARY.fullmatch(n)  # noqa: E731
    dest.parent.mkdir(parents=True, exist_ok=True)
    stage, fd = _new_stage(dest)
    try:
        _clear_leftovers(dest, stage, carried)
        known = _tree(str(dest)) if os.path.isdir(dest) and not os.path.islink(dest) else frozenset()
        linked: Dict[str, Tuple[int, int]] = {}
        yield Path(stage)
        _settle(stage)
        real_dir = os.path.isdir(dest) and not os.path.islink(dest)
        if real_dir:
            os.chmod(stage, stat.S_IMODE(os.stat(dest).st_mode))
            _carry(str(dest), stage, carried, linked=linked)
        _fsync(stage)
        here = _is_cwd(dest)
        _swap_in(stage, dest, carried, known, linked)
        if here:
            os.chdir(dest)
        if real_dir:  # what came into the old folder meanwhile, in its subfolders too
            _carry_back(stage, str(dest), carried, known, linked)
        _fsync(str(dest.parent))
    finally:
        if fd is not None:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            if os.path.lexists(stage):
                _remove(stage)


def _is_cwd(path: Path) -> bool:
    try:
        return os.path.samefile(path, os.getcwd())
    except OSError:
        return False


def replace_folder(dest: Union[str, Path], write: Callable[[Path], Any], *,
                   keep: Union[bool, Callable[[str], bool]] = True) -> Path:
    """``write(folder)`` into a new folder that then replaces ``dest`` as one unit
    (:func:`staged_folder`); returns ``dest``."""
    with staged_folder(dest, keep=keep) as stage:
        write(stage)
    return Path(dest)
