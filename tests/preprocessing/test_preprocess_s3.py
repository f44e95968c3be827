"""A dataset written to an object store through Beam's filesystem layer: the output is an
``s3://`` URL on a real S3-compatible server (moto's, started here on 127.0.0.1), so every work
file and output must go through ``FileSystems``; a local path would land on the local disk instead."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import REPO, TINY_DATASET_SETTINGS, build_dataset

pytestmark = pytest.mark.integration
boto3 = pytest.importorskip("boto3")
CREDENTIALS = {"s3_access_key_id": "testing", "s3_secret_access_key": "testing", "s3_region_name": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server on a free port; yields its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (tmp_path_factory.mktemp("moto") / "server.log").open("w")
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"moto_server did not start: {Path(log.name).read_text()}") from None
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def s3_client(endpoint: str):
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=CREDENTIALS["s3_access_key_id"],
        aws_secret_access_key=CREDENTIALS["s3_secret_access_key"],
        region_name=CREDENTIALS["s3_region_name"],
    )


@pytest.mark.full
def test_a_bucket_output_writes_nothing_local(s3_endpoint, tiny_dataset_dir, sample_corpus, bert_tokenizer_dir):
    client = s3_client(s3_endpoint)
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
    assert manifest["splits"] == json.loads((tiny_dataset_dir / "manifest.json").read_text())["splits"]
