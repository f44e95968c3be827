"""Hugging Face ``datasets`` directories as input: which of their files to read, listed by the driver.

An ``input`` entry naming a directory (no glob characters, files under it) is one of:

* a ``save_to_disk`` ``DatasetDict``: ``dataset_dict.json`` lists its splits, one sub-directory each;
* a ``save_to_disk`` ``Dataset``: ``state.json`` lists its ``data-0000i-of-0000n.arrow`` files;
* anything else is read as a dataset repository in the Hugging Face Hub's layout, whose data files
  belong to splits by their names (:func:`hub_splits`).

Only file paths come out of here: the workers read each file with the ordinary readers (the
``.arrow`` files of ``save_to_disk`` as Arrow IPC streams). Everything is listed and read through
Beam's ``FileSystems``, so a directory on gs:// or s3:// works as a local one does, and nothing
here imports ``datasets``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

from apache_beam.io.filesystem import BeamIOError, CompressionTypes
from apache_beam.io.filesystems import FileSystems

from common.config import ConfigError
from preprocessing.readers import ACCEPTED, detect_format

DATASET_DICT_JSON = "dataset_dict.json"
STATE_JSON = "state.json"
GLOB_CHARACTERS = "*?["

# The Hub's convention (datasets.data_files, which is what load_dataset applies to a directory without a
# `configs` section in its README): the first rule that matches any file decides, in this order.
#  1. data/{split}-NNNNN-of-NNNNN*.* : the split is the name before the shard numbers.
#  2. a directory named for a split keyword, alone or delimited: data/train/a.parquet, my-valid-set/b.jsonl.
#  3. a file named for a split keyword, delimited: train.jsonl, my_validation_file.jsonl.gz, test-0.parquet.
#  4. otherwise every file is in train.
# Under 2 and 3, a file naming no split is in none. (datasets also knows eval logs, *.eval, and Harbor tasks,
# task.toml and instruction.md, which are not text corpora.)
SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_DELIMITER = "[-._ 0-9]"  # what may stand next to a keyword: punctuation, space or a digit
_KEYWORD_DIR = {
    split: re.compile(f"(?:[^/]*{_DELIMITER})?(?:{'|'.join(words)})(?:{_DELIMITER}[^/]*)?")
    for split, words in SPLIT_KEYWORDS.items()
}
_KEYWORD_FILE = {
    split: re.compile(f"(?:[^/]*{_DELIMITER})?(?:{'|'.join(words)}){_DELIMITER}[^/]*")
    for split, words in SPLIT_KEYWORDS.items()
}
_SHARDED = re.compile(r"data/[^/]*-[0-9]{5}-of-[0-9]{5}[^/]*\.[^/]*")
_SHARD_SPLIT = re.compile(r"(.+)-[0-9]{5}-of-[0-9]{4}")  # greedy, as datasets reads it back
_SPLIT_NAME = re.compile(r"\w+(\.\w+)*")
# Never data, wherever they are (datasets' FILES_TO_IGNORE): the dataset card and metadata.
NOT_DATA_NAMES = frozenset(
    ("README.md", "config.json", "dataset_info.json", "dataset_infos.json", "dataset_dict.json", "dummy_data.zip")
)
# Files of a split that are skipped rather than refused: datasets takes no file without an extension for data,
# and a repository's code and docs are no corpus. Any other file the readers cannot read is an error.
NOT_DATA_EXTENSIONS = frozenset(("", "md", "py", "ipynb", "sh", "yaml", "yml", "toml", "cfg", "lock"))


def is_candidate(rel: str) -> bool:
    """A file datasets would consider at all: not hidden, not under a ``__special__`` directory, not the card."""
    parts = rel.split("/")
    return (
        not any(part.startswith(".") for part in parts)
        and not any(part.startswith("__") for part in parts[:-1])
        and parts[-1] not in NOT_DATA_NAMES
    )


def hub_splits(files: Iterable[str]) -> dict[str, list[str]]:
    """The Hub's split of a repository's files (paths relative to its root, ``/``-separated): split -> files.

    Splits come in the order datasets gives them (train, validation, test, then others by name);
    hidden files, ``__special__`` directories and the dataset card are in none. Raises ValueError for
    a sharded file whose split name is not a word (datasets refuses it too)."""
    candidates = sorted(rel for rel in files if is_candidate(rel))
    sharded = [rel for rel in candidates if _SHARDED.fullmatch(rel)]
    if sharded:
        by_split: dict[str, list[str]] = {}
        for rel in sharded:
            split = _SHARD_SPLIT.match(rel.rsplit("/", 1)[-1]).group(1)
            if not _SPLIT_NAME.fullmatch(split):
                raise ValueError(f"{rel!r} names the split {split!r}, which is not a valid split name")
            by_split.setdefault(split, [])
        for split in by_split:
            shard = re.compile(f"data/{re.escape(split)}-[0-9]{{5}}-of-[0-9]{{5}}[^/]*\\.[^/]*")
            by_split[split] = [rel for rel in sharded if shard.fullmatch(rel)]
        known = [split for split in SPLIT_KEYWORDS if split in by_split]
        return {split: by_split[split] for split in known + sorted(set(by_split) - set(known))}
    for named in (_in_named_directory, _named_file):
        found = {split: [rel for rel in candidates if named(rel, split)] for split in SPLIT_KEYWORDS}
        found = {split: rels for split, rels in found.items() if rels}
        if found:
            return found
    return {"train": candidates} if candidates else {}


def _in_named_directory(rel: str, split: str) -> bool:
    return any(_KEYWORD_DIR[split].fullmatch(part) for part in rel.split("/")[:-1])


def _named_file(rel: str, split: str) -> bool:
    return bool(_KEYWORD_FILE[split].fullmatch(rel.rsplit("/", 1)[-1]))


def has_glob(pattern: str) -> bool:
    return any(c in pattern for c in GLOB_CHARACTERS)


def list_directory(base: str) -> dict[str, int]:
    """Every file under ``base`` (recursively) by its path relative to it, with its size; {} for a file or nothing."""
    prefix = base.rstrip("/") + "/"
    return {
        meta.path[len(prefix) :]: meta.size_in_bytes
        for meta in FileSystems.match([prefix + "**"])[0].metadata_list
        if meta.path.startswith(prefix) and not meta.path.endswith("/")
    }


def dataset_files(where: str, base: str, listed: dict[str, int], splits: Sequence[str]) -> dict[str, int]:
    """The files to read of the dataset directory ``base`` (``listed``: :func:`list_directory`), with their sizes.

    ``splits`` are the config's ``dataset_splits``; ``where`` (``input[0] 'path'``) starts every error."""
    base = base.rstrip("/")
    if DATASET_DICT_JSON in listed:
        found = _read_json(where, f"{base}/{DATASET_DICT_JSON}").get("splits")
        if not isinstance(found, list) or not all(isinstance(s, str) for s in found):
            raise ConfigError(f"{where}: {DATASET_DICT_JSON} lists no splits")
        _check_splits(where, splits, found)
        return {path: size for split in splits for path, size in _saved_dataset(where, base, listed, split).items()}
    if STATE_JSON in listed:
        return _saved_dataset(where, base, listed, "")  # one Dataset: no splits to choose from
    try:
        by_split = hub_splits(listed)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None
    if not by_split:
        raise ConfigError(f"{where}: the directory holds no data file")
    _check_splits(where, splits, list(by_split))
    files = {}
    for split in splits:
        for rel in by_split[split]:
            if _readable(where, f"{base}/{rel}"):
                files[f"{base}/{rel}"] = listed[rel]
    if not files:
        raise ConfigError(f"{where}: split(s) {', '.join(splits)} hold no data file ({ACCEPTED})")
    return files


