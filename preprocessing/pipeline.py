"""The Beam graph: raw files -> deterministic, packed WebDataset shards + manifest.

Stages (each a Beam step, so any runner can spread them over workers):

1. ``ReadAndClean`` (one element per input file): stream documents, clean them, drop empty and
   short ones, hash each survivor and spill ``(hash, text)`` records, grouped by hash bucket,
   into files of about ``spill_bytes``.
2. ``TokenizeBucket`` (one element per bucket; buckets are hash ranges, so they are evenly
   sized and balance the tokenization over workers whatever the file sizes): load the
   bucket's records, sort by hash, drop exact duplicates (equal hash) *before* paying for
   their tokenization, split train/valid by hash, tokenize, and write each split's
   ``doc [SEP] doc [SEP] ...`` stream.
3. ``plan_shards`` + ``WriteShard``: from the streams' token counts alone, cut each split into
   shards of exactly ``samples_per_shard`` sequences; every shard is written independently.
4. ``finalize``: token_counts.npy, then manifest.json (published last), then the work dir goes.

Bulk data moves through files under ``OUTPUT/.work`` and only file references and counters
travel through the pipeline, so no runner (the in-memory DirectRunner included) ever holds
the corpus in memory. Nothing depends on how elements were spread over workers: bucket
contents are sorted by hash before use and the shard layout is a function of the sorted
streams, so shards are byte-identical for any worker count and any runner.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import struct
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.runners.runner import PipelineRunner, create_runner

from common.atomic import free_bytes, os_error_of
from common.config import ConfigError, to_dict
from common.fast_exit import skip_final_collection
from preprocessing.cleaning import clean_text
from preprocessing.config import DIRECT_RUNNERS, RUNNER_NAMES, PreprocessConfig, runner_path
from preprocessing.faults import fault_of, stage, what_to_do
from preprocessing.manifest import (
    MANIFEST,
    SPLITS,
    TOKEN_COUNTS,
    WORK_DIR,
    build_manifest,
    read_manifest,
    summary_table,
    write_manifest,
)
from preprocessing.packing import (
    HASH_BYTES,
    ShardTask,
    core_from_json,
    document_hash,
    document_stream,
    encode_batch,
    hash_bucket,
    hash_split,
    pack_sequences,
    plan_shards,
    token_frequencies,
)
from preprocessing.preflight import RunPlan, absolute, preflight
from preprocessing.progress import FileProgress, Markers, StageWatch
from preprocessing.quiet import holding_beam_errors, show_progress_on_worker
from preprocessing.readers import ReadOptions, read_documents
from preprocessing.shards import npy_bytes, write_atomic, write_file, write_shard

log = logging.getLogger("preprocessing")
# Every step has one output, whose elements are ``(kind, value)`` pairs; the consumers of one kind
# pick it with ``of_kind``. Beam's tagged outputs (``with_outputs``) would be the textbook way, but
# the DaskRunner hands *all* of a step's outputs to every consumer of any one tag.
SPILL, COUNT, STREAM, SHARD, TOKENS = "spill", "count", "stream", "shard", "token_counts"
_LENGTH = struct.Struct("<I")


def _count(key: str, n: int = 1) -> None:
    """Live progress: Beam metrics, visible in runner UIs while the job runs."""
    beam.metrics.Metrics.counter("preprocessing", key).inc(n)


def work_path(plan: RunPlan, *parts: str) -> str:
    return FileSystems.join(plan.output, WORK_DIR, *parts)


def read_file(path: str, start: int = 0, stop: int | None = None) -> bytes:
    """Bytes ``[start, stop)`` of a work file; one that is not there is a FileNotFoundError naming it."""
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as handle:
        if start:
            handle.seek(start)
        return handle.read() if stop is None else handle.read(stop - start)


class WorkerDoFn(beam.DoFn):
    """Base of this pipeline's steps: the worker processes running them exit without the last
    garbage collection (:mod:`common.fast_exit`), which would only free memory the operating
    system reclaims anyway. The DirectRunner stops its workers one after the other, so each
    worker's final collection would add to the end of every run. They also print this package's
    progress lines themselves (:func:`show_progress_on_worker`)."""

    def setup(self) -> None:
        skip_final_collection()
        show_progress_on_worker()


def of_kind(element: tuple[str, Any], kind: str) -> Iterator[Any]:
    """The value of an element of the given kind (a FlatMap: nothing for other kinds)."""
    if element[0] == kind:
        yield element[1]


class ReadAndClean(WorkerDoFn):
    """Stage 1: an input file -> ``(SPILL, (bucket, (spill path, start byte, stop byte)))``
    references, and ``(COUNT, (counter, n))``.

    Records are buffered per bucket and spilled every ``spill_bytes``, so a reader's memory is
    bounded however large its file; only the small references travel through the shuffle.
    """

    def __init__(self, cfg: PreprocessConfig, plan: RunPlan):
        self.cfg = cfg
        self.plan = plan
        self.read_options = ReadOptions(cfg.text_field, cfg.max_doc_chars, cfg.invalid_utf8)
        self.markers = Markers(plan.output)

    def process(self, path: str) -> Iterator[Any]:
        started = time.monotonic()
        counts: Counter = Counter()
        buckets: dict[int, list[bytes]] = {}
        size = 0
        with stage("read", path):  # the input (vanished, unreadable) and its progress markers; spills: "spill"
            found = FileSystems.match([path])[0].metadata_list
            if not found:  # listed by preflight, gone since
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
            on_disk = found[0].size_in_bytes
            progress = FileProgress(path, on_disk, counts, self.cfg.progress_seconds, self.markers)
            for raw in read_documents(path, self.read_options, counts, progress):
                text, removed = clean_text(raw)
                if removed:
                    counts["documents.cleaned.control_chars"] += 1
                if not text:
                    counts["documents.dropped.empty"] += 1
                elif len(text) < self.cfg.min_doc_chars:
                    counts["documents.dropped.too_short"] += 1
                else:
                    data = text.encode("utf-8")
                    digest = document_hash(text, self.cfg.seed)
                    record = digest + _LENGTH.pack(len(data)) + data
                    buckets.setdefault(hash_bucket(digest, self.plan.num_buckets), []).append(record)
                    size += len(record)
                    if size >= self.cfg.spill_bytes:
                        yield from self._spill(buckets, size)
                        buckets, size = {}, 0
            yield from self._spill(buckets, size)
            progress.done()
        seconds = time.monotonic() - started
        log.info(
            "read %s: %d documents (%d dropped), %.1f MB of text from %.1f MB on disk (%.0f%% of the input) "
            "in %.1fs (%.1f MB/s of text)",
            path,
            counts["documents.read"],
            sum(n for k, n in counts.items() if k.startswith("documents.dropped.")),
            counts["input_bytes"] / 1e6,
            on_disk / 1e6,
            100 * on_disk / max(self.plan.input_bytes, 1),
            seconds,
            counts["input_bytes"] / 1e6 / max(seconds, 1e-9),
        )
        for key, n in sorted(counts.items()):
            _count(key, n)
            yield COUNT, (key, n)

    def _spill(
        self, buckets: dict[int, list[bytes]], size: int
    ) -> Iterator[tuple[str, tuple[int, tuple[str, int, int]]]]:
        """One spill file of ``size`` bytes, bucket after bucket; its references once it is whole."""
        if not buckets:
            return
        path = work_path(self.plan, "spill", f"{uuid.uuid4().hex}.bin")
        ordered = sorted(buckets.items())
        with stage("spill", path, size):
            write_file(path, (data for _, records in ordered for data in records), size)
        offset = 0
        for bucket, records in ordered:
            length = sum(len(record) for record in records)
            yield SPILL, (bucket, (path, offset, offset + length))
            offset += length


def parse_records(data: bytes) -> Iterator[tuple[bytes, bytes]]:
    """``(hash, UTF-8 text)`` records of a spill range."""
    offset = 0
    while offset < len(data):
        digest = data[offset : offset + HASH_BYTES]
        (length,) = _LENGTH.unpack_from(data, offset + HASH_BYTES)
        offset += HASH_BYTES + _LENGTH.size
        yield digest, data[offset : offset + length]
        offset += length


class TokenizeBucket(WorkerDoFn):
    """Stage 2: ``(bucket, spill ranges)`` -> ``(STREAM, (split, (bucket, n_tokens, stream path)))``
    and ``(COUNT, (counter, n))``."""

    def __init__(self, cfg: PreprocessConfig, plan: RunPlan):
        self.cfg = cfg
        self.plan = plan
        self.markers = Markers(plan.output)

    def setup(self) -> None:
        """Once per worker: the tokenizer resolved by preflight, as its serialised Rust core."""
        super().setup()
        with stage("tokenize", self.plan.tokenizer_file):
            self.core = core_from_json(read_file(self.plan.tokenizer_file).decode("utf-8"))
        self.dtype = np.dtype(self.plan.dtype)

    def process(self, element: tuple[int, Iterable[tuple[str, int, int]]]) -> Iterator[Any]:
        started = time.monotonic()
        bucket, ranges = element[0], list(element[1])
        streams = work_path(self.plan, "stream")
        with stage("tokenize", streams):  # the spills it reads (the call names the path) and its marker
            texts, duplicates = self._unique_texts(ranges)
            unique = sum(len(t) for t in texts.values())
            counts = Counter({"documents.dropped.duplicate": duplicates})
            tokens = 0
            for split, split_texts in texts.items():
                documents = self._tokenize(split_texts, counts)
                if not documents:
                    continue
                tokens += sum(len(ids) for ids in documents)
                stream = document_stream(documents, self.plan.sep_id, self.dtype)
                path = work_path(self.plan, "stream", split, f"bucket-{bucket:06d}.bin")
                with stage("tokenize", path, stream.nbytes):
                    write_file(path, [stream.tobytes()], stream.nbytes)
                yield STREAM, (split, (bucket, len(stream), path))
            counts["documents.kept"] = unique - counts["documents.dropped.no_tokens"]
            self.markers.mark("tokenize", f"{bucket:06d}", counts["documents.kept"], tokens)
        _count("tokens", tokens)
        for key, n in sorted(counts.items()):
            _count(key, n)
            yield COUNT, (key, n)
        seconds = time.monotonic() - started
        million_chars = sum(len(t) for split_texts in texts.values() for t in split_texts) / 1e6
        log.debug(  # one line per bucket, hundreds in a real run: the split totals are logged at INFO
            "bucket %d: %d documents (%d duplicates), %.1f M chars, %d tokens in %.1fs (%.2f M chars/s)",
            bucket,
            unique,
            counts["documents.dropped.duplicate"],
            million_chars,
            tokens,
            seconds,
            million_chars / max(seconds, 1e-9),
        )

    def _unique_texts(self, ranges: list[tuple[str, int, int]]) -> tuple[dict[str, list[str]], int]:
        """The bucket's distinct texts per split, in hash order, and how many duplicates were dropped."""
        records = [record for r in sorted(ranges) for record in parse_records(read_file(*r))]
        records.sort(key=lambda record: record[0])
        texts: dict[str, list[str]] = {split: [] for split in SPLITS}
        previous = None
        for digest, data in records:
            if digest != previous:
                texts[hash_split(digest, self.cfg.valid_fraction)].append(data.decode("utf-8"))
            previous = digest
        return texts, len(records) - sum(len(t) for t in texts.values())

    def _tokenize(self, texts: list[str], counts: Counter) -> list[np.ndarray]:
        """Token ids of every text that has any, in order; the others are counted as dropped."""
        documents = []
        for batch in batches(texts, self.cfg.tokenize_batch_chars):
            for ids in encode_batch(self.core, batch, self.dtype):
                if len(ids):
                    documents.append(ids)
                else:
                    counts["documents.dropped.no_tokens"] += 1
        return documents


