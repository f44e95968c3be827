"""Checks that run before any Beam work: every mistake here is a one-line error naming the key.

It resolves the input globs and dataset directories (an input matching no file, a file of unknown
format, or a dataset split that is not there, is an error), loads the tokenizer once, and proves
the output is writable, not already a complete dataset (unless ``overwrite=true``), holds
nothing of the user's where a run clears it, and has room for the run (:func:`room_needed`).
"""

from __future__ import annotations

import math
import os
import re
import tarfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from apache_beam.io.filesystem import BeamIOError
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions

from common.atomic import free_bytes
from common.config import ConfigError
from common.tokenizer import describe_tokenizer
from preprocessing.config import PreprocessConfig
from preprocessing.faults import BLOCK
from preprocessing.hf_datasets import dataset_files, has_glob, list_directory
from preprocessing.manifest import MANIFEST, SPLITS, TOKEN_COUNTS, WORK_DIR
from preprocessing.packing import tokenizer_dtype
from preprocessing.readers import detect_format
from preprocessing.shards import sample_bytes

# Buckets are the tokenization work items: enough of them that a small corpus still spreads
# evenly over the workers. The output does not depend on the count (packing.hash_bucket).
MIN_BUCKETS = 64
# Text bytes per byte on disk, for the room a run needs (room_needed): gzip shrinks prose and documentation 3.4-3.9x
# (the demo's and the tests' .jsonl.gz), zstd at its default level about as much, bz2 a little more; Parquet's own
# page compression (snappy, zstd) about 2x. Plain .txt/.jsonl and Arrow files count as their size.
EXPANSION = {"gz": 3.5, "zst": 3.5, "bz2": 4.0, "parquet": 2.0}
# Tokens per byte of text: WordPiece and BPE on English (0.29 and 0.31 measured on the same two corpora).
TOKENS_PER_TEXT_BYTE = 0.3


@dataclass(frozen=True)
class RunPlan:
    """Everything the pipeline needs that was resolved up front."""

    files: list[str]
    """Largest first."""
    input_bytes: int
    output: str
    identity: dict[str, Any]
    dtype: str
    cls_id: int
    sep_id: int
    pad_id: int
    num_buckets: int
    tokenizer_file: str
    """Where the run keeps the fast tokenizer's serialised Rust core (under the work directory):
    workers rebuild it with ``tokenizers`` alone (``packing.core_from_json``) instead of
    importing transformers and re-resolving the name. A file, not a field: every step carries
    the plan in its pickled payload, and the JSON is 0.5 MB for BERT's vocabulary, several MB
    for large multilingual ones. Only the tokenizing step needs it."""
    room: int
    """The bytes the run needs on the output's filesystem at its peak (:func:`room_needed`)."""


def absolute(path: str) -> str:
    """Local paths become absolute (Beam workers may run elsewhere); URLs stay as they are."""
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def resolve_inputs(patterns: list[str], splits: Sequence[str] = ("train",)) -> tuple[list[str], int]:
    """Matched files, de-duplicated, largest first (:func:`largest_first`), and their total size in bytes."""
    sizes = input_sizes(patterns, splits)
    return largest_first(sizes), sum(sizes.values())


def largest_first(sizes: dict[str, int]) -> list[str]:
    """Largest first balances the reading: workers that take files in turn (the DirectRunner
    deals them round-robin) end within one small file of each other. The output does not
    depend on the order."""
    return sorted(sizes, key=lambda path: (-sizes[path], path))


