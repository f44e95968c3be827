"""The real pipeline on the Beam DirectRunner, read back with stock webdataset and tar."""

import gzip
import hashlib
import io
import json
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import apache_beam as beam
import numpy as np
import pytest
import webdataset as wds
from apache_beam.options.pipeline_options import PipelineOptions
from helpers import TINY_DATASET_SETTINGS, build_dataset
from transformers import AutoTokenizer

from common.config import load_config
from preprocessing.cleaning import clean_text
from preprocessing.config import PreprocessConfig
from preprocessing.packing import document_hash, hash_split
from preprocessing.pipeline import build_pipeline
from preprocessing.preflight import preflight

pytestmark = pytest.mark.integration
SPLITS = ("train", "valid")


def manifest_of(dataset: Path) -> dict:
    return json.loads((dataset / "manifest.json").read_text())


def shard_paths(dataset: Path, split: str) -> list[Path]:
    return [dataset / s["path"] for s in manifest_of(dataset)["splits"][split]["shards"]]


def read_sequences(dataset: Path, split: str) -> list[tuple[str, np.ndarray]]:
    """Every sample of a split, in shard order, through stock webdataset."""
    urls = [str(p) for p in shard_paths(dataset, split)]
    if not urls:
        return []
    samples = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
    return [(s["__key__"], np.load(io.BytesIO(s["input_ids.npy"]), allow_pickle=False)) for s in samples]


def documents_in(dataset: Path, split: str) -> list[tuple[int, ...]]:
    """Undo the packing: drop [CLS] and padding, cut the stream at [SEP]."""
    ids = manifest_of(dataset)["tokenizer"]["special_token_ids"]
    rows = [seq for _, seq in read_sequences(dataset, split)]
    if not rows:
        return []
    stream = np.concatenate([row[1:] for row in rows])
    stream = stream[stream != ids["pad"]].tolist()
    assert ids["cls"] not in stream
    docs, current = [], []
    for token in stream:
        if token == ids["sep"]:
            docs.append(tuple(current))
            current = []
        else:
            current.append(token)
    assert current == [], "the stream must end with [SEP]"
    return docs


