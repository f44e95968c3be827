"""Writing a directory so that readers see the old one or the complete new one, never a part.

Model directories (an exported student, a fine-tuned classifier, a pulled model, a checkpoint's
``hf/`` files) are read by other processes and other users: a half-written one must never be
visible under its final name, and its permissions must not depend on how it was made.

A write that fails for a reason outside the program (:func:`explaining_full_disk`): no room, a refused
permission or a read-only filesystem, a path removed while it was written, fails with one message that
names what was being written, where, and for a full disk the bytes it needed and those free, instead of a
library's traceback, and what it had written removed, so that the disk is as it was before the attempt.
:func:`explain_fault` names the same faults where no block wraps the write (a Beam worker's error, found in
what the runner raised). Each is an :class:`IOFault`, or a PermissionError or FileNotFoundError, which the
command lines print as ``error: ...`` (:func:`common.cli.run_cli`).
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
    message is one line naming what and where (and, for a full disk, the bytes)."""


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


def size_text(n: float) -> str:
    """Bytes as a person reads them at a glance: ``880 kB``, ``33.4 MB``, ``1.2 GB`` (decimal units)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    raise AssertionError("unreachable")


def write_fault(err: BaseException, where: str | Path, needed: int | None) -> str | None:
    """What stopped a write into ``where``: ``"full"``, ``"refused"``, ``"vanished"``, or None (not such a fault).

    An OSError says by its errno: ENOSPC, EDQUOT or EFBIG is full; EACCES, EPERM or EROFS refused; ENOENT
    vanished, unless ``where`` has less room than ``needed`` (another rank removed its share of a save that ran
    out of room: the full disk is the story). A library's own error (torch.save's C++ writer drops the errno:
    "iostream error", "unexpected pos", "cannot be opened"; safetensors wraps it) is read from the filesystem:
    full when ``where`` has less free space than ``needed`` (1 MB if unknown), vanished when ``where`` is gone,
    refused when it is not writable."""
    free = free_bytes(where)
    short = free is not None and free < max(needed or 0, 2**20)
    if isinstance(err, OSError) and err.errno:
        if err.errno in FULL or (err.errno == errno.ENOENT and short):
            return "full"
        return "refused" if err.errno in REFUSED else "vanished" if err.errno == errno.ENOENT else None
    if short:
        return "full"
    if "://" in str(where):
        return None
    if not Path(where).exists():
        return "vanished"
    return None if os.access(where, os.W_OK) else "refused"


@contextmanager
def explaining_full_disk(
    what: str, where: str | Path, needed: int | None, then: str = "", partial: str | Path | None = None
) -> Iterator[None]:
    """Within the block, a write that fails for a reason the user must fix outside the program raises one line:

    * no room: :class:`OutOfSpace`, ``writing WHAT into WHERE: no space left on device; it needs about N bytes,
      F bytes are free there``;
    * a refused permission or a read-only filesystem: PermissionError, ``writing WHAT into WHERE: read-only file
      system (PATH): make it writable by this user``;
    * a path removed meanwhile: FileNotFoundError, ``writing WHAT into WHERE: no such file or directory (PATH):
      it was removed while being written``;

    each followed by ``; THEN`` when ``then`` says what is left (e.g. the checkpoint a relaunch resumes from).
    ``what`` names the stage ("checkpoint step-00001000", "the student ..."). ``partial``: the directory the
    block was writing, removed with whatever it holds before the error is raised, so that the disk is as it was
    before the attempt (a partial checkpoint would otherwise keep the space a full disk lacked); the free bytes
    are counted after. Other errors pass unchanged, ``partial`` kept (a save torn by a lost peer is the next
    save's to empty). common.cli.run_cli prints any of these as its one line, with exit status 2."""
    try:
        yield
    except Exception as err:  # writers wrap the errno their own way (torch's RuntimeError, safetensors' error)
        kind = write_fault(err, where, needed)
        if kind is None:
            raise
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        if kind != "full":
            code = err.errno if isinstance(err, OSError) and err.errno else None
            said = f"writing {what} into {where}: {(os.strerror(code) if code else 'a write failed').lower()}"
            filename = getattr(err, "filename", None)
            said += f" ({filename})" if filename else ""
            tail = f"; {then}" if then else ""
            if kind == "refused":
                raise PermissionError(code or errno.EACCES, f"{said}: make it writable by this user{tail}") from err
            raise FileNotFoundError(errno.ENOENT, f"{said}: it was removed while being written{tail}") from err
        raise out_of_space(err, what, where, needed, then) from err


def out_of_space(err: BaseException, what: str, where: str | Path, needed: int | None, then: str = "") -> OutOfSpace:
    """The one line for a write of ``what`` into ``where`` that found no room: the bytes it needed, those free
    (counted now: after any partial output was removed), then ``then``."""
    free = free_bytes(where)
    code = err.errno if isinstance(err, OSError) else None
    # A full disk's cause is its own errno; another's (a peer's cleanup removed the path) would mislead.
    cause = os.strerror(code) if code in FULL else "a write failed"
    return OutOfSpace(
        errno.ENOSPC,
        f"writing {what} into {where}: {cause.lower()}"
        + (f"; it needs about {needed:,} bytes" if needed is not None else "; it needs more room")
        + ("" if free is None else f", {free:,} bytes are free there")
        + (f"; {then}" if then else ""),
    )


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
