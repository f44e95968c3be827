"""Writing one WebDataset shard: a plain tar of ``<key>.input_ids.npy`` members.

Members carry fixed metadata (mtime 0, uid/gid 0, no owner names, mode 0644, ustar format)
so the same sequences always give the same bytes. The tar is built in memory (a shard is
``samples_per_shard * max_seq_len`` ids), written to a temporary name next to its final
path and renamed, so a reader never sees a half-written shard.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import uuid
from typing import Any

import numpy as np
from apache_beam.io.filesystems import FileSystems


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.tar"


def sample_key(split: str, shard: int, sample: int) -> str:
    return f"{split}-{shard:06d}-{sample:06d}"


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def tar_bytes(split: str, shard: int, sequences: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    # Every row has the same dtype and shape, hence the same .npy header: build it once.
    header = npy_bytes(sequences[0])[: -sequences[0].nbytes] if len(sequences) else b""
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, row in enumerate(sequences):
            payload = header + row.tobytes()
            info = tarfile.TarInfo(f"{sample_key(split, shard, i)}.input_ids.npy")
            info.size = len(payload)
            info.mtime = 0
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(payload))
    return buffer.getvalue()


def write_atomic(path: str, data: bytes) -> None:
    """Write to ``path.tmp-<uuid>`` then rename, through Beam's FileSystems (any filesystem)."""
    temp = f"{path}.tmp-{uuid.uuid4().hex}"
    with FileSystems.create(temp) as handle:
        handle.write(data)
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
    }
