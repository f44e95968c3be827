"""Writing one WebDataset shard: a plain tar of ``<key>.input_ids.npy`` members.

Members carry fixed metadata (mtime 0, uid/gid 0, no owner names, mode 0644, ustar format)
so the same sequences always give the same bytes. The tar is built in memory (a shard is
``samples_per_shard * max_seq_len`` ids), written to a temporary name next to its final
path and renamed, so a reader never sees a half-written shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import tarfile
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from common.atomic import explaining_full_disk


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.tar"


def sample_key(split: str, shard: int, sample: int) -> str:
    return f"{split}-{shard:06d}-{sample:06d}"


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def tar_bytes(split: str, shard: int, sequences: np.ndarray) -> bytes:
    """The shard's bytes: exactly what ``tarfile`` writes (ustar), assembled as one array.

    Every member has the same size and metadata, so member *i* is one header template with
    its name and checksum patched in, the ``.npy`` header (the same for every row) and row *i*:
    rows of one ``uint8`` matrix, filled column block by column block for all members at once
    rather than member by member (``tarfile.addfile``, or a header patched per member), which
    would cost Python-level work per sample.
    """
    rows = len(sequences)
    if not rows:
        return _tar_end(0)
    npy_header = np.frombuffer(npy_bytes(sequences[0])[: -sequences[0].nbytes], dtype=np.uint8)
    size = len(npy_header) + sequences[0].nbytes
    member = member_bytes(size)
    template = np.frombuffer(_member_header(sample_key(split, shard, 0), size), dtype=np.uint8).copy()
    template[:100] = 0  # the name goes here
    template[148:156] = ord(" ")  # the checksum is computed with its own field as spaces
    names = [f"{sample_key(split, shard, i)}.input_ids.npy".encode() for i in range(rows)]
    name_field = np.array(names, dtype="S100").view(np.uint8).reshape(rows, 100)
    checksums = int(template.sum()) + name_field.sum(axis=1, dtype=np.int64)

    end = _tar_end(rows * member)
    flat = np.zeros(rows * member + len(end), dtype=np.uint8)
    members = flat[: rows * member].reshape(rows, member)
    members[:, : tarfile.BLOCKSIZE] = template
    members[:, :100] = name_field
    octal_digits = (checksums[:, None] >> np.arange(15, -1, -3)) & 7  # "%06o", then a NUL
    members[:, 148:154] = ord("0") + octal_digits
    members[:, 154] = 0
    data = tarfile.BLOCKSIZE + len(npy_header)
    members[:, tarfile.BLOCKSIZE : data] = npy_header
    members[:, data : tarfile.BLOCKSIZE + size] = np.ascontiguousarray(sequences).view(np.uint8).reshape(rows, -1)
    return flat.tobytes()


def member_bytes(size: int) -> int:
    """A tar member's bytes for a file of ``size`` bytes: its header block, then the data padded to whole blocks."""
    return tarfile.BLOCKSIZE + size + (-size % tarfile.BLOCKSIZE)


def sample_bytes(max_seq_len: int, dtype: np.dtype) -> int:
    """What one packed sequence takes in a shard: its ``.npy`` member (preflight sizes the output from this)."""
    return member_bytes(len(npy_bytes(np.zeros(max_seq_len, dtype=dtype))))


def _member_header(key: str, size: int) -> bytes:
    info = tarfile.TarInfo(f"{key}.input_ids.npy")
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")


def _tar_end(written: int) -> bytes:
    """Two zero blocks, then zeros up to a whole record, as tarfile closes an archive."""
    end = written + 2 * tarfile.BLOCKSIZE
    return bytes(2 * tarfile.BLOCKSIZE + (-end % tarfile.RECORDSIZE))


@contextlib.contextmanager
def _removed_on_failure(path: str) -> Iterator[None]:
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # nothing there (the create failed), or nothing to be done (read-only)
            FileSystems.delete([path])
        raise


def write_file(path: str, chunks: Iterable[bytes], size: int, name: str | None = None) -> None:
    """Write ``chunks`` (``size`` bytes in all) to ``path`` through Beam's FileSystems (any filesystem). A write
    that fails removes what it wrote, then a full disk is one :class:`common.atomic.OutOfSpace` naming ``name``
    (default: ``path``), the bytes and those free: measured once the partial file is gone, so they say by how
    much the write fell short."""
    full_disk = explaining_full_disk(name or path, FileSystems.split(path)[0], size)
    with (
        full_disk,
        _removed_on_failure(path),
        FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED) as handle,
    ):
        for chunk in chunks:
            handle.write(chunk)


def write_atomic(path: str, data: bytes) -> None:
    """Write to ``path.tmp-<uuid>`` (:func:`write_file`) then rename, so a reader never sees a part."""
    temp = f"{path}.tmp-{uuid.uuid4().hex}"
    write_file(temp, [data], len(data), name=path)
    if FileSystems.exists(path):
        FileSystems.delete([path])
    FileSystems.rename([temp], [path])


def write_shard(output: str, split: str, shard: int, sequences: np.ndarray, pad_id: int) -> dict[str, Any]:
    """Write the shard and return its manifest entry."""
    data = tar_bytes(split, shard, sequences)
    relative = f"{split}/{shard_name(shard)}"
    write_atomic(FileSystems.join(output, split, shard_name(shard)), data)
    return {
        "path": relative,
        "samples": len(sequences),
        "tokens": int(np.count_nonzero(sequences != pad_id)),
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),  # what the trainer's start check compares with a listing, reading nothing
    }
