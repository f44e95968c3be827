"""Writing a directory so that readers see the old one or the complete new one, never a part.

Model directories (an exported student, a fine-tuned classifier, a pulled model, a checkpoint's
``hf/`` files) are read by other processes and other users: a half-written one must never be
visible under its final name, and its permissions must not depend on how it was made.

A write that runs out of room (:func:`explaining_full_disk`) fails with :class:`OutOfSpace`, one message that
names what was being written, where, the bytes it needed and those free, instead of a library's traceback.
:func:`explain_fault` does the same for the other I/O faults a user fixes rather than the code: a file that
vanished, a permission refused (a read-only filesystem included).
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
GONE = (errno.ENOENT, errno.ESTALE)  # a file or directory that is not there (ESTALE: deleted under an NFS client)
REFUSED = (errno.EACCES, errno.EPERM, errno.EROFS)  # no permission, or a filesystem (re)mounted read-only


class IOFault(OSError):
    """An I/O failure the user fixes, not the code: a full disk, a file that vanished, a permission refused. Its
    message is one line naming what and where (and, for a full disk, the bytes); the command lines print it as
    ``error: ...`` (:func:`common.cli.run_cli`)."""


class OutOfSpace(IOFault):
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


def out_of_space(err: BaseException, what: str, where: str | Path, needed: int | None) -> OutOfSpace:
    """The one line for a write of ``what`` into ``where`` that found no room: the bytes it needed, those free."""
    free = free_bytes(where)
    cause = os.strerror(err.errno) if isinstance(err, OSError) and err.errno else "a write failed"
    return OutOfSpace(
        errno.ENOSPC,
        f"writing {what} into {where}: {cause.lower()}; it needs "
        + (f"about {needed:,} bytes" if needed is not None else "more room")
        + ("" if free is None else f", {free:,} bytes are free there"),
    )


@contextmanager
def explaining_full_disk(what: str, where: str | Path, needed: int | None) -> Iterator[None]:
    """Within the block, a write that runs out of room raises :class:`OutOfSpace`: ``what`` (e.g. "checkpoint
    step-00001000") into ``where`` needed about ``needed`` bytes, and this many were free. Other errors pass."""
    try:
        yield
    except Exception as err:  # writers wrap the errno their own way (torch's RuntimeError, safetensors' error)
        if not is_full_disk(err, where, needed):
            raise
        raise out_of_space(err, what, where, needed) from err


def os_error_of(err: BaseException) -> OSError | None:
    """The OSError with an errno behind ``err``: itself, one a library error carries per path (Beam's BeamIOError,
    an OSError without an errno, keeps them in ``exception_details``), or one it was raised from."""
    pending: list[BaseException | None] = [err]
    seen: set[int] = set()
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno:
            return current
        details = getattr(current, "exception_details", None)
        pending += [*(details.values() if isinstance(details, dict) else ()), current.__cause__, current.__context__]
    return None


def explain_fault(err: BaseException, what: str, where: str | Path, needed: int | None) -> IOFault | None:
    """``err`` as one line when it is an I/O fault the user fixes, else None (a bug: let it show).

    A full disk (:data:`FULL`) is :func:`out_of_space`'s line for a write of ``what`` into ``where``; a file that
    is not there (:data:`GONE`) or a permission refused (:data:`REFUSED`) names the path the system call named,
    else ``what``. An :class:`IOFault` already made is returned as it is."""
    if isinstance(err, IOFault):
        return err
    cause = os_error_of(err)
    if cause is None:
        return None
    path = str(cause.filename) if cause.filename is not None else what
    if cause.errno in FULL:
        return out_of_space(cause, path, os.path.dirname(path) if path != what else where, needed)
    if cause.errno in GONE + REFUSED:
        return IOFault(cause.errno, f"{path}: {os.strerror(cause.errno).lower()}")
    return None


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
