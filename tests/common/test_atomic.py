"""One atomic directory writer: all or nothing, readable by everyone, replacing whole."""

from __future__ import annotations

import errno
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from common.atomic import (
    OutOfSpace,
    atomic_directory,
    explain_fault,
    explaining_full_disk,
    write_text_atomically,
)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_finished_block_publishes_the_directory_readable_by_all(tmp_path: Path) -> None:
    dest = tmp_path / "models" / "student"
    with atomic_directory(dest) as tmp:
        assert not dest.exists()  # nothing visible under the final name while writing
        (tmp / "config.json").write_text("{}")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "weights").write_bytes(b"x")
        (tmp / "sub" / "weights").chmod(0o600)
    assert mode(dest) == 0o755 and mode(dest / "sub") == 0o755  # not mkdtemp's 0700
    assert mode(dest / "config.json") == 0o644 and mode(dest / "sub" / "weights") == 0o644
    assert [p.name for p in tmp_path.joinpath("models").iterdir()] == ["student"]  # no leftovers


def test_a_new_directory_replaces_the_old_one_whole_and_a_failure_keeps_it(tmp_path: Path) -> None:
    dest = tmp_path / "student"
    with atomic_directory(dest) as tmp:
        (tmp / "old-only").write_text("1")
        (tmp / "config.json").write_text("old")
    with atomic_directory(dest) as tmp:
        (tmp / "config.json").write_text("new")
    assert sorted(p.name for p in dest.iterdir()) == ["config.json"]  # replaced, not merged
    with pytest.raises(RuntimeError), atomic_directory(dest) as tmp:
        (tmp / "config.json").write_text("partial")
        raise RuntimeError("the writer failed")
    assert (dest / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["student"]


def test_text_is_replaced_atomically(tmp_path: Path) -> None:
    path = tmp_path / "metrics.json"
    write_text_atomically(path, "a")
    write_text_atomically(path, "b")
    assert path.read_text() == "b" and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_a_full_disk_says_what_needed_how_many_bytes_and_publishes_nothing(tmp_path: Path) -> None:
    """On a real 4 MB filesystem: a plain write and torch.save (whose C++ writer drops the errno) both become one
    OutOfSpace naming the path and the bytes; the directory being written is not published, nor kept; the same
    filesystem read-only, one PermissionError naming it; other errors pass."""
    import torch
    from helpers import small_tmpfs

    with small_tmpfs(tmp_path / "disk", 4) as disk:
        needed = 6 * 2**20
        # Read-only (remounted: we are root, whom file modes do not stop; first, while no file is open for writing):
        # torch's writer drops the errno.
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        refused = rf"\[Errno 13\] writing weights into {disk}: a write failed: make it writable by this user; relaunch"
        with pytest.raises(PermissionError, match=refused), explaining_full_disk("weights", disk, 10, "relaunch"):
            torch.save(torch.zeros(4), disk / "weights.pt")
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
        said = rf"writing blob into {disk}: no space left on device; it needs about {needed:,} bytes, [\d,]+ bytes"
        with pytest.raises(OutOfSpace, match=said), explaining_full_disk("blob", disk, needed):
            (disk / "blob").write_bytes(b"\0" * needed)
        (disk / "blob").unlink()
        # What a failed write had written goes with it: the disk is as it was before the attempt.
        before = shutil.disk_usage(disk).free
        with pytest.raises(OutOfSpace), explaining_full_disk("parts", disk, needed, partial=disk / "parts"):
            (disk / "parts").mkdir()
            (disk / "parts" / "a").write_bytes(b"\0" * needed)
        assert sorted(p.name for p in disk.iterdir()) == [] and shutil.disk_usage(disk).free == before
        torn = pytest.raises(OutOfSpace, match=r"writing weights into .*: a write failed; it needs about")
        with torn, explaining_full_disk("weights", disk, needed), atomic_directory(disk / "student") as tmp:
            torch.save(torch.zeros(needed // 4), tmp / "weights.pt")
        assert sorted(p.name for p in disk.iterdir()) == []  # no student, no partial directory

    with pytest.raises(ValueError), explaining_full_disk("x", tmp_path, 1):  # room enough: not a full disk
        raise ValueError("something else")


def test_a_fault_a_library_wraps_is_named_by_its_path_and_a_bug_is_not_a_fault(tmp_path: Path) -> None:
    """Beam's FileSystems report a failed rename as a BeamIOError without an errno, the OSError of each path
    inside it: the fault is found there and named by its path. An error that is no I/O fault stays unexplained."""
    from apache_beam.io.filesystems import FileSystems

    gone = tmp_path / "gone.tar"
    with pytest.raises(OSError) as caught:
        FileSystems.rename([str(gone)], [str(tmp_path / "kept.tar")])
    assert caught.value.errno is None
    fault = explain_fault(caught.value, "the shard", tmp_path, None)
    assert fault is not None and fault.errno == errno.ENOENT
    assert fault.strerror == f"{gone}: no such file or directory"
    assert explain_fault(ValueError("a bug"), "the shard", tmp_path, 1) is None
