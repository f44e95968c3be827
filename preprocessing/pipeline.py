"""The Beam graph: raw files -> deterministic, packed WebDataset shards + manifest.

Stages (each a Beam step, so any runner can spread them over workers):

1. ``TokenizeToBuckets`` (one element per input file): stream documents, clean, drop empty
   and short ones, tokenize in batches, hash the cleaned text, and append ``(hash, ids)``
   records to one spill file per hash bucket. Only spill-file names and counters travel
   through the pipeline, so no runner (including the in-memory DirectRunner) ever holds the
   corpus in memory; a bucket is ``bucket_input_bytes`` of input at most.
2. ``PackBucket`` (one element per bucket): load the bucket's records, sort by hash, drop
   exact duplicates (equal hash), split train/valid by hash, write each split's
   ``doc [SEP] doc [SEP] ...`` stream.
3. ``plan_shards`` + ``WriteShard``: from the streams' token counts alone, cut each split into
   shards of exactly ``samples_per_shard`` sequences; every shard is written independently.
4. ``finalize``: token_counts.npy, then manifest.json (published last), then the work dir goes.

Nothing depends on how elements were distributed over workers: bucket contents are sorted
by hash before use and the shard layout is a function of the sorted streams, so shards are
byte-identical for any worker count and any runner.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.transforms.window import GlobalWindows

from common.config import to_dict
from common.tokenizer import load_tokenizer
from preprocessing.cleaning import clean_text
from preprocessing.config import PreprocessConfig
from preprocessing.manifest import MANIFEST, SPLITS, TOKEN_COUNTS, build_manifest, read_manifest, write_manifest
from preprocessing.packing import (
    HASH_BYTES,
    ShardTask,
    document_hash,
    document_stream,
    encode_batch,
    hash_bucket,
    hash_split,
    pack_sequences,
    plain_tokenizer,
    plan_shards,
)
from preprocessing.preflight import RunPlan, preflight
from preprocessing.readers import ReadOptions, read_documents
from preprocessing.shards import npy_bytes, write_atomic, write_shard

log = logging.getLogger("preprocessing")
COUNTS = "counts"
WORK_DIR = ".work"
_LENGTH = struct.Struct("<I")


def _count(key: str, n: int = 1) -> None:
    """Live progress: Beam metrics, visible in runner UIs while the job runs."""
    beam.metrics.Metrics.counter("preprocessing", key).inc(n)


class TokenizeToBuckets(beam.DoFn):
    """Stage 1: input file path -> spill files ``(bucket, path)`` (+ counters on the ``counts`` tag)."""

    def __init__(self, cfg: PreprocessConfig, plan: RunPlan):
        self.cfg = cfg
        self.plan = plan
        self.read_options = ReadOptions(cfg.text_field, cfg.max_doc_chars, cfg.invalid_utf8)

    def setup(self) -> None:
        self.core = plain_tokenizer(load_tokenizer(self.cfg.tokenizer))
        self.dtype = np.dtype(self.plan.dtype)

    def start_bundle(self) -> None:
        self.writers: dict[int, tuple[str, Any]] = {}
        self.batch: list[str] = []
        self.batch_chars = 0
        self.counts: Counter = Counter()

    def process(self, path: str) -> Iterator[Any]:
        started = time.monotonic()
        counts: Counter = Counter()
        for raw in read_documents(path, self.read_options, counts):
            text, removed = clean_text(raw)
            if removed:
                counts["documents.cleaned.control_chars"] += 1
            if not text:
                counts["documents.dropped.empty"] += 1
            elif len(text) < self.cfg.min_doc_chars:
                counts["documents.dropped.too_short"] += 1
            else:
                self.batch.append(text)
                self.batch_chars += len(text)
                if self.batch_chars >= self.cfg.tokenize_batch_chars:
                    self._flush(counts)
        for key, n in counts.items():
            _count(key, n)
        self.counts.update(counts)
        seconds = time.monotonic() - started
        log.info(
            "read %s: %d documents, %.1f MB in %.1fs (%d dropped)",
            path,
            counts["documents.read"],
            counts["input_bytes"] / 1e6,
            seconds,
            sum(n for k, n in counts.items() if k.startswith("documents.dropped.")),
        )
        return iter(())

    def _flush(self, counts: Counter) -> None:
        if not self.batch:
            return
        for text, ids in zip(self.batch, encode_batch(self.core, self.batch, self.dtype), strict=True):
            if not len(ids):
                counts["documents.dropped.no_tokens"] += 1
                continue
            digest = document_hash(text, self.cfg.seed)
            self._writer(hash_bucket(digest, self.plan.num_buckets)).write(
                digest + _LENGTH.pack(len(ids)) + ids.tobytes()
            )
        self.batch, self.batch_chars = [], 0

    def _writer(self, bucket: int) -> Any:
        if bucket not in self.writers:
            path = FileSystems.join(
                self.plan.output, WORK_DIR, "spill", f"bucket-{bucket:06d}", f"{uuid.uuid4().hex}.bin"
            )
            self.writers[bucket] = (path, FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED))
        return self.writers[bucket][1]

    def finish_bundle(self) -> Iterator[Any]:
        self._flush(self.counts)
        for bucket, (path, handle) in sorted(self.writers.items()):
            handle.close()
            yield GlobalWindows.windowed_value((bucket, path))
        for key, n in sorted(self.counts.items()):
            yield beam.pvalue.TaggedOutput(COUNTS, GlobalWindows.windowed_value((key, n)))


def read_spill(path: str, dtype: np.dtype) -> Iterator[tuple[bytes, np.ndarray]]:
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as handle:
        data = handle.read()
    offset = 0
    while offset < len(data):
        digest = data[offset : offset + HASH_BYTES]
        (length,) = _LENGTH.unpack_from(data, offset + HASH_BYTES)
        offset += HASH_BYTES + _LENGTH.size
        yield digest, np.frombuffer(data, dtype=dtype, count=length, offset=offset)
        offset += length * dtype.itemsize


class PackBucket(beam.DoFn):
    """Stage 2: ``(bucket, spill paths)`` -> ``(split, (bucket, n_tokens, stream path))``."""

    def __init__(self, cfg: PreprocessConfig, plan: RunPlan):
        self.cfg = cfg
        self.plan = plan

    def process(self, element: tuple[int, list[str]]) -> Iterator[Any]:
        bucket, paths = element
        dtype = np.dtype(self.plan.dtype)
        records = sorted((record for path in sorted(paths) for record in read_spill(path, dtype)), key=lambda r: r[0])
        documents: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
        previous = None
        duplicates = 0
        for digest, ids in records:
            if digest == previous:
                duplicates += 1
                continue
            previous = digest
            documents[hash_split(digest, self.cfg.valid_fraction)].append(ids)
        for split, docs in documents.items():
            if not docs:
                continue
            stream = document_stream(docs, self.plan.sep_id, dtype)
            path = FileSystems.join(self.plan.output, WORK_DIR, "stream", split, f"bucket-{bucket:06d}.bin")
            with FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED) as handle:
                handle.write(stream.tobytes())
            yield split, (bucket, len(stream), path)
        kept = len(records) - duplicates
        _count("documents.kept", kept)
        yield beam.pvalue.TaggedOutput(COUNTS, ("documents.kept", kept))
        yield beam.pvalue.TaggedOutput(COUNTS, ("documents.dropped.duplicate", duplicates))


def read_slice(path: str, start: int, stop: int, dtype: np.dtype) -> np.ndarray:
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as handle:
        handle.seek(start * dtype.itemsize)
        data = handle.read((stop - start) * dtype.itemsize)
    return np.frombuffer(data, dtype=dtype)


class WriteShard(beam.DoFn):
    """Stage 3: a ShardTask -> ``(split, manifest entry)`` and, for train, its token counts."""

    TOKEN_COUNTS = "token_counts"

    def __init__(self, cfg: PreprocessConfig, plan: RunPlan):
        self.cfg = cfg
        self.plan = plan

    def process(self, task: ShardTask) -> Iterator[Any]:
        dtype = np.dtype(self.plan.dtype)
        stream = np.concatenate([read_slice(s.path, s.start, s.stop, dtype) for s in task.slices])
        sequences = pack_sequences(stream, self.cfg.max_seq_len, self.plan.cls_id, self.plan.pad_id)
        entry = write_shard(self.plan.output, task.split, task.index, sequences, self.plan.pad_id)
        _count(f"shards.{task.split}")
        _count(f"sequences.{task.split}", len(sequences))
        yield task.split, entry
        if task.split == "train":
            real = sequences[sequences != self.plan.pad_id].astype(np.int64)
            counts = np.bincount(real, minlength=self.plan.identity["vocab_size"])
            yield beam.pvalue.TaggedOutput(self.TOKEN_COUNTS, counts)


class SumArrays(beam.CombineFn):
    """Element-wise sum of token-count vectors (zeros when the train split is empty)."""

    def __init__(self, size: int):
        self.size = size

    def create_accumulator(self) -> np.ndarray:
        return np.zeros(self.size, dtype=np.int64)

    def add_input(self, accumulator: np.ndarray, element: np.ndarray) -> np.ndarray:
        accumulator += element
        return accumulator

    def merge_accumulators(self, accumulators: Any) -> np.ndarray:
        total = self.create_accumulator()
        for accumulator in accumulators:
            total += accumulator
        return total

    def extract_output(self, accumulator: np.ndarray) -> np.ndarray:
        return accumulator


def finalize(
    _: Any,
    cfg: PreprocessConfig,
    plan: RunPlan,
    shards: list[tuple[str, dict[str, Any]]],
    counts: dict[str, int],
    token_counts: np.ndarray,
) -> None:
    """Write token_counts.npy, then publish manifest.json, then remove the work directory."""
    write_atomic(FileSystems.join(plan.output, TOKEN_COUNTS), npy_bytes(token_counts))
    manifest = build_manifest(plan.identity, cfg.max_seq_len, plan.dtype, shards, counts, to_dict(cfg))
    write_manifest(plan.output, manifest)
    delete_tree(FileSystems.join(plan.output, WORK_DIR))


def delete_tree(path: str) -> None:
    """Delete a file or a directory tree on any filesystem (object stores: everything under the prefix)."""
    if FileSystems.get_filesystem(path).scheme() == "file":
        # Beam's local delete of a directory only sees its files, not its sub-directories.
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    elif FileSystems.exists(path) or FileSystems.match([path + "/*"])[0].metadata_list:
        FileSystems.delete([path if FileSystems.exists(path) else path + "/"])


def build_pipeline(pipeline: beam.Pipeline, cfg: PreprocessConfig, plan: RunPlan) -> None:
    stage1 = (
        pipeline
        | "InputFiles" >> beam.Create(plan.files)
        | "SpreadFiles" >> beam.Reshuffle()
        | "TokenizeToBuckets" >> beam.ParDo(TokenizeToBuckets(cfg, plan)).with_outputs(COUNTS, main="spills")
    )
    stage2 = (
        stage1.spills
        | "GroupSpills" >> beam.GroupByKey()
        | "PackBucket" >> beam.ParDo(PackBucket(cfg, plan)).with_outputs(COUNTS, main="streams")
    )
    written = (
        stage2.streams
        | "GroupStreams" >> beam.GroupByKey()
        | "PlanShards"
        >> beam.FlatMap(lambda kv: plan_shards(kv[0], list(kv[1]), cfg.max_seq_len, cfg.samples_per_shard))
        | "SpreadShards" >> beam.Reshuffle()
        | "WriteShard" >> beam.ParDo(WriteShard(cfg, plan)).with_outputs(WriteShard.TOKEN_COUNTS, main="entries")
    )
    token_counts = written.token_counts | "SumTokenCounts" >> beam.CombineGlobally(
        SumArrays(plan.identity["vocab_size"])
    )
    counts = (stage1.counts, stage2.counts) | "AllCounts" >> beam.Flatten() | "SumCounts" >> beam.CombinePerKey(sum)
    _ = (
        pipeline
        | "Finish" >> beam.Create([None])
        | "Finalize"
        >> beam.Map(
            finalize,
            cfg,
            plan,
            shards=beam.pvalue.AsList(written.entries),
            counts=beam.pvalue.AsDict(counts),
            token_counts=beam.pvalue.AsSingleton(token_counts),
        )
    )


def clear_previous(output: str) -> None:
    """Remove what an earlier (overwritten or interrupted) run left; the manifest goes first."""
    for name in (MANIFEST, TOKEN_COUNTS, *SPLITS, WORK_DIR):
        delete_tree(FileSystems.join(output, name))


def run(cfg: PreprocessConfig) -> dict[str, Any]:
    """Validate, run the pipeline to completion, print the summary; returns the manifest."""
    from preprocessing.manifest import summary_table

    logging.getLogger("apache_beam").setLevel(logging.WARNING)
    plan = preflight(cfg)
    clear_previous(plan.output)
    log.info(
        "preprocessing %d files (%.1f MB) into %s with %s",
        len(plan.files),
        plan.input_bytes / 1e6,
        plan.output,
        cfg.beam_options(),
    )
    started = time.monotonic()
    with beam.Pipeline(options=PipelineOptions(**cfg.beam_options())) as pipeline:
        build_pipeline(pipeline, cfg, plan)
    manifest = read_manifest(plan.output)
    print(summary_table(manifest, time.monotonic() - started), flush=True)
    return manifest
