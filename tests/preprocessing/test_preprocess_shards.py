"""Shard tars (byte-stable, standard) and the manifest summary."""

import io
import tarfile

import numpy as np

from preprocessing.manifest import build_manifest, summary_table
from preprocessing.shards import npy_bytes, sample_key, tar_bytes, write_shard


def test_tar_bytes_are_stable_and_standard():
    sequences = np.arange(24, dtype=np.uint16).reshape(3, 8)
    data = tar_bytes("train", 5, sequences)
    assert data == tar_bytes("train", 5, sequences.copy())
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == [f"train-000005-00000{i}.input_ids.npy" for i in range(3)]
        assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in members} == {(0, 0, 0, "", "", 0o644)}
        loaded = np.load(io.BytesIO(tar.extractfile(members[1]).read()), allow_pickle=False)
    np.testing.assert_array_equal(loaded, sequences[1])
    assert loaded.dtype == np.uint16


def tarfile_reference(split: str, shard: int, sequences: np.ndarray) -> bytes:
    """The same shard written member by member with the standard library."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, row in enumerate(sequences):
            payload = npy_bytes(row)
            info = tarfile.TarInfo(f"{sample_key(split, shard, i)}.input_ids.npy")
            info.size, info.mtime, info.mode, info.uid, info.gid = len(payload), 0, 0o644, 0, 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(payload))
    return buffer.getvalue()


def test_tar_bytes_equal_what_tarfile_writes():
    cases = [(3, 8, np.uint16), (1, 4, np.int32), (37, 64, np.uint16), (1234, 16, np.int32), (0, 8, np.uint16)]
    for rows, width, dtype in cases:
        sequences = np.arange(rows * width, dtype=dtype).reshape(rows, width)
        assert tar_bytes("valid", 12, sequences) == tarfile_reference("valid", 12, sequences), (rows, width)


def test_write_shard_is_atomic_and_reports_its_entry(tmp_path):
    sequences = np.array([[101, 5, 6, 102], [101, 7, 102, 0]], dtype=np.uint16)
    entry = write_shard(str(tmp_path), "valid", 0, sequences, pad_id=0)
    assert entry["path"] == "valid/shard-000000.tar" and entry["samples"] == 2 and entry["tokens"] == 7
    assert sorted(p.name for p in (tmp_path / "valid").iterdir()) == ["shard-000000.tar"]


def test_summary_table_lists_every_reason():
    shards = [("train", {"path": "train/shard-000000.tar", "samples": 3, "tokens": 90, "sha256": "x"})]
    counts = {
        "documents.read": 10,
        "documents.kept": 7,
        "documents.dropped.duplicate": 2,
        "documents.dropped.too_long": 1,
        "documents.cleaned.control_chars": 4,
        "files.read": 2,
        "files.truncated": 1,
        "input_bytes": 5_000_000,
        "documents.dropped.empty": 0,
    }
    manifest = build_manifest({"vocab_size": 10}, 32, "uint16", shards, counts, {})
    assert manifest["documents"] == {
        "read": 10,
        "kept": 7,
        "dropped": {"duplicate": 2, "too_long": 1},
        "repaired": {},
        "cleaned": {"control_chars": 4},
    }
    table = summary_table(manifest, seconds=2.0)
    for text in ("documents read", "dropped: duplicate", "dropped: too_long", "files truncated", "90 / 3 / 1", "2.50"):
        assert text in table
