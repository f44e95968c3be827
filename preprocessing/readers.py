"""Streaming document readers for .txt, .jsonl, .parquet and .arrow, each optionally .gz/.bz2/.zst.

Every file is opened through Beam's ``FileSystems``, so local paths and gs://, s3://, hdfs://
URLs read the same way. Files are read in bounded chunks: a multi-GB file or a 100 MB single
line never sits in memory whole. Once a record grows past the byte bound implied by
``max_doc_chars`` the reader stops buffering it, skips to its end and counts it as too long.

Readers yield raw document texts and record every other outcome in a ``Counter`` (keys are
``documents.read``, ``documents.dropped.<reason>``, ``documents.repaired.<reason>``,
``files.<outcome>`` and ``input_bytes``), which the pipeline turns into manifest counts.

``.arrow`` is the Arrow IPC stream format that ``datasets``' ``save_to_disk`` writes (the IPC file
format is read too): it is read record batch by record batch from the open handle, so it needs no
random access and no local copy, whatever the filesystem or compression.
"""

from __future__ import annotations

import bz2
import gzip
import json
import os
import tempfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import zstandard
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from common.atomic import explaining_full_disk

FORMATS = ("txt", "jsonl", "parquet", "arrow")
COMPRESSIONS = {"gz": "gz", "bz2": "bz2", "zst": "zst", "zstd": "zst"}
ACCEPTED = ".txt, .jsonl, .parquet or .arrow, optionally + .gz/.bz2/.zst"
CHUNK_BYTES = 1 << 20
SNIFF_BYTES = 8192
UTF8_BOM = b"\xef\xbb\xbf"
# Bytes that never occur in text: C0 controls except \t \n \v \f \r, and DEL.
_CONTROL_BYTES = bytes([*range(0, 9), *range(14, 32), 127])
_TEXT_BYTES = bytes(b for b in range(256) if b not in _CONTROL_BYTES)
_BINARY_FRACTION = 0.10
# The first bytes of the Arrow IPC *file* format; what follows them is the IPC stream format.
ARROW_FILE_MAGIC = b"ARROW1\x00\x00"
PARQUET_BATCH_ROWS = 1024
# Errors a damaged compressed stream raises part-way through.
_STREAM_ERRORS = (EOFError, OSError, zlib.error, zstandard.ZstdError)


@dataclass(frozen=True)
class ReadOptions:
    text_field: str = "text"
    max_doc_chars: int = 1_000_000
    invalid_utf8: str = "drop"

    def line_limit(self, fmt: str) -> int:
        """Bytes beyond which a record surely exceeds max_doc_chars (a char is <= 4 UTF-8 bytes,
        <= 12 bytes as a JSON surrogate-pair escape; JSON lines may carry other fields)."""
        return 4 * self.max_doc_chars if fmt == "txt" else 12 * self.max_doc_chars + 65536


def detect_format(path: str) -> tuple[str, str | None]:
    """``a/b.jsonl.gz`` -> ("jsonl", "gz"); raises ValueError for anything else."""
    parts = path.rsplit("/", 1)[-1].lower().split(".")
    compression = COMPRESSIONS.get(parts[-1]) if len(parts) > 2 else None
    fmt = parts[-2] if compression else parts[-1]
    if len(parts) < 2 or fmt not in FORMATS:
        raise ValueError(f"cannot tell the format of {path!r}: expected {ACCEPTED}")
    return fmt, compression