def batches(texts: list[str], batch_chars: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def plan_split(element: tuple[str, Any], cfg: PreprocessConfig, plan: RunPlan) -> list[ShardTask]:
    """A split's token streams (one per bucket) -> its shard tasks; logs the split's tokenized total.

    Runs once per split, when every bucket is tokenized: the end of the tokenizing stage."""
    split, streams = element[0], list(element[1])
    tasks = plan_shards(split, streams, cfg.max_seq_len, cfg.samples_per_shard)
    tokens = sum(n_tokens for _, n_tokens, _ in streams)
    with stage("tokenize", plan.output):
        Markers(plan.output).mark("plan", split, len(tasks))
    log.info(
        "tokenized %s: %s text tokens from %d of %d hash buckets -> %d shards to write",
        split,
        f"{tokens:,}",
        len(streams),
        plan.num_buckets,
        len(tasks),
    )
    return tasks


def read_slice(path: str, start: int, stop: int, dtype: np.dtype) -> np.ndarray:
    return np.frombuffer(read_file(path, start * dtype.itemsize, stop * dtype.itemsize), dtype=dtype)


class WriteShard(WorkerDoFn):
    """Stage 4: a ShardTask -> ``(SHARD, (split, manifest entry))`` and, for train,
    ``(TOKENS, token counts)``."""

    def __init__(self, cfg: PreprocessConfig, plan: RunPlan):
        self.cfg = cfg
        self.plan = plan
        self.markers = Markers(plan.output)

    def process(self, task: ShardTask) -> Iterator[Any]:
        started = time.monotonic()
        dtype = np.dtype(self.plan.dtype)
        with stage("write", FileSystems.join(self.plan.output, task.split)):  # streams read, the shard, its marker
            stream = np.concatenate([read_slice(s.path, s.start, s.stop, dtype) for s in task.slices])
            sequences = pack_sequences(stream, self.cfg.max_seq_len, self.plan.cls_id, self.plan.pad_id)
            entry = write_shard(self.plan.output, task.split, task.index, sequences, self.plan.pad_id)
            self.markers.mark("write", task.split, f"{task.index:06d}", len(sequences))
        _count(f"shards.{task.split}")
        _count(f"sequences.{task.split}", len(sequences))
        yield SHARD, (task.split, entry)
        if task.split == "train":
            yield TOKENS, token_frequencies(sequences, self.plan.identity["vocab_size"], self.plan.pad_id)
        log.debug("shard %s: %d sequences in %.2fs", entry["path"], len(sequences), time.monotonic() - started)


class SumArrays(beam.CombineFn):
    """Element-wise sum of token-count vectors (none at all when the train split is empty: finalize
    then writes zeros)."""

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


def finalize(element: tuple[str, Iterable[tuple[str, Any]]], cfg: PreprocessConfig, plan: RunPlan) -> None:
    """Check that every shard written is there, write token_counts.npy, then publish manifest.json, then remove
    the work directory.

    ``element`` is the one group of every ``(SHARD, (split, entry))``, ``(COUNT, (counter,
    total))`` and the ``(TOKENS, summed token counts)`` (absent when the train split is empty).
    A shard removed since it was written (another run's clean-up, a user) fails the run here: a manifest
    listing it would be a dataset the trainer cannot read. The work directory's removal, once the dataset is
    published, is not the dataset's: a failure there is a warning, and the next run removes it."""
    shards, counts = [], {}
    token_counts = np.zeros(plan.identity["vocab_size"], dtype=np.int64)
    for kind, value in element[1]:
        if kind == SHARD:
            shards.append(value)
        elif kind == COUNT:
            counts[value[0]] = value[1]
        else:
            token_counts = value
    with stage("finalize", plan.output):
        check_shards_exist(plan.output, [entry for _, entry in shards])
        write_atomic(FileSystems.join(plan.output, TOKEN_COUNTS), npy_bytes(token_counts))
        manifest = build_manifest(plan.identity, cfg.max_seq_len, plan.dtype, shards, counts, to_dict(cfg))
        write_manifest(plan.output, manifest)
    try:
        delete_tree(FileSystems.join(plan.output, WORK_DIR))
    except Exception as err:  # the dataset is complete: say what is left, and succeed
        log.warning("published %s, but could not remove its work directory %s: %s", plan.output, WORK_DIR, err)


def check_shards_exist(output: str, entries: list[dict[str, Any]]) -> None:
    """Every shard of ``entries`` is in its split folder (one listing per split); else a FileNotFoundError."""
    listed: set[str] = set()
    for split in SPLITS:
        listed.update(
            m.path for m in FileSystems.match([FileSystems.join(output, split, "shard-*.tar")])[0].metadata_list
        )
    for entry in sorted(entries, key=lambda e: e["path"]):
        path = FileSystems.join(output, *entry["path"].split("/"))
        if path not in listed:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)


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
    """The graph, in transforms every Beam runner implements: ParDo/Map/FlatMap with one output,
    GroupByKey, CombinePerKey, Flatten and Reshuffle; no tagged outputs and no side inputs (the
    DaskRunner mixes the former, and computes the latter apart from the graph it runs)."""
    read = (
        pipeline
        | "InputFiles" >> beam.Create(plan.files)  # Create reshuffles: files spread over workers
        | "ReadAndClean" >> beam.ParDo(ReadAndClean(cfg, plan))
    )
    tokenized = (
        read
        | "Spills" >> beam.FlatMap(of_kind, SPILL)
        | "GroupSpills" >> beam.GroupByKey()
        | "TokenizeBucket" >> beam.ParDo(TokenizeBucket(cfg, plan))
    )
    written = (
        tokenized
        | "Streams" >> beam.FlatMap(of_kind, STREAM)
        | "GroupStreams" >> beam.GroupByKey()
        | "PlanShards" >> beam.FlatMap(plan_split, cfg, plan)
        | "SpreadShards" >> beam.Reshuffle()
        | "WriteShard" >> beam.ParDo(WriteShard(cfg, plan))
    )
    shards = written | "Shards" >> beam.Filter(lambda element: element[0] == SHARD)
    token_counts = (
        written
        | "TokenCounts" >> beam.Filter(lambda element: element[0] == TOKENS)
        | "SumTokenCounts" >> beam.CombinePerKey(SumArrays(plan.identity["vocab_size"]))
    )
    counts = (
        (read, tokenized)
        | "AllCounts" >> beam.Flatten()
        | "Counts" >> beam.FlatMap(of_kind, COUNT)
        | "SumCounts" >> beam.CombinePerKey(sum)
        | "TagCounts" >> beam.Map(lambda counter_total: (COUNT, counter_total))
    )
    _ = (
        (shards, counts, token_counts)
        | "Results" >> beam.Flatten()
        | "OneGroup" >> beam.Map(lambda element: ("dataset", element))
        | "GatherResults" >> beam.GroupByKey()
        | "Finalize" >> beam.Map(finalize, cfg, plan)
    )


