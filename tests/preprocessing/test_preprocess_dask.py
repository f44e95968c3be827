"""The pipeline on Beam's DaskRunner against a real dask.distributed cluster started here: a
``dask scheduler`` and two ``dask worker`` processes on 127.0.0.1, selected with ordinary options
(``beam.runner=DaskRunner beam.address=tcp://...``). Its dataset must equal the DirectRunner's
byte for byte."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import REPO, TINY_DATASET_SETTINGS, build_dataset, free_port, preprocess
from test_preprocess_hf_datasets import texts_of, write_hf_inputs

pytestmark = pytest.mark.integration
DASK = str(Path(sys.executable).with_name("dask"))


@pytest.fixture(scope="module")
def dask_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A scheduler and two single-threaded worker processes; yields the scheduler's address.

    The workers import this checkout's code (the pipeline's steps are pickled by reference)."""
    logs = tmp_path_factory.mktemp("dask-logs")
    address = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    commands = {
        "scheduler": [DASK, "scheduler", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1], "--no-dashboard"],
        **{
            f"worker-{i}": [DASK, "worker", address, "--host", "127.0.0.1", "--nthreads", "1", "--no-dashboard"]
            for i in range(2)
        },
    }
    processes = []
    try:
        for name, command in commands.items():
            log = (logs / f"{name}.log").open("w")
            processes.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        wait_for_workers(address, 2, logs)
        yield address
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_for_workers(address: str, n: int, logs: Path, timeout: float = 120) -> None:
    from distributed import Client

    deadline = time.monotonic() + timeout
    while True:
        try:
            with Client(address, timeout=5) as client:
                client.wait_for_workers(n, timeout=max(deadline - time.monotonic(), 1))
                return
        except (OSError, TimeoutError) as err:
            if time.monotonic() > deadline:
                output = "\n".join(f"{p.name}:\n{p.read_text()[-2000:]}" for p in sorted(logs.iterdir()))
                raise RuntimeError(f"the dask cluster at {address} did not start: {err}\n{output}") from None
            time.sleep(0.5)


@pytest.fixture(scope="module")
def two_files(tmp_path_factory: pytest.TempPathFactory, sample_corpus: Path) -> list[Path]:
    """The sample corpus cut into two files, so that both workers read one."""
    lines = gzip.decompress(sample_corpus.read_bytes()).decode("utf-8").splitlines(keepends=True)
    folder = tmp_path_factory.mktemp("two-files")
    halves = [folder / "a.jsonl", folder / "b.jsonl"]
    halves[0].write_text("".join(lines[: len(lines) // 2]), encoding="utf-8")
    halves[1].write_text("".join(lines[len(lines) // 2 :]), encoding="utf-8")
    return halves


def dataset_files(dataset: Path) -> dict[str, bytes]:
    return {str(p.relative_to(dataset)): p.read_bytes() for p in sorted(dataset.rglob("*")) if p.is_file()}


@pytest.mark.full
def test_dask_runner_writes_the_direct_runners_bytes(tmp_path, dask_cluster, two_files, bert_tokenizer_dir):
    direct = build_dataset(tmp_path / "direct", bert_tokenizer_dir, two_files, **TINY_DATASET_SETTINGS)
    dask = tmp_path / "dask"
    run = preprocess(
        dask,
        bert_tokenizer_dir,
        two_files,
        **TINY_DATASET_SETTINGS,
        progress_seconds=0.05,
        beam={"runner": "DaskRunner", "address": dask_cluster},
    )
    # The driver follows the Dask workers' progress through the markers they leave in the output.
    shards = re.findall(r"progress: wrote (\d+) of (\d+) shards", run.stderr)
    assert shards and shards[-1][0] == shards[-1][1] != "0", run.stderr[-3000:]
    assert re.search(r"progress: tokenized (\d+) of \d+ hash buckets", run.stderr), run.stderr[-3000:]
    direct_files, dask_files = dataset_files(direct), dataset_files(dask)
    assert sorted(dask_files) == sorted(direct_files)
    assert len([name for name in dask_files if name.endswith(".tar")]) >= 4
    for name in direct_files:
        if name != "manifest.json":
            assert dask_files[name] == direct_files[name], name
    # The manifest records the config, Beam options included; everything else is equal.
    direct_manifest, dask_manifest = (json.loads(files["manifest.json"]) for files in (direct_files, dask_files))
    assert dask_manifest["config"].pop("output") != direct_manifest["config"].pop("output")
    assert dask_manifest["config"].pop("beam") == {"runner": "DaskRunner", "address": dask_cluster}
    assert dask_manifest["config"].pop("progress_seconds") != direct_manifest["config"].pop("progress_seconds")
    assert direct_manifest["config"].pop("beam") == {}
    assert dask_manifest == direct_manifest
    assert direct_manifest["documents"]["kept"] > 0


@pytest.mark.full
def test_dask_runner_reads_hugging_face_datasets(
    tmp_path, dask_cluster, sample_corpus, bert_tokenizer_dir, tiny_dataset_dir
):
    """Directories saved by datasets and in the Hub's layout: only their files' paths travel to the workers, which
    read the .arrow, .parquet and .jsonl files; the shards are those of the same texts as one JSONL file."""
    inputs = write_hf_inputs(tmp_path / "inputs", texts_of(sample_corpus))
    dask = build_dataset(
        tmp_path / "dask",
        bert_tokenizer_dir,
        list(inputs.values()),
        **TINY_DATASET_SETTINGS,
        dataset_splits=["train", "validation"],
        beam={"runner": "DaskRunner", "address": dask_cluster},
    )
    dask_files, direct_files = dataset_files(dask), dataset_files(tiny_dataset_dir)
    assert sorted(dask_files) == sorted(direct_files)
    for name in direct_files:
        if name != "manifest.json":
            assert dask_files[name] == direct_files[name], name
    manifest = json.loads(dask_files["manifest.json"])
    assert manifest["files"] == {"read": 13} and manifest["documents"]["kept"] == 32
