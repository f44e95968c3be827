"""A dataset written to an object store through Beam's filesystem layer: the output is an
``s3://`` URL on a real S3-compatible server (moto's, started here on 127.0.0.1), so every work
file and output must go through ``FileSystems``; a local path would land on the local disk instead."""

from __future__ import annotations

import json
import os

import pytest
from helpers import REPO, TINY_DATASET_SETTINGS, build_dataset

pytestmark = pytest.mark.integration
boto3 = pytest.importorskip("boto3")
CREDENTIALS = {"s3_access_key_id": "testing", "s3_secret_access_key": "testing", "s3_region_name": "us-east-1"}


@pytest.mark.full
def test_a_bucket_output_writes_nothing_local(moto_server, tiny_dataset_dir, sample_corpus, bert_tokenizer_dir):
    s3_endpoint = moto_server.url
    client = moto_server.client()
    client.create_bucket(Bucket="datasets")
    before = set(os.listdir("/tmp"))
    build_dataset(
        "s3://datasets/tiny",
        bert_tokenizer_dir,
        sample_corpus,
        **TINY_DATASET_SETTINGS,
        beam={"direct_num_workers": 2, "s3_endpoint_url": s3_endpoint, **CREDENTIALS},
    )
    assert not (REPO / "s3:").exists(), "a URL was used as a local path (the run's working directory)"
    assert not any(name.startswith("s3") for name in set(os.listdir("/tmp")) - before)
    listed = client.list_objects_v2(Bucket="datasets", Prefix="tiny/")
    stored = {o["Key"].removeprefix("tiny/"): o for o in listed.get("Contents", [])}
    local = {str(p.relative_to(tiny_dataset_dir)) for p in tiny_dataset_dir.rglob("*") if p.is_file()}
    assert set(stored) == local, "the work directory must be gone and every output present"
    for name in local - {"manifest.json"}:
        body = client.get_object(Bucket="datasets", Key=f"tiny/{name}")["Body"].read()
        assert body == (tiny_dataset_dir / name).read_bytes(), name
    manifest = json.loads(client.get_object(Bucket="datasets", Key="tiny/manifest.json")["Body"].read())
    local_manifest = json.loads((tiny_dataset_dir / "manifest.json").read_text())
    for written in (manifest, local_manifest):  # where it was written, and how: all else the same
        del written["config"]["output"], written["config"]["beam"]
    assert manifest == local_manifest