def input_sizes(patterns: list[str], splits: Sequence[str] = ("train",)) -> dict[str, int]:
    """Every matched file, de-duplicated, with its size in bytes.

    An entry naming a directory is a Hugging Face dataset (``save_to_disk``'s, or a repository in the
    Hub's layout): its files of the ``splits`` wanted (``dataset_splits``) are listed
    (:mod:`preprocessing.hf_datasets`). Any other entry is a path or glob of files."""
    sizes: dict[str, int] = {}
    for i, pattern in enumerate(patterns):
        try:
            listed = {} if has_glob(pattern) else list_directory(absolute(pattern))
            matches = [] if listed else FileSystems.match([absolute(pattern)])[0].metadata_list
        except (BeamIOError, ValueError, OSError) as err:
            raise ConfigError(f"input[{i}]: cannot list {pattern!r}: {err}") from None
        if listed:
            sizes.update(dataset_files(f"input[{i}] {pattern!r}", absolute(pattern), listed, splits))
            continue
        files = [m for m in matches if not m.path.endswith("/") and not os.path.isdir(m.path)]  # an empty directory
        if not files:
            raise ConfigError(f"input[{i}]: {pattern!r} matches no file")
        for meta in files:
            try:
                detect_format(meta.path)
            except ValueError as err:
                raise ConfigError(f"input[{i}]: {err}") from None
            sizes[meta.path] = meta.size_in_bytes
    return sizes


def check_not_published(output: str, overwrite: bool) -> None:
    if FileSystems.exists(FileSystems.join(output, MANIFEST)) and not overwrite:
        raise ConfigError(f"output: {output!r} already holds a complete dataset; set overwrite=true to replace it")


def check_writable(output: str) -> None:
    probe = FileSystems.join(output, f".write-probe-{uuid.uuid4().hex}")
    try:
        with FileSystems.create(probe) as handle:
            handle.write(b"probe")  # not empty: an object store refuses an upload of no parts
        FileSystems.delete([probe])
    except (BeamIOError, OSError) as err:
        raise ConfigError(f"output: cannot write to {output!r}: {err}") from None


# What a run writes in its split folders: shards, and a shard's temporary while it is written (shards.write_atomic).
OWN_SPLIT_FILE = re.compile(r"shard-\d{6}\.tar(\.tmp-[0-9a-f]{32})?")


def check_nothing_to_lose(output: str, files: list[str]) -> None:
    """Every run first clears what an earlier one left (``clear_previous``): the manifest, the token counts, the
    split folders and the work folder. Refuse, before that, where it would delete an input or a file this tool
    did not write: ``input=[data/train/*.jsonl] output=data`` would otherwise delete the corpus it was to read."""
    cleared = [FileSystems.join(output, name) for name in (MANIFEST, TOKEN_COUNTS, *SPLITS, WORK_DIR)]
    for path in files:
        if any(path == c or path.startswith(c.rstrip("/") + "/") for c in cleared):
            raise ConfigError(
                f"input: {path!r} lies in {output!r}, where each run first deletes {', '.join(SPLITS)}, "
                f"{WORK_DIR} and the manifest: move it, or choose another output"
            )
    for split in SPLITS:
        folder = FileSystems.join(output, split)
        foreign = [m.path for m in FileSystems.match([folder + "/**"])[0].metadata_list]
        foreign = [path for path in foreign if not OWN_SPLIT_FILE.fullmatch(path[len(folder) :].lstrip("/"))]
        if foreign:
            raise ConfigError(
                f"output: {folder!r} holds {len(foreign)} file(s) this tool did not write (first: {foreign[0]!r}), "
                "which the run would delete: move them, or choose another output"
            )


def text_bytes(path: str, size: int) -> float:
    """The text a file of ``size`` bytes on disk holds, about (:data:`EXPANSION`)."""
    fmt, compression = detect_format(path)
    return size * EXPANSION.get(compression or fmt, 1.0)


