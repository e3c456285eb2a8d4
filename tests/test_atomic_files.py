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