def clear_previous(output: str) -> None:
    """Remove what an earlier (overwritten or interrupted) run left; the manifest goes first."""
    for name in (MANIFEST, TOKEN_COUNTS, *SPLITS, WORK_DIR):
        delete_tree(FileSystems.join(output, name))


def make_runner(options: PipelineOptions) -> PipelineRunner:
    """The runner ``beam.runner`` names; for the DirectRunner, the FnApiRunner it falls back to.

    An unknown name is a ConfigError naming the valid ones (Beam's own message), raised before
    anything is written. Creating the runner imports its module, which registers its pipeline
    options (the DaskRunner's ``address``) before :func:`preflight` checks the option names.

    Beam's DirectRunner first tries the Prism runner, a binary it downloads at run time:
    offline that is a failed download on every run, online a silent change of runner. The
    FnApiRunner, set up here as the DirectRunner sets it up (the pipeline options travel to
    the workers), runs the configured ``direct_running_mode`` and ``direct_num_workers``."""
    name = options.view_as(StandardOptions).runner
    if name not in DIRECT_RUNNERS:
        try:
            return create_runner(runner_path(name))
        except ValueError as err:  # "Unexpected pipeline runner: X. Valid values are ..."
            raise ConfigError(f"beam.runner: {err} This tool also knows {', '.join(RUNNER_NAMES)}.") from None
        except ImportError as err:  # a known runner whose extra is not installed, e.g. apache-beam[gcp]
            raise ConfigError(f"beam.runner: {name} cannot be loaded: {err}") from None
    from apache_beam.portability.api import beam_provision_api_pb2
    from apache_beam.runners.portability.fn_api_runner import fn_runner
    from apache_beam.runners.portability.portable_runner import JobServiceHandle

    # Only the options set: the workers parse them again, and some defaults (the DirectRunner's
    # store_false flags) do not parse back, which each worker logged as "Discarding unparseable args".
    encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options(drop_default=True))
    provision = beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded)
    return fn_runner.FnApiRunner(provision_info=fn_runner.ExtendedProvisionInfo(provision))