def read_documents(
    path: str, opts: ReadOptions, counts: Counter, on_chunk: Callable[[int], None] | None = None
) -> Iterator[str]:
    """Yield the raw text of every readable document in ``path``; count everything else.

    ``on_chunk`` is told, after each chunk of a text file or record batch of an Arrow file, how
    many bytes of the file on disk (compressed, for a compressed file) have been read: the
    reader's progress through it.
    """
    fmt, compression = detect_format(path)
    counts["files.read"] += 1
    progress = (lambda: on_chunk(raw.tell())) if on_chunk else (lambda: None)
    with (
        FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as raw,
        decompressed(raw, compression) as stream,
    ):
        if fmt == "parquet":
            yield from _read_parquet(stream, compression, opts, counts)
            return
        if fmt == "arrow":
            yield from _read_arrow(stream, compression, opts, counts, progress)
            return
        chunks = _chunks(stream, counts, progress)
        try:
            # A UTF-8 byte-order mark (some Windows editors write one) is not text: the first JSON line failed to
            # parse with it, and the first text document kept it, a different hash for deduplication.
            first = next(chunks, b"").removeprefix(UTF8_BOM) or next(chunks, b"")
            if not first:
                counts["files.empty"] += 1
                return
            if looks_binary(first[:SNIFF_BYTES]):
                counts["files.binary"] += 1
                return
            lines = iter_lines(_prepend(first, chunks), opts.line_limit(fmt))
            records = _jsonl_records(lines, opts, counts) if fmt == "jsonl" else _txt_records(lines, opts, counts)
            yield from records
        except _STREAM_ERRORS:
            if compression is None:
                raise  # an I/O error on a plain file: let the runner fail or retry the work item
            # A truncated or corrupt compressed file: everything before the damage was kept.
            counts["files.truncated"] += 1


def decompressed(raw: IO[bytes], compression: str | None) -> IO[bytes]:
    if compression == "gz":
        return gzip.GzipFile(fileobj=raw)
    if compression == "bz2":
        return bz2.BZ2File(raw)
    if compression == "zst":
        return ZstdReader(raw)
    return raw


class ZstdReader:
    """A .zst stream that, unlike ``zstandard``'s stream_reader, raises on a truncated frame."""

    def __init__(self, raw: IO[bytes], raw_chunk: int = 16384):
        self.raw = raw
        self.raw_chunk = raw_chunk
        self.decompressor = zstandard.ZstdDecompressor()
        self.frame = self.decompressor.decompressobj()
        self.frame_started = False
        self.buffer = b""

    def read1(self, size: int = CHUNK_BYTES) -> bytes:
        """Up to ``size`` bytes; what was decoded before a truncation is returned before the error."""
        while not self.buffer:
            data = self.raw.read(self.raw_chunk)
            if not data:
                if self.frame_started and not self.frame.eof:
                    raise EOFError("zstd stream ended in the middle of a frame")
                return b""
            while data:
                if self.frame.eof:
                    self.frame = self.decompressor.decompressobj()
                self.frame_started = True
                self.buffer += self.frame.decompress(data)
                data = self.frame.unused_data if self.frame.eof else b""
        out, self.buffer = self.buffer[:size], self.buffer[size:]
        return out

    def read(self, size: int = -1) -> bytes:
        parts = []
        while size < 0 or sum(map(len, parts)) < size:
            part = self.read1(CHUNK_BYTES if size < 0 else size - sum(map(len, parts)))
            if not part:
                break
            parts.append(part)
        return b"".join(parts)

    def close(self) -> None:
        self.raw.close()

    def __enter__(self) -> ZstdReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def looks_binary(sample: bytes) -> bool:
    """Binary if over 10% of the first bytes are control bytes or invalid UTF-8.

    A text file with a few NULs stays text (cleaning removes them); images, archives and
    executables do not.
    """
    if not sample:
        return False
    control = len(sample.translate(None, _TEXT_BYTES))
    invalid = sample.decode("utf-8", "replace").count("\ufffd") - sample.count("\ufffd".encode())
    return control + invalid > _BINARY_FRACTION * len(sample)


def iter_lines(chunks: Iterable[bytes], limit: int) -> Iterator[bytes | None]:
    """Split a chunk stream into lines (without ``\\n``); a line over ``limit`` bytes yields None.

    An over-long line is never held: once the pending part passes ``limit`` it is discarded
    and the rest of the line is skipped chunk by chunk, so memory stays O(limit + chunk).
    """
    pending = bytearray()
    skipping = False
    for chunk in chunks:
        pieces = chunk.split(b"\n")
        for piece in pieces[:-1]:
            if skipping:
                skipping = False
                yield None
                continue
            if pending:
                pending += piece
                piece = bytes(pending)
                pending.clear()
            yield piece if len(piece) <= limit else None
        if not skipping:
            pending += pieces[-1]
            if len(pending) > limit:
                pending.clear()
                skipping = True
    if skipping:
        yield None
    elif pending:
        yield bytes(pending)