def _check_splits(where: str, wanted: Sequence[str], found: list[str]) -> None:
    for split in wanted:
        if split not in found:
            raise ConfigError(f"dataset_splits: {where} has no split {split!r}; its splits: {', '.join(found)}")


def _saved_dataset(where: str, base: str, listed: dict[str, int], split: str) -> dict[str, int]:
    """The ``.arrow`` files of a ``save_to_disk`` Dataset (``split``: its sub-directory in a DatasetDict)."""
    folder = f"{split}/" if split else ""
    state_path = f"{base}/{folder}{STATE_JSON}"
    if f"{folder}{STATE_JSON}" not in listed:
        raise ConfigError(f"{where}: split {split!r} has no {state_path!r}")
    entries = _read_json(where, state_path).get("_data_files")
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("filename"), str) for e in entries
    ):
        raise ConfigError(f"{where}: {state_path!r} lists no _data_files")
    files = {}
    for entry in entries:
        rel = folder + entry["filename"]
        if rel not in listed:
            raise ConfigError(f"{where}: {state_path!r} lists {entry['filename']!r}, which is not there")
        files[f"{base}/{rel}"] = listed[rel]
    return files


def _read_json(where: str, path: str) -> dict[str, Any]:
    try:
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as handle:
            data = json.loads(handle.read())
    except (BeamIOError, OSError, ValueError) as err:
        raise ConfigError(f"{where}: cannot read {path!r}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {path!r} is not a JSON object")
    return data


def _readable(where: str, path: str) -> bool:
    """Whether a split's file is read (True) or skipped as no data (False); raises for data the readers cannot read."""
    try:
        detect_format(path)
    except ValueError:
        suffixes = path.rsplit("/", 1)[-1].lower().split(".")[1:]
        if (suffixes[-1] if suffixes else "") in NOT_DATA_EXTENSIONS:
            return False
        raise ConfigError(
            f"{where}: cannot read {path!r}: its format is not one of {ACCEPTED} "
            "(convert it, or leave it out by naming the files to read with a glob)"
        ) from None
    return True
