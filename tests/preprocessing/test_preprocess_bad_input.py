"""Every kind of bad input is counted per reason by a real pipeline run, and the run goes on."""

import gzip
import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import build_dataset
from test_preprocess_pipeline import manifest_of, read_sequences

pytestmark = pytest.mark.integration


def sentence(tag: str, i: int) -> str:
    return f"The {tag} document number {i} explains how shards are packed, hashed and written to disk."


@pytest.fixture(scope="module")
def bad_input_dataset(tmp_path_factory, bert_tokenizer_dir):
    corpus = tmp_path_factory.mktemp("bad-corpus")
    good = [sentence("good", i) for i in range(6)]
    lines = [json.dumps({"text": t}).encode() for t in good] + [
        json.dumps({"text": "  " + good[0].replace("The", "The\x00", 1) + " "}).encode(),  # duplicate once cleaned
        json.dumps({"text": "tiny"}).encode(),  # too short
        json.dumps({"text": " \t "}).encode(),  # empty once cleaned
        b'{"text": "unterminated',  # malformed JSON
        b"[1, 2, 3]",  # JSON, but not an object
        json.dumps({"body": "no text field"}).encode(),
        json.dumps({"text": None}).encode(),
        json.dumps({"text": 12345}).encode(),
        b'{"text": "Latin-1 bytes: caf\xe9 cr\xe8me br\xfbl\xe9e, not UTF-8 at all"}',
        json.dumps({"text": "long " * 600}).encode(),  # 3000 chars > max_doc_chars
        b'{"text": "' + b"x" * 500_000 + b'"}',  # one long line, streamed past
    ]
    (corpus / "mixed.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    notes = [sentence("plain", 0), sentence("plain", 1), "Bell\x07 and escape\x1b bytes " + sentence("plain", 2)]
    (corpus / "notes.txt").write_text("\n\n".join(notes) + "\n")
    (corpus / "image.txt").write_bytes(random.Random(0).randbytes(8192))
    (corpus / "empty.jsonl").write_bytes(b"")
    many = b"".join(json.dumps({"text": sentence("cut", i)}).encode() + b"\n" for i in range(3000))
    packed = gzip.compress(many)
    (corpus / "cut.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    pq.write_table(pa.table({"text": [sentence("table", 0), None, sentence("table", 1)]}), corpus / "table.parquet")
    return build_dataset(
        tmp_path_factory.mktemp("bad-dataset") / "dataset",
        bert_tokenizer_dir,
        corpus / "*",
        max_doc_chars=2000,
        min_doc_chars=16,
        max_seq_len=32,
        samples_per_shard=64,
        valid_fraction=0.2,
        beam={"direct_num_workers": 2},
    )


def test_each_bad_input_kind_is_counted(bad_input_dataset):
    manifest = manifest_of(bad_input_dataset)
    documents = manifest["documents"]
    assert documents["dropped"] == {
        "duplicate": 1,
        "empty": 1,
        "invalid_utf8": 1,
        "malformed_json": 2,
        "missing_text_field": 1,
        "non_string_text": 1,
        "null_text": 2,
        "too_long": 2,
        "too_short": 1,
    }
    assert documents["cleaned"] == {"control_chars": 2}
    assert manifest["files"] == {"binary": 1, "empty": 1, "read": 6, "truncated": 1}
    readable_from_cut = documents["read"] - 17 - 3 - 3
    assert 0 < readable_from_cut < 3000
    assert documents["kept"] == 6 + 3 + 2 + readable_from_cut
    assert documents["read"] == documents["kept"] + sum(documents["dropped"].values())


def test_every_kept_document_is_in_the_shards_once(bad_input_dataset):
    manifest = manifest_of(bad_input_dataset)
    sep = manifest["tokenizer"]["special_token_ids"]["sep"]
    separators = sum(
        int(np.count_nonzero(seq == sep))
        for split in ("train", "valid")
        for _, seq in read_sequences(bad_input_dataset, split)
    )
    assert separators == manifest["documents"]["kept"]
