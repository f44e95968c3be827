"""The preprocessing config: what ``python -m preprocessing CONFIG.yaml key=value ...`` accepts.

Only ``input``, ``tokenizer`` and ``output`` lack defaults. The ``beam`` section is a free
mapping handed to Beam as pipeline options, so any runner option (Dataflow, Flink, Spark)
works without a code change; when it names no runner, the embedded default is the
DirectRunner in multi-processing mode with one worker per core.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from common.config import require

# Beam's own worker chatter stays quiet; this package's per-file progress lines do not.
LOGGING_DEFAULTS: dict[str, Any] = {
    "default_sdk_harness_log_level": "WARNING",
    "sdk_harness_log_level_overrides": {"preprocessing": "INFO"},
}
DIRECT_RUNNERS = ("DirectRunner", "direct")
# Runners Beam ships without listing them among its known names: Beam accepts them only by their
# full path, and registers their options (DaskRunner: ``address``, ...) only once that is imported.
RUNNER_PATHS = {"daskrunner": "apache_beam.runners.dask.dask_runner.DaskRunner"}
RUNNER_NAMES = tuple(path.rsplit(".", 1)[1] for path in RUNNER_PATHS.values())
# The DaskRunner makes one dask.bag partition per 128 inputs by default, which puts a corpus of a
# few files on one worker; one partition per input file spreads the reading over the cluster.
DASK_DEFAULTS: dict[str, Any] = {"partition_size": 1}
DIRECT_DEFAULTS: dict[str, Any] = {
    "runner": "DirectRunner",
    "direct_running_mode": "multi_processing",
    "direct_num_workers": os.cpu_count() or 1,
}


@dataclass
class PreprocessConfig:
    input: list[str]
    """Paths or globs, local or any Beam filesystem URL (gs://, s3://, ...), or directories of Hugging Face
    datasets: saved by ``save_to_disk`` (a Dataset or a DatasetDict), or in the Hub's repository layout."""
    tokenizer: str
    """A local directory holding a Hugging Face fast tokenizer, or a hub id."""
    output: str
    """The dataset directory (or URL) to create."""
    max_seq_len: int = 512
    samples_per_shard: int = 10_000
    valid_fraction: float = 0.01
    seed: int = 0
    """Salts the document hash, which decides the train/valid split and the document order."""
    overwrite: bool = False
    check_space: bool = True
    """Before any work, refuse a run whose output's filesystem lacks the room it needs, as estimated from the
    input's size (``preflight.room_needed``); false skips the estimate."""
    text_field: str = "text"
    """JSON key / Parquet or Arrow column holding the text."""
    min_doc_chars: int = 16
    """Cleaned documents shorter than this are dropped as too short."""
    max_doc_chars: int = 1_000_000
    """Longer documents are dropped (and streamed past, never held whole)."""
    invalid_utf8: Literal["drop", "replace"] = "drop"
    """A record that is not valid UTF-8 is dropped, or repaired with U+FFFD."""
    tokenize_batch_chars: int = 1_000_000
    """Documents are tokenized in batches of about this many characters."""
    spill_bytes: int = 16 * 1024 * 1024
    """Cleaned text a reader buffers before spilling it to the work directory: bounds its memory."""
    bucket_input_bytes: int = 16 * 1024 * 1024
    """Input bytes per hash bucket: bounds the memory one worker needs to sort a bucket."""
    progress_seconds: float = 30.0
    """Between progress lines: each worker's per-file line, and the driver's per-stage line (a line per
    half minute suits cluster logs)."""
    dataset_splits: list[str] = field(default_factory=lambda: ["train"])
    """The splits read of each Hugging Face dataset directory in ``input`` (a DatasetDict's, or a Hub layout's:
    train, validation, test, ...); a split that is not there is an error. A single saved Dataset is read whole,
    plain files and globs ignore it. The pipeline still makes its own train/valid split, by hash."""
    beam: dict[str, Any] = field(default_factory=dict)
    """Beam pipeline options, passed through unchanged (runner, direct_num_workers, project, ...)."""

    def validate(self) -> None:
        require(len(self.input) > 0, "input", "give at least one path or glob")
        require(all(self.input), "input", "paths must not be empty")
        require(bool(self.tokenizer), "tokenizer", "must name a tokenizer directory or hub id")
        require(bool(self.output), "output", "must name the dataset directory")
        require(self.max_seq_len >= 8, "max_seq_len", f"must be at least 8, got {self.max_seq_len}")
        require(self.samples_per_shard >= 1, "samples_per_shard", f"must be >= 1, got {self.samples_per_shard}")
        require(0.0 <= self.valid_fraction < 1.0, "valid_fraction", f"must be in [0, 1), got {self.valid_fraction}")
        require(0 <= self.seed < 2**63, "seed", f"must be a non-negative integer, got {self.seed}")
        require(self.min_doc_chars >= 1, "min_doc_chars", f"must be >= 1, got {self.min_doc_chars}")
        require(
            self.max_doc_chars >= self.min_doc_chars,
            "max_doc_chars",
            f"must be >= min_doc_chars ({self.min_doc_chars}), got {self.max_doc_chars}",
        )
        require(self.tokenize_batch_chars >= 1, "tokenize_batch_chars", "must be >= 1")
        require(self.spill_bytes >= 1, "spill_bytes", "must be >= 1")
        require(self.bucket_input_bytes >= 1024, "bucket_input_bytes", "must be >= 1024")
        require(bool(self.text_field), "text_field", "must not be empty")
        require(self.progress_seconds > 0, "progress_seconds", f"must be > 0, got {self.progress_seconds}")
        require(len(self.dataset_splits) > 0, "dataset_splits", "name at least one split")
        require(all(self.dataset_splits), "dataset_splits", "split names must not be empty")

    def beam_options(self) -> dict[str, Any]:
        """The ``beam`` section, completed with quiet worker logging and, when it runs locally, the
        DirectRunner defaults."""
        runner = self.beam.get("runner", "DirectRunner")
        if runner in DIRECT_RUNNERS:
            return {**LOGGING_DEFAULTS, **DIRECT_DEFAULTS, **self.beam}
        if runner_path(runner) == RUNNER_PATHS["daskrunner"] and "npartitions" not in self.beam:
            return {**LOGGING_DEFAULTS, **DASK_DEFAULTS, **self.beam}
        return {**LOGGING_DEFAULTS, **self.beam}


def runner_path(name: str) -> str:
    """The name Beam's ``create_runner`` accepts for ``beam.runner``: a short name of one of
    ``RUNNER_PATHS`` (``DaskRunner``, ``dask``; any case) becomes its full path, any other name
    is left to Beam."""
    key = name.lower()
    return RUNNER_PATHS.get(key, RUNNER_PATHS.get(key + "runner", name))