def expected_documents(corpus: Path, tokenizer_dir: Path, min_chars: int, valid_fraction: float, seed: int):
    """Independent reference: plain json + HF tokenizer __call__, exact dedup of cleaned texts."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    texts = {}
    with gzip.open(corpus, "rt", encoding="utf-8") as handle:
        for line in handle:
            text, _ = clean_text(json.loads(line)["text"])
            if len(text) >= min_chars:
                texts[text] = hash_split(document_hash(text, seed), valid_fraction)
    encoded = tokenizer(list(texts), add_special_tokens=False, truncation=False)["input_ids"]
    by_split = {split: Counter() for split in SPLITS}
    for split, ids in zip(texts.values(), encoded, strict=True):
        by_split[split][tuple(ids)] += 1
    return by_split


def test_shards_reproduce_the_kept_documents_exactly(tiny_dataset_dir, sample_corpus, bert_tokenizer_dir):
    expected = expected_documents(sample_corpus, bert_tokenizer_dir, 16, 0.1, 0)
    manifest = manifest_of(tiny_dataset_dir)
    for split in SPLITS:
        assert Counter(documents_in(tiny_dataset_dir, split)) == expected[split], split
    kept = sum(sum(c.values()) for c in expected.values())
    assert manifest["documents"]["kept"] == kept == 32
    assert manifest["documents"]["read"] == kept + sum(manifest["documents"]["dropped"].values())


def test_samples_follow_the_contract(tiny_dataset_dir):
    manifest = manifest_of(tiny_dataset_dir)
    assert manifest["format_version"] == 1 and manifest["max_seq_len"] == 64 and manifest["dtype"] == "uint16"
    assert manifest["tokenizer"]["vocab_size"] == 30522
    pad = manifest["tokenizer"]["special_token_ids"]["pad"]
    assert 6 <= len(manifest["splits"]["train"]["shards"]) <= 10
    for split in SPLITS:
        samples = read_sequences(tiny_dataset_dir, split)
        keys = [key for key, _ in samples]
        assert len(keys) == len(set(keys)) and all("." not in k for k in keys)
        for key, seq in samples:
            assert seq.dtype == np.uint16 and seq.shape == (64,)
            assert seq[0] == manifest["tokenizer"]["special_token_ids"]["cls"]
            assert key.startswith(f"{split}-")
        padded = [key for key, seq in samples if (seq == pad).any()]
        assert padded == keys[-1:] or padded == [], "only the split's last sequence may be padded"


def test_manifest_counts_equal_the_tars(tiny_dataset_dir):
    manifest = manifest_of(tiny_dataset_dir)
    pad = manifest["tokenizer"]["special_token_ids"]["pad"]
    train_counts = np.zeros(manifest["tokenizer"]["vocab_size"], dtype=np.int64)
    for split in SPLITS:
        info = manifest["splits"][split]
        for entry in info["shards"]:
            path = tiny_dataset_dir / entry["path"]
            assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
            assert path.stat().st_size == entry["bytes"]  # what the trainer's start check compares, reading nothing
            names = subprocess.run(["tar", "tf", str(path)], check=True, capture_output=True, text=True).stdout.split()
            assert len(names) == entry["samples"] and all(n.endswith(".input_ids.npy") for n in names)
            rows = [sample["input_ids.npy"] for sample in wds.WebDataset([str(path)], shardshuffle=False).decode()]
            assert len(rows) == entry["samples"]
            stacked = np.stack(rows)
            assert int((stacked != pad).sum()) == entry["tokens"]
            if split == "train":
                train_counts += np.bincount(stacked[stacked != pad].astype(np.int64), minlength=len(train_counts))
        assert info["samples"] == sum(e["samples"] for e in info["shards"])
        assert info["tokens"] == sum(e["tokens"] for e in info["shards"])
    token_counts = np.load(tiny_dataset_dir / manifest["token_counts"], allow_pickle=False)
    assert token_counts.dtype == np.int64
    np.testing.assert_array_equal(token_counts, train_counts)
    assert int(token_counts.sum()) == manifest["splits"]["train"]["tokens"]


@pytest.fixture(scope="module")
def one_worker_dir(tmp_path_factory, tiny_dataset_dir, bert_tokenizer_dir, sample_corpus):
    """The tiny dataset rebuilt over a copy of itself with one worker and overwrite=true.

    A stale shard and a killed run's half-written one are planted first: overwriting must remove what the new
    dataset does not list (and preflight must take both for the tool's own files).
    """
    dataset = tmp_path_factory.mktemp("one-worker") / "dataset"
    shutil.copytree(tiny_dataset_dir, dataset)
    (dataset / "train" / "shard-000099.tar").write_bytes(b"stale")
    (dataset / "valid" / f"shard-000098.tar.tmp-{'0' * 32}").write_bytes(b"half")
    return build_dataset(
        dataset,
        bert_tokenizer_dir,
        sample_corpus,
        **TINY_DATASET_SETTINGS,
        overwrite=True,
        beam={"direct_num_workers": 1},
    )


def test_worker_count_does_not_change_a_byte(tiny_dataset_dir, one_worker_dir):
    two, one = manifest_of(tiny_dataset_dir), manifest_of(one_worker_dir)
    assert two["config"]["beam"] != one["config"]["beam"]
    assert two["splits"] == one["splits"]
    files = sorted(p.relative_to(one_worker_dir) for p in one_worker_dir.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tiny_dataset_dir) for p in tiny_dataset_dir.rglob("*") if p.is_file())
    for relative in files:
        if relative.name != "manifest.json":
            assert (one_worker_dir / relative).read_bytes() == (tiny_dataset_dir / relative).read_bytes(), relative


def test_overwrite_removes_what_the_new_dataset_does_not_list(one_worker_dir):
    assert not (one_worker_dir / "train" / "shard-000099.tar").exists()
    assert not list((one_worker_dir / "valid").glob("*.tmp-*"))
    assert not (one_worker_dir / ".work").exists()


def test_the_pipeline_graph_does_not_carry_the_tokenizer(tmp_path, bert_tokenizer_dir, sample_corpus):
    """Every step's pickled payload holds the plan: the tokenizer (0.5 MB of JSON here) goes
    through a work file instead, read only by the step that tokenizes."""
    overrides = [f"input=[{sample_corpus}]", f"tokenizer={bert_tokenizer_dir}", f"output={tmp_path}"]
    cfg = load_config(PreprocessConfig, overrides=overrides)
    plan, tokenizer_json = preflight(cfg)
    pipeline = beam.Pipeline(options=PipelineOptions(flags=[]))
    build_pipeline(pipeline, cfg, plan)
    graph = pipeline.to_runner_api().SerializeToString()
    assert len(tokenizer_json) > 400_000
    assert len(graph) < len(tokenizer_json) / 4
