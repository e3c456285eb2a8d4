"""whiteformer._files: files written whole or not at all, never through a link, with the
permissions any new file gets (0o666 less the umask)."""
import os
import stat

import pytest

from whiteformer._files import atomic_write, write_text

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX modes and links")


def test_written_files_get_the_mode_of_a_new_file(tmp_path):
    """mkstemp's 0o600 made every model, config and report written by a command unreadable to the
    group and others (``config.yaml`` -rw------- beside ``metrics.jsonl`` -rw-r--r--)."""
    old = os.umask(0o022)
    try:
        write_text(tmp_path / "a.txt", "x")
        atomic_write(tmp_path / "b.bin", lambda tmp: open(tmp, "wb").write(b"y"))
        os.umask(0o077)
        write_text(tmp_path / "c.txt", "z")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "b.bin").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "c.txt").stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin", "c.txt"]


def test_a_link_is_replaced_and_a_failed_write_leaves_nothing(tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("theirs")
    (tmp_path / "out.txt").symlink_to(target)
    write_text(tmp_path / "out.txt", "mine")
    assert target.read_text() == "theirs" and not (tmp_path / "out.txt").is_symlink()

    def fail(tmp):
        open(tmp, "w").write("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(tmp_path / "out.txt", fail)
    assert (tmp_path / "out.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt", "target.txt"]


# ----------------------------------------------------------------------------- staged_folder
def _files_below(root):
    """The relative paths of every entry below ``root`` (links not followed), with a file's text."""
    return {str(p.relative_to(root)): (p.read_text() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("swap", ["exchange", "ENOSYS", "EBUSY"])
def test_a_staged_swap_keeps_what_another_writer_adds_to_a_subfolder(tmp_path, monkeypatch, swap):
    """The old folder's subfolders were rebuilt by hard links before the swap and only its top-level
    entries carried back after it: a file another process wrote into ``samples/`` in between was
    deleted with the old folder. Entries added to a subfolder the new folder writes itself are kept
    too (its own old entries are not); nothing is moved through a link."""
    import errno

    import whiteformer._files as files

    dest, outside = tmp_path / "m", tmp_path / "outside"
    for d in (dest / "samples" / "deep", dest / "own", dest / "linked", outside):
        d.mkdir(parents=True)
    (dest / "samples" / "deep" / "a.txt").write_text("a")
    (dest / "samples" / "log.txt").write_text("first")
    (dest / "notes.txt").write_text("first")
    (dest / "own" / "old.txt").write_text("the new folder drops this")
    (dest / "samples" / "out").symlink_to(outside)
    real_swap = files._swap_in

    def swap_in(stage, dest_, *args):  # another writer, between the staging and the swap
        (dest / "samples" / "deep" / "new.txt").write_text("theirs")
        (dest / "samples" / "fresh").mkdir()
        (dest / "samples" / "fresh" / "b.txt").write_text("b")
        (dest / "own" / "added.txt").write_text("theirs too")
        (dest / "linked" / "c.txt").write_text("c")
        (dest / "top.txt").write_text("top")
        for name in ("samples/log.txt", "notes.txt"):  # replaced whole (a new file renamed over it)
            files.write_text(dest / name, "second")
        return real_swap(stage, dest_, *args)

    monkeypatch.setattr(files, "_swap_in", swap_in)
    if swap != "exchange":
        def cannot(a, b):
            raise OSError(getattr(errno, swap), "cannot exchange")
        monkeypatch.setattr(files, "_exchange", cannot)
    with files.staged_folder(dest) as stage:
        (stage / "model.bin").write_text("new")
        (stage / "own").mkdir()
        (stage / "own" / "mine.txt").write_text("mine")
        (stage / "linked").symlink_to(outside)  # the new folder's link: never written through
    assert _files_below(dest) == {
        "linked": None, "model.bin": "new", "notes.txt": "second", "own": None, "own/added.txt": "theirs too",
        "own/mine.txt": "mine", "samples": None, "samples/deep": None, "samples/deep/a.txt": "a",
        "samples/deep/new.txt": "theirs", "samples/fresh": None, "samples/fresh/b.txt": "b", "samples/log.txt": "second",
        "samples/out": None, "top.txt": "top"}
    assert (dest / "samples" / "out").is_symlink() and list(outside.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "outside"]


def test_a_swap_that_keeps_no_old_entry_still_keeps_what_another_writer_adds(tmp_path, monkeypatch):
    """keep=False (a checkpoint, a run's final/): the old folder's entries go, but what another process
    writes into the folder during the save is not the old folder's: it stays."""
    import whiteformer._files as files

    dest = tmp_path / "final"
    (dest / "sub").mkdir(parents=True)
    (dest / "old.txt").write_text("old")
    (dest / "sub" / "old.txt").write_text("old")
    real_swap = files._swap_in

    def swap_in(*args):
        (dest / "theirs.txt").write_text("theirs")
        (dest / "sub" / "theirs.txt").write_text("theirs")
        return real_swap(*args)

    monkeypatch.setattr(files, "_swap_in", swap_in)
    with files.staged_folder(dest, keep=False) as stage:
        (stage / "sub").mkdir()
        (stage / "model.bin").write_text("new")
    assert _files_below(dest) == {"model.bin": "new", "sub": None, "sub/theirs.txt": "theirs", "theirs.txt": "theirs"}


#: another process writing new0.txt, new1.txt, ... (2,000 at most) into the folder's samples/ until told
#: to stop; it says when it has begun, and at the end how many it wrote (nothing in between: a full pipe
#: would block it)
_WRITER = """
import os, sys, time
folder, stop = sys.argv[1], sys.argv[2]
i = 0
while not os.path.exists(stop) and i < 2000:
    with open(os.path.join(folder, "samples", "new%d.txt" % i), "x") as f:
        f.write(str(i))
    i += 1
    if i == 1:
        print("started", flush=True)
    time.sleep(0.001)
print(i)
"""


def test_saving_a_model_folder_keeps_the_files_another_process_writes_into_it(tmp_path):
    """Repro of the loss: ``save_pretrained`` in a loop while another process writes files into the
    folder's ``samples/``: every file that process wrote is still there at the end."""
    import subprocess
    import sys

    from whiteformer import create_model

    model = create_model("tost_lm_base", vocab_size=16, dim=16, depth=1, num_heads=2, max_len=8)
    folder, stop = tmp_path / "m", tmp_path / "stop"
    model.save_pretrained(folder)
    (folder / "samples").mkdir()
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(folder), str(stop)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "started\n"
        for _ in range(60):
            model.save_pretrained(folder)
    finally:
        stop.touch()
        count, _ = writer.communicate(timeout=60)
    written = {f"new{i}.txt" for i in range(int(count))}
    assert writer.returncode == 0 and len(written) > 60
    missing = written - {p.name for p in (folder / "samples").iterdir()}
    assert not missing, f"{len(missing)} of {len(written)} lost"
    assert {p.name for p in (folder / "samples").iterdir()} == written
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
