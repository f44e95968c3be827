"""Checks that run before any Beam work: every mistake here is a one-line error naming the key.

It resolves the input globs and dataset directories (an input matching no file, a file of unknown
format, or a dataset split that is not there, is an error), loads the tokenizer once, and proves
the output is writable, not already a complete dataset (unless ``overwrite=true``), and holds
nothing of the user's where a run clears it.
"""

from __future__ import annotations

import math
import os
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from apache_beam.io.filesystem import BeamIOError
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions

from common.config import ConfigError
from common.tokenizer import describe_tokenizer
from preprocessing.config import PreprocessConfig
from preprocessing.hf_datasets import dataset_files, has_glob, list_directory
from preprocessing.manifest import MANIFEST, SPLITS, TOKEN_COUNTS, WORK_DIR
from preprocessing.packing import tokenizer_dtype
from preprocessing.readers import detect_format

# Buckets are the tokenization work items: enough of them that a small corpus still spreads
# evenly over the workers. The output does not depend on the count (packing.hash_bucket).
MIN_BUCKETS = 64


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


def absolute(path: str) -> str:
    """Local paths become absolute (Beam workers may run elsewhere); URLs stay as they are."""
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def resolve_inputs(patterns: list[str], splits: Sequence[str] = ("train",)) -> tuple[list[str], int]:
    """Matched files, de-duplicated, largest first, and their total size in bytes.

    An entry naming a directory is a Hugging Face dataset (``save_to_disk``'s, or a repository in the
    Hub's layout): its files of the ``splits`` wanted (``dataset_splits``) are listed
    (:mod:`preprocessing.hf_datasets`). Any other entry is a path or glob of files.

    Largest first balances the reading: workers that take files in turn (the DirectRunner
    deals them round-robin) end within one small file of each other. The output does not
    depend on the order."""
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
    return sorted(sizes, key=lambda path: (-sizes[path], path)), sum(sizes.values())


def check_output(output: str, overwrite: bool) -> None:
    if FileSystems.exists(FileSystems.join(output, MANIFEST)) and not overwrite:
        raise ConfigError(f"output: {output!r} already holds a complete dataset; set overwrite=true to replace it")
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


def check_beam_options(options: dict[str, Any]) -> None:
    known = PipelineOptions([]).get_all_options()
    for key in options:
        if key not in known:
            raise ConfigError(f"beam.{key}: not a Beam pipeline option")


def preflight(cfg: PreprocessConfig) -> tuple[RunPlan, str]:
    """The plan and the tokenizer's serialised core, for ``plan.tokenizer_file``."""
    check_beam_options(cfg.beam_options())
    files, input_bytes = resolve_inputs(cfg.input, cfg.dataset_splits)
    described = describe_tokenizer(cfg.tokenizer)
    identity = described["identity"]
    ids = identity["special_token_ids"]
    missing = [name for name in ("cls", "sep", "pad") if name not in ids]
    if missing:
        raise ConfigError(f"tokenizer: {cfg.tokenizer!r} defines no {', '.join(missing)} token")
    output = absolute(cfg.output)
    check_output(output, cfg.overwrite)
    check_nothing_to_lose(output, files)
    plan = RunPlan(
        files=files,
        input_bytes=input_bytes,
        output=output,
        identity=identity,
        dtype=tokenizer_dtype(identity["vocab_size"]).name,
        cls_id=ids["cls"],
        sep_id=ids["sep"],
        pad_id=ids["pad"],
        num_buckets=max(MIN_BUCKETS, math.ceil(input_bytes / cfg.bucket_input_bytes)),
        tokenizer_file=FileSystems.join(output, WORK_DIR, "tokenizer.json"),
    )
    return plan, described["json"]