def decode_utf8(data: bytes, opts: ReadOptions, counts: Counter) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        if opts.invalid_utf8 == "replace":
            counts["documents.repaired.invalid_utf8"] += 1
            return data.decode("utf-8", "replace")
        counts["documents.dropped.invalid_utf8"] += 1
        return None


def _chunks(stream: IO[bytes], counts: Counter, after_each: Callable[[], None]) -> Iterator[bytes]:
    """Decoded chunks; ``read1`` returns each decompression step's output, so data before a
    truncation point is delivered before the stream raises."""
    read = getattr(stream, "read1", stream.read)
    while chunk := read(CHUNK_BYTES):
        counts["input_bytes"] += len(chunk)
        yield chunk
        after_each()


def _prepend(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


def _jsonl_records(lines: Iterable[bytes | None], opts: ReadOptions, counts: Counter) -> Iterator[str]:
    for line in lines:
        if line is not None and not line.strip():
            continue  # blank lines hold no record
        counts["documents.read"] += 1
        if line is None:
            counts["documents.dropped.too_long"] += 1
            continue
        decoded = decode_utf8(line, opts, counts)
        if decoded is None:
            continue
        try:
            record = json.loads(decoded)
        except (ValueError, RecursionError):  # RecursionError: '[' nested deeper than the stack (1,000 of them do)
            counts["documents.dropped.malformed_json"] += 1
            continue
        if not isinstance(record, dict):
            counts["documents.dropped.malformed_json"] += 1
            continue
        text = checked_text(record.get(opts.text_field), opts.text_field in record, opts, counts)
        if text is not None:
            yield text


def checked_text(value: object, present: bool, opts: ReadOptions, counts: Counter) -> str | None:
    """The text field's value, or None after counting why it is unusable."""
    if not present:
        reason = "missing_text_field"
    elif value is None:
        reason = "null_text"
    elif not isinstance(value, str):
        reason = "non_string_text"
    elif len(value) > opts.max_doc_chars:
        reason = "too_long"
    else:
        return value
    counts[f"documents.dropped.{reason}"] += 1
    return None


def _txt_records(lines: Iterable[bytes | None], opts: ReadOptions, counts: Counter) -> Iterator[str]:
    """Documents are runs of non-blank lines separated by blank lines."""
    limit = opts.line_limit("txt")
    doc: list[bytes] = []
    size = 0
    too_long = False
    for line in _with_final_blank(lines):
        if line is not None and not line.strip():
            if doc or too_long:
                counts["documents.read"] += 1
                if too_long:
                    counts["documents.dropped.too_long"] += 1
                else:
                    text = decode_utf8(b"\n".join(doc), opts, counts)
                    if text is not None:
                        text = checked_text(text, True, opts, counts)
                    if text is not None:
                        yield text
            doc, size, too_long = [], 0, False
            continue
        if too_long:
            continue
        size += len(line) + 1 if line is not None else limit + 1
        if size > limit:
            doc, too_long = [], True
        else:
            doc.append(line)


def _with_final_blank(lines: Iterable[bytes | None]) -> Iterator[bytes | None]:
    yield from lines
    yield b""


def _read_parquet(stream: IO[bytes], compression: str | None, opts: ReadOptions, counts: Counter) -> Iterator[str]:
    """Parquet needs random access: a compressed file is first spooled to local temp disk."""
    with tempfile.TemporaryFile() as spool:
        if compression is not None:
            _spool(stream, spool, counts)
            spool.seek(0)
            stream = spool
        if stream.seek(0, os.SEEK_END) == 0:  # as a text file of no bytes is, not a corrupt one
            counts["files.empty"] += 1
            return
        stream.seek(0)
        try:
            parquet = pq.ParquetFile(stream)
        except (pa.ArrowException, OSError):
            counts["files.corrupt"] += 1
            return
        if opts.text_field not in parquet.schema_arrow.names:
            counts["documents.read"] += parquet.metadata.num_rows
            counts["documents.dropped.missing_text_field"] += parquet.metadata.num_rows
            return
        yield from _batch_texts(
            parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[opts.text_field]), opts, counts
        )


