"""Writing a directory so that readers see the old one or the complete new one, never a part.

Model directories (an exported student, a fine-tuned classifier, a pulled model, a checkpoint's
``hf/`` files) are read by other processes and other users: a half-written one must never be
visible under its final name, and its permissions must not depend on how it was made.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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