def run(cfg: PreprocessConfig, verbose: bool = False) -> dict[str, Any]:
    """Validate, run the pipeline to completion, print the summary; returns the manifest.

    A run that fails removes what it wrote (:func:`discard`). An I/O fault (a full disk, a file that vanished, a
    permission refused: :mod:`preprocessing.faults`) then ends it with one :class:`common.atomic.IOFault`: the
    stage, the path, for a full disk the bytes, the fix, and what was removed; Beam's error records and
    traceback are held back unless ``verbose`` (``--verbose``), where the runner's own exception is raised."""
    options = PipelineOptions(flags=[], **cfg.beam_options())
    runner = make_runner(options)
    # Before preflight's first look at the output: a filesystem reads its settings from the options
    # (s3_endpoint_url, credentials), which beam.Pipeline would only hand it later.
    FileSystems.set_options(options)
    output = absolute(cfg.output)
    fresh = "://" not in output and not os.path.exists(output)  # a directory this run makes, removed if it fails
    try:
        plan, tokenizer_json = preflight(cfg)
    except BaseException:
        remove_if_empty(output, fresh)  # preflight's write probe made it
        raise
    try:
        with stage("start", plan.output):
            clear_previous(plan.output)
            write_atomic(plan.tokenizer_file, tokenizer_json.encode("utf-8"))
        log.info(
            "preprocessing %d file(s), %.1f MB on disk (compressed size for compressed files), into %s "
            "(about %.1f MB there at the peak, estimated) with %s",
            len(plan.files),
            plan.input_bytes / 1e6,
            plan.output,
            plan.room / 1e6,
            cfg.beam_options(),
        )
        started = time.monotonic()
        watch = StageWatch(plan.output, len(plan.files), plan.input_bytes, plan.num_buckets, cfg.progress_seconds)
        held = nullcontext() if verbose else holding_beam_errors()
        with watch, held, beam.Pipeline(runner=runner, options=options) as pipeline:
            build_pipeline(pipeline, cfg, plan)
    except BaseException as err:
        removed = discard(plan.output, fresh)
        fault = fault_of(err)
        if verbose or fault is None or not isinstance(err, Exception):
            raise
        advice = what_to_do(fault, plan.output, plan.room, free_bytes(plan.output))
        raise type(fault)(fault.errno, f"{fault.strerror}. {advice}. {removed}.") from None
    manifest = read_manifest(plan.output)
    print(summary_table(manifest, time.monotonic() - started), flush=True)
    return manifest


def discard(output: str, fresh: bool) -> str:
    """Remove what a failed run wrote (its work directory, shards and token counts: what :func:`clear_previous`
    removes, every file of them this run's, since preflight refused foreign ones) and, if the run made it, the
    output directory; a clause saying what was removed or what is left. A published dataset (a failure after
    finalize, an interrupt) loses only its work directory."""
    published = FileSystems.exists(FileSystems.join(output, MANIFEST))
    names = [WORK_DIR] if published else [TOKEN_COUNTS, *SPLITS, WORK_DIR]
    try:
        for name in names:
            delete_tree(FileSystems.join(output, name))
        remove_if_empty(output, fresh)
    except Exception as err:
        cause = os_error_of(err)
        reason = os.strerror(cause.errno).lower() if cause is not None else str(err)
        return f"Could not remove its files under {output} ({reason}): the next run with this output= removes them"
    return f"Removed what it wrote under {output}"


def remove_if_empty(output: str, fresh: bool) -> None:
    """Remove ``output`` if this run made it (``fresh``) and it holds nothing now."""
    if fresh and os.path.isdir(output) and not os.listdir(output):
        os.rmdir(output)