def _spool(stream: IO[bytes], spool: IO[bytes], counts: Counter) -> None:
    """Decompress ``stream`` into the local ``spool``. Damage part-way counts the file truncated and keeps what came
    before it; a full local disk is no damage of the file's, and fails the read (:class:`common.atomic.OutOfSpace`)
    instead of silently keeping a part of it."""
    with explaining_full_disk("a compressed Parquet file's local copy", tempfile.gettempdir(), None):
        while True:
            try:
                chunk = stream.read(CHUNK_BYTES)
            except _STREAM_ERRORS:
                counts["files.truncated"] += 1
                return
            if not chunk:
                return
            spool.write(chunk)


def _read_arrow(
    stream: IO[bytes], compression: str | None, opts: ReadOptions, counts: Counter, after_each: Callable[[], None]
) -> Iterator[str]:
    """An Arrow IPC stream (``datasets``' ``.arrow`` files), read one record batch at a time from the handle.

    The IPC file format is the stream format between a leading magic and a trailing footer, so it
    is read the same way, past its magic; the footer, after the stream's end marker, is never read."""
    # Under a compressed file an OSError is the decompressor's (a truncated or damaged stream), not the data's.
    damage = (pa.ArrowException,) if compression else (pa.ArrowException, OSError)
    try:
        head = _read_exactly(stream, len(ARROW_FILE_MAGIC))
        if not head:
            counts["files.empty"] += 1
            return
        # pyarrow reads a Python stream through read() and closed, which not every decompressor has: wrap it.
        source = _Prefixed(b"" if head == ARROW_FILE_MAGIC else head, stream)
        try:
            reader = pa.ipc.open_stream(pa.PythonFile(source, mode="r"))
        except damage:
            counts["files.corrupt"] += 1
            return
        yield from _batch_texts(_each_then(reader, after_each), opts, counts, damage)
    except _STREAM_ERRORS:
        if compression is None:
            raise  # an I/O error on a plain file: let the runner fail or retry the work item
        counts["files.truncated"] += 1  # what was read before the damage was kept


def _batch_texts(
    batches: Iterable[pa.RecordBatch],
    opts: ReadOptions,
    counts: Counter,
    damage: tuple[type[Exception], ...] = (pa.ArrowException, OSError),
) -> Iterator[str]:
    """The Parquet and Arrow readers' row loop: each batch's ``text_field`` column, value by value.

    A batch without the column counts its rows as missing the text field; a binary column is
    decoded as UTF-8 (``invalid_utf8``). A ``damage`` error part-way (a corrupt page or record
    batch) keeps what was read before it and counts the file ``files.corrupt``."""
    try:
        for batch in batches:
            index = batch.schema.get_field_index(opts.text_field)
            if index < 0:
                counts["documents.read"] += batch.num_rows
                counts["documents.dropped.missing_text_field"] += batch.num_rows
                continue
            column = batch.column(index)
            binary = pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)
            if binary or pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
                counts["input_bytes"] += pc.sum(pc.binary_length(column)).as_py() or 0  # UTF-8 bytes, nulls aside
            for value in column.to_pylist():
                counts["documents.read"] += 1
                if binary and value is not None:
                    value = decode_utf8(value, opts, counts)
                    if value is None:
                        continue
                text = checked_text(value, True, opts, counts)
                if text is not None:
                    yield text
    except damage:
        counts["files.corrupt"] += 1


def _each_then(items: Iterable[pa.RecordBatch], after_each: Callable[[], None]) -> Iterator[pa.RecordBatch]:
    for item in items:
        yield item
        after_each()


def _read_exactly(stream: IO[bytes], size: int) -> bytes:
    """``size`` bytes, fewer only at the end of the stream (a compressed stream's read may return less)."""
    data = b""
    while len(data) < size and (part := stream.read(size - len(data))):
        data += part
    return data


class _Prefixed:
    """A read-only stream: ``head`` (bytes already taken from ``rest``, or none), then the rest of ``rest``."""

    def __init__(self, head: bytes, rest: IO[bytes]):
        self.head, self.rest = head, rest
        self.closed = False

    def read(self, size: int = -1) -> bytes:
        if not self.head:
            return self.rest.read(size)
        if size < 0:
            data, self.head = self.head + self.rest.read(), b""
            return data
        data, self.head = self.head[:size], self.head[size:]
        if len(data) < size:
            data += self.rest.read(size - len(data))
        return data