def room_needed(
    sizes: dict[str, int], cfg: PreprocessConfig, dtype: str, vocab_size: int, tokenizer_bytes: int, buckets: int
) -> int:
    """The bytes a run holds on the output's filesystem at its peak, estimated from the input files' sizes alone.

    The peak is the end of the write stage, when the work directory's spills (the cleaned text) and token
    streams (its ids) are still there beside every shard; finalize then adds token_counts.npy and removes the
    work directory. Text is the size on disk times :data:`EXPANSION` for compressed files, tokens
    :data:`TOKENS_PER_TEXT_BYTE` of it; a shard holds a tar member per ``max_seq_len`` tokens; every file takes
    whole blocks (a run makes thousands of small ones: streams and markers per bucket, markers per shard). An
    estimate: text that tokenizes otherwise, or a .jsonl whose records carry much besides their text, move it
    (``check_space=false`` skips the check)."""
    text = sum(text_bytes(path, size) for path, size in sizes.items())
    tokens = text * TOKENS_PER_TEXT_BYTE
    sequences = tokens / (cfg.max_seq_len - 1)
    shards = math.ceil(sequences / cfg.samples_per_shard) + len(SPLITS)
    # spill files and read markers per input, more spills per spill_bytes; per bucket a stream per split and a
    # marker; per shard the tar and its marker
    files = 2 * len(sizes) + text / cfg.spill_bytes + (len(SPLITS) + 1) * buckets + 2 * shards
    shard_bytes = sequences * sample_bytes(cfg.max_seq_len, dtype) + shards * tarfile.RECORDSIZE
    counts_bytes = vocab_size * 8  # token_counts.npy: an int64 per token id
    streams = tokens * np.dtype(dtype).itemsize
    return math.ceil(tokenizer_bytes + text + streams + shard_bytes + counts_bytes + files * BLOCK)


def reclaimable(output: str) -> int:
    """Bytes a run frees at its start on a local output (``pipeline.clear_previous``: an earlier run's manifest,
    token counts, split folders and work directory), counted in the blocks they take."""
    if "://" in output:
        return 0
    total = 0
    for name in (MANIFEST, TOKEN_COUNTS, *SPLITS, WORK_DIR):
        path = os.path.join(output, name)
        paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
        total += sum(os.lstat(p).st_blocks * 512 for p in paths if os.path.lexists(p))
    return total


def check_room(output: str, needed: int, input_bytes: int) -> None:
    """Refuse a run whose output's filesystem has less room than :func:`room_needed` (a local one: an object
    store has no free figure), counting what the run's start frees; in seconds, before any work."""
    free = free_bytes(output)
    if free is None:
        return
    free += reclaimable(output)
    if free < needed:
        raise ConfigError(
            f"output: this run needs about {needed:,} bytes on the filesystem of {output!r} (its spills, token "
            f"streams and shards, estimated from the input's {input_bytes:,} bytes on disk), and {free:,} are free: "
            "free room there or choose another output=; check_space=false skips this estimate"
        )


def check_beam_options(options: dict[str, Any]) -> None:
    known = PipelineOptions([]).get_all_options()
    for key in options:
        if key not in known:
            raise ConfigError(f"beam.{key}: not a Beam pipeline option")


def preflight(cfg: PreprocessConfig) -> tuple[RunPlan, str]:
    """The plan and the tokenizer's serialised core, for ``plan.tokenizer_file``."""
    check_beam_options(cfg.beam_options())
    sizes = input_sizes(cfg.input, cfg.dataset_splits)
    files, input_bytes = largest_first(sizes), sum(sizes.values())
    described = describe_tokenizer(cfg.tokenizer)
    identity = described["identity"]
    ids = identity["special_token_ids"]
    missing = [name for name in ("cls", "sep", "pad") if name not in ids]
    if missing:
        raise ConfigError(f"tokenizer: {cfg.tokenizer!r} defines no {', '.join(missing)} token")
    output = absolute(cfg.output)
    check_not_published(output, cfg.overwrite)
    check_nothing_to_lose(output, files)
    dtype = tokenizer_dtype(identity["vocab_size"]).name
    num_buckets = max(MIN_BUCKETS, math.ceil(input_bytes / cfg.bucket_input_bytes))
    tokenizer_bytes = len(described["json"].encode("utf-8"))
    room = room_needed(sizes, cfg, dtype, identity["vocab_size"], tokenizer_bytes, num_buckets)
    if cfg.check_space:
        check_room(output, room, input_bytes)
    check_writable(output)
    plan = RunPlan(
        files=files,
        input_bytes=input_bytes,
        output=output,
        identity=identity,
        dtype=dtype,
        cls_id=ids["cls"],
        sep_id=ids["sep"],
        pad_id=ids["pad"],
        num_buckets=num_buckets,
        tokenizer_file=FileSystems.join(output, WORK_DIR, "tokenizer.json"),
        room=room,
    )
    return plan, described["json"]
