"""Writing a directory so that readers see the old one or the complete new one, never a part.

Model directories (an exported student, a fine-tuned classifier, a pulled model, a checkpoint's
``hf/`` files) are read by other processes and other users: a half-written one must never be
visible under its final name, and its permissions must not depend on how it was made.

A write that runs out of room (:func:`explaining_full_disk`) fails with :class:`OutOfSpace`, one message that
names what was being written, where, the bytes it needed and those free, instead of a library's traceback.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space, over quota, over the file-size limit


class OutOfSpace(OSError):
    """A write that ran out of room on its filesystem (see :func:`explaining_full_disk`)."""


def free_bytes(where: str | Path) -> int | None:
    """Free bytes on the local filesystem holding ``where`` (its nearest existing ancestor); None for a URL."""
    path = Path(where)
    if "://" in str(where):
        return None
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def is_full_disk(err: BaseException, where: str | Path, needed: int | None) -> bool:
    """Whether ``err`` is a write that found no room: an OSError with ENOSPC, EDQUOT or EFBIG, or a library's
    own error (torch.save's C++ writer drops the errno: "iostream error", "unexpected pos"; safetensors wraps it)
    while ``where`` has less free space than ``needed`` (1 MB if unknown): the write could not have fitted."""
    if isinstance(err, OSError):
        return err.errno in FULL
    free = free_bytes(where)
    return free is not None and free < max(needed or 0, 2**20)


@contextmanager
def explaining_full_disk(what: str, where: str | Path, needed: int | None) -> Iterator[None]:
    """Within the block, a write that runs out of room raises :class:`OutOfSpace`: ``what`` (e.g. "checkpoint
    step-00001000") into ``where`` needed about ``needed`` bytes, and this many were free. Other errors pass."""
    try:
        yield
    except Exception as err:  # writers wrap the errno their own way (torch's RuntimeError, safetensors' error)
        if not is_full_disk(err, where, needed):
            raise
        free = free_bytes(where)
        cause = os.strerror(err.errno) if isinstance(err, OSError) and err.errno else "a write failed"
        raise OutOfSpace(
            errno.ENOSPC,
            f"writing {what} into {where}: {cause.lower()}; it needs about "
            + (f"{needed:,} bytes" if needed is not None else "more room")
            + ("" if free is None else f", {free:,} bytes are free there"),
        ) from err


@contextmanager
def atomic_directory(dest: str | Path) -> Iterator[Path]:
    """Yield an empty directory beside ``dest``; when the block ends without an error, it becomes ``dest``.

    The new directory replaces an existing ``dest`` by renames on the same filesystem. On an error,
    ``dest`` is left as it was and the partial directory is removed. Directories get mode 0755 and
    files 0644: ``mkdtemp`` makes 0700, which would hide the model from the other users of a
    shared filesystem.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        yield tmp
        for path in [tmp, *tmp.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old.", dir=dest.parent))
            os.replace(dest, old / dest.name)  # dest is absent only between these two renames
            os.replace(tmp, dest)
            shutil.rmtree(old)
        else:
            os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_text_atomically(path: str | Path, text: str) -> None:
    """``path`` holds its old content or ``text``, never a torn mix (a temporary file renamed over it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
