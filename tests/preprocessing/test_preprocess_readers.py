"""Streaming readers: formats, compressions, and every kind of bad input, counted."""

import bz2
import gzip
import json
import random
import re
import tracemalloc
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from preprocessing.readers import ReadOptions, detect_format, iter_lines, looks_binary, read_documents

DOCS = [f"Document number {i} says something useful about streaming readers." for i in range(5)]


def read(path: Path, **options) -> tuple[list[str], Counter]:
    counts: Counter = Counter()
    return list(read_documents(str(path), ReadOptions(**options), counts)), counts


def jsonl_bytes(docs: list[str]) -> bytes:
    return b"".join(json.dumps({"text": d, "id": i}).encode() + b"\n" for i, d in enumerate(docs))


COMPRESS = {"": lambda b: b, ".gz": gzip.compress, ".bz2": lambda b: bz2.compress(b, 1), ".zst": zstandard.compress}


@pytest.mark.parametrize("suffix", list(COMPRESS))
def test_jsonl_and_txt_in_every_compression(tmp_path, suffix):
    (tmp_path / f"a.jsonl{suffix}").write_bytes(COMPRESS[suffix](jsonl_bytes(DOCS)))
    (tmp_path / f"a.txt{suffix}").write_bytes(COMPRESS[suffix]("\n\n \n".join(DOCS).encode() + b"\n"))
    for name in (f"a.jsonl{suffix}", f"a.txt{suffix}"):
        docs, counts = read(tmp_path / name)
        assert docs == DOCS
        assert counts["documents.read"] == len(DOCS)
        assert counts["files.read"] == 1
        assert counts["input_bytes"] > 0


def test_txt_documents_are_separated_by_blank_lines(tmp_path):
    path = tmp_path / "b.txt"
    path.write_text("first line\nsame doc\n\n\nsecond doc\n   \nthird\n")
    assert read(path)[0] == ["first line\nsame doc", "second doc", "third"]


def test_parquet_column_with_nulls_and_a_missing_or_non_string_column(tmp_path):
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": [DOCS[0], None, DOCS[1]], "n": [1, 2, 3]}), good)
    docs, counts = read(good)
    assert docs == DOCS[:2]
    assert counts["documents.read"] == 3 and counts["documents.dropped.null_text"] == 1

    other = tmp_path / "other.parquet.gz"
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.table({"body": ["x", "y"]}), buffer)
    other.write_bytes(gzip.compress(buffer.getvalue().to_pybytes()))
    docs, counts = read(other)
    assert docs == [] and counts["documents.dropped.missing_text_field"] == 2

    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), numbers)
    assert read(numbers)[1]["documents.dropped.non_string_text"] == 2

    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(good.read_bytes()[:100])
    assert read(corrupt)[1]["files.corrupt"] == 1


def test_bad_jsonl_records_are_counted_per_reason(tmp_path):
    lines = [
        json.dumps({"text": DOCS[0]}).encode(),
        b'{"text": "broken',
        b"[1, 2, 3]",
        json.dumps({"id": 1}).encode(),
        json.dumps({"text": None}).encode(),
        json.dumps({"text": 42}).encode(),
        b'{"text": "caf\xe9 latin-1"}',
        b"",
        json.dumps({"text": "x" * 500}).encode(),
        json.dumps({"text": DOCS[1]}).encode(),
    ]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines))
    docs, counts = read(path, max_doc_chars=100)
    assert docs == [DOCS[0], DOCS[1]]
    dropped = {k.removeprefix("documents.dropped."): v for k, v in counts.items() if "dropped" in k}
    assert dropped == {
        "malformed_json": 2,
        "missing_text_field": 1,
        "null_text": 1,
        "non_string_text": 1,
        "invalid_utf8": 1,
        "too_long": 1,
    }
    assert counts["documents.read"] == 9  # the blank line is not a record

    nested = tmp_path / "nested.jsonl"  # '[' nested past the stack: json raises RecursionError, not ValueError
    nested.write_bytes(b"\n".join([lines[0], b"[" * 100_000, lines[-1]]))
    docs, counts = read(nested)
    assert docs == [DOCS[0], DOCS[1]] and counts["documents.dropped.malformed_json"] == 1

    docs, counts = read(path, max_doc_chars=100, invalid_utf8="replace")
    assert "caf\ufffd latin-1" in docs
    assert counts["documents.repaired.invalid_utf8"] == 1


def test_a_byte_order_mark_is_not_part_of_the_first_document(tmp_path):
    """It once dropped a file's first JSON record as malformed, and stayed in a text file's first document."""
    bom = b"\xef\xbb\xbf"
    (tmp_path / "bom.jsonl").write_bytes(bom + jsonl_bytes(DOCS[:2]))
    assert read(tmp_path / "bom.jsonl")[0] == DOCS[:2]
    (tmp_path / "bom.txt").write_bytes(bom + DOCS[0].encode())
    assert read(tmp_path / "bom.txt")[0] == [DOCS[0]]


def test_empty_binary_and_truncated_files(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert read(tmp_path / "empty.jsonl")[1]["files.empty"] == 1
    (tmp_path / "empty.parquet").write_bytes(b"")  # empty as the text formats are, not corrupt
    assert read(tmp_path / "empty.parquet")[1]["files.empty"] == 1
    (tmp_path / "bom-only.txt").write_bytes(b"\xef\xbb\xbf")
    assert read(tmp_path / "bom-only.txt")[1]["files.empty"] == 1

    (tmp_path / "image.txt").write_bytes(random.Random(0).randbytes(4096))
    docs, counts = read(tmp_path / "image.txt")
    assert docs == [] and counts["files.binary"] == 1

    many = [f"{d} (copy {i})" for i in range(8000) for d in DOCS[:1]]  # several bz2 blocks
    for suffix in (".gz", ".bz2", ".zst"):
        data = COMPRESS[suffix](jsonl_bytes(many))
        path = tmp_path / f"cut.jsonl{suffix}"
        path.write_bytes(data[: len(data) // 2])
        docs, counts = read(path)
        assert counts["files.truncated"] == 1, suffix
        assert 0 < len(docs) < len(many), suffix
        assert docs == many[: len(docs)], suffix


def test_text_with_a_few_nuls_is_not_binary():
    assert not looks_binary(b"hello\x00 world, this is text with one NUL byte in it")
    assert looks_binary(b"\x00\x01\x02\x03text")
    assert not looks_binary("ünïcödé text".encode())


def test_detect_format():
    assert detect_format("gs://bucket/dir/x.jsonl.zst") == ("jsonl", "zst")
    assert detect_format("/a/b.c/x.txt") == ("txt", None)
    assert detect_format("x.parquet.gz") == ("parquet", "gz")
    for bad in ("x.csv", "x.gz", "noext"):
        with pytest.raises(ValueError, match="cannot tell the format"):
            detect_format(bad)


def test_a_100_mb_line_is_streamed_not_held(tmp_path):
    """The line splitter skips an over-long line chunk by chunk: peak memory stays near one chunk."""
    chunk = b"a" * (1 << 20)

    def chunks():
        yield b'{"text": "short doc before"}\n{"text": "'
        for _ in range(100):
            yield chunk
        yield b'"}\n{"text": "short doc after"}\n'

    tracemalloc.start()
    lines = list(iter_lines(chunks(), limit=12 * 1000 + 65536))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert lines == [b'{"text": "short doc before"}', None, b'{"text": "short doc after"}']
    assert peak < 8 * (1 << 20)


def test_long_single_line_in_a_file_is_dropped_and_reading_goes_on(tmp_path):
    path = tmp_path / "long.txt.gz"
    path.write_bytes(gzip.compress(b"before\n\n" + b"word " * 600_000 + b"\n\nafter this\n"))
    docs, counts = read(path, max_doc_chars=1000)
    assert docs == ["before", "after this"]
    assert counts["documents.dropped.too_long"] == 1 and counts["documents.read"] == 3


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_a_long_file_reports_its_progress_on_disk_while_it_is_read(tmp_path, suffix, caplog):
    """The progress line of a multi-GB file, at interval 0: one per chunk, rising to the file's end."""
    from preprocessing.progress import FileProgress

    rng = random.Random(0)
    docs = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(200)) for _ in range(3000)]
    path = tmp_path / f"long.jsonl{suffix}"
    path.write_bytes(COMPRESS[suffix](jsonl_bytes(docs)))  # ~3.6 MB decompressed: several 1 MB chunks
    counts: Counter = Counter()
    with caplog.at_level("INFO", logger="preprocessing"):
        read_back = list(
            read_documents(str(path), ReadOptions(), counts, FileProgress(str(path), path.stat().st_size, counts, 0))
        )
    assert read_back == docs
    percents = [int(m) for m in re.findall(r"reading \S+long\.jsonl\S*: (\d+)% of its [\d.]+ MB on disk", caplog.text)]
    assert len(percents) >= 3 and percents == sorted(percents) and percents[-1] == 100
    assert re.search(r"\d+ documents so far \([\d.]+ MB/s of text\)", caplog.text)


def arrow_stream(table: pa.Table, rows_per_batch: int = 2, file_format: bool = False) -> bytes:
    """``table`` as Arrow IPC stream bytes (``datasets``' ``save_to_disk`` format), or the IPC file format."""
    sink = pa.BufferOutputStream()
    with (pa.ipc.new_file if file_format else pa.ipc.new_stream)(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=rows_per_batch)
    return sink.getvalue().to_pybytes()


def test_arrow_rows_get_the_parquet_readers_checks(tmp_path):
    """Both go through one row loop: None, a missing column, non-strings, binary (UTF-8 or not), too long."""
    rows = [DOCS[0], None, "x" * 500, DOCS[1]]
    (tmp_path / "a.arrow").write_bytes(arrow_stream(pa.table({"text": rows, "id": [1, 2, 3, 4]})))
    docs, counts = read(tmp_path / "a.arrow", max_doc_chars=100)
    assert docs == [DOCS[0], DOCS[1]]
    assert counts["documents.read"] == 4
    assert counts["documents.dropped.null_text"] == counts["documents.dropped.too_long"] == 1
    assert counts["input_bytes"] == len(DOCS[0]) + 500 + len(DOCS[1])

    (tmp_path / "body.arrow").write_bytes(arrow_stream(pa.table({"body": ["x", "y", "z"]})))
    assert read(tmp_path / "body.arrow")[1]["documents.dropped.missing_text_field"] == 3
    (tmp_path / "numbers.arrow").write_bytes(arrow_stream(pa.table({"text": [1, 2]})))
    assert read(tmp_path / "numbers.arrow")[1]["documents.dropped.non_string_text"] == 2

    binary = pa.table({"text": pa.array([DOCS[2].encode(), b"caf\xe9 latin-1", "ünï".encode()], pa.binary())})
    (tmp_path / "binary.arrow").write_bytes(arrow_stream(binary))
    docs, counts = read(tmp_path / "binary.arrow")
    assert docs == [DOCS[2], "ünï"] and counts["documents.dropped.invalid_utf8"] == 1
    pq.write_table(binary, tmp_path / "binary.parquet")
    assert read(tmp_path / "binary.parquet") == (docs, counts)


@pytest.mark.parametrize("suffix", list(COMPRESS))
def test_arrow_stream_and_file_formats_in_every_compression(tmp_path, suffix):
    table = pa.table({"text": DOCS, "id": list(range(len(DOCS)))})
    for name, data in (("stream", arrow_stream(table)), ("file", arrow_stream(table, file_format=True))):
        path = tmp_path / f"{name}.arrow{suffix}"
        path.write_bytes(COMPRESS[suffix](data))
        docs, counts = read(path)
        assert docs == DOCS, name
        assert counts["documents.read"] == len(DOCS) and counts["files.read"] == 1, name


def test_empty_corrupt_and_truncated_arrow_files(tmp_path):
    (tmp_path / "empty.arrow").write_bytes(b"")
    assert read(tmp_path / "empty.arrow")[1]["files.empty"] == 1
    (tmp_path / "junk.arrow").write_bytes(random.Random(0).randbytes(4096))
    docs, counts = read(tmp_path / "junk.arrow")
    assert docs == [] and counts["files.corrupt"] == 1

    many = [f"{DOCS[0]} (copy {i})" for i in range(8000)]
    data = arrow_stream(pa.table({"text": many}), rows_per_batch=500)
    (tmp_path / "cut.arrow").write_bytes(data[: len(data) // 2])
    docs, counts = read(tmp_path / "cut.arrow")
    assert counts["files.corrupt"] == 1 and 0 < len(docs) < len(many) and docs == many[: len(docs)]
    (tmp_path / "not-gzip.arrow.gz").write_bytes(data[:1000])  # the decompressor fails on its first read
    assert read(tmp_path / "not-gzip.arrow.gz")[1]["files.truncated"] == 1
    for suffix in (".gz", ".bz2", ".zst"):
        packed = COMPRESS[suffix](data)
        path = tmp_path / f"cut.arrow{suffix}"
        path.write_bytes(packed[: len(packed) // 2])
        docs, counts = read(path)
        assert counts["files.truncated"] == 1 and "files.corrupt" not in counts, suffix
        assert 0 < len(docs) < len(many) and docs == many[: len(docs)], suffix


def test_an_arrow_file_is_streamed_batch_by_batch_from_its_handle(tmp_path):
    """The reader reports its position in the file after each record batch: it reads the file as it goes, one
    batch at a time, rather than loading it whole before the first document."""
    docs = [f"{DOCS[0]} (copy {i})" for i in range(20_000)]
    path = tmp_path / "big.arrow"
    path.write_bytes(arrow_stream(pa.table({"text": docs}), rows_per_batch=1000))
    positions: list[int] = []
    read_back = []
    for text in read_documents(str(path), ReadOptions(), Counter(), positions.append):
        read_back.append(text)
        if len(read_back) == 1000:  # the first batch is out: at most a batch or two was read of the file
            assert max(positions, default=0) < path.stat().st_size / 4
    assert read_back == docs
    assert len(positions) == 20 and positions == sorted(positions)
    assert 0 <= path.stat().st_size - positions[-1] <= 8  # all but the stream's end-of-stream marker
