"""Reading the dataset where the preprocessing put it: damaged shards, an object store, its faults, the cache.

The object store is a real S3-compatible server (moto's) on 127.0.0.1, reached through boto3's usual
environment (``AWS_ENDPOINT_URL`` and keys) and, for the faults, through a TCP proxy that can cut every
connection, as a store that went away does.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import S3_CREDENTIALS, TcpProxy, record_fault, refusal

from common.atomic import size_text
from trainer.config import LoaderConfig
from trainer.runtime import storage
from trainer.runtime.data import (
    DamagedShard,
    ShardReader,
    SlotStream,
    TrainLoader,
    check_shards_present,
    load_token_counts,
    open_dataset,
    valid_batches,
)


def loader(data: str | Path, *, workers: int = 0, state: dict | None = None, damaged: str = "stop") -> TrainLoader:
    cfg = LoaderConfig(
        num_workers=workers, shuffle_buffer=32, read_attempts=3, read_retry_max_s=1, damaged_shards=damaged
    )
    return TrainLoader(
        open_dataset(data), micro_batch_size=4, rank=0, world_size=1, loader_cfg=cfg, seed=0, state=state
    )


def take(batches: TrainLoader, n: int) -> list[tuple[list[str], torch.Tensor]]:
    return [(b["keys"], b["input_ids"]) for b in (next(batches) for _ in range(n))]


@pytest.fixture
def s3_env(moto_server, monkeypatch: pytest.MonkeyPatch):
    """boto3's usual environment, pointed at the server (or at a proxy in front of it: ``s3_env(url)``)."""

    def point_at(endpoint: str) -> None:
        for key, value in {**S3_CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}.items():
            monkeypatch.setenv(key, value)
        storage.CLIENTS.clear()  # a client reads the environment when it is made

    point_at(moto_server.url)
    yield point_at
    storage.CLIENTS.clear()


@pytest.fixture
def s3_dataset(moto_server, tiny_dataset_dir: Path) -> str:
    return moto_server.upload(tiny_dataset_dir, "streamed", "tiny")


def damage_second_shard(tiny_dataset_dir: Path, tmp_path: Path, damage: str) -> tuple[Path, Path, set[str]]:
    """A copy of the dataset whose second shard read (stream 0, epoch 0) is truncated or has one bit flipped:
    (the copy, the damaged shard, the keys of its samples)."""
    data = tmp_path / "dataset"
    shutil.copytree(tiny_dataset_dir, data)
    shards = open_dataset(data).shards("train")
    order = SlotStream(tuple(shards), 0, 1, 0, 32).epoch_plan(0)[0]
    victim = Path(order[1].path)  # the second shard read: the first one's samples come out intact
    victim_keys = {s["__key__"] for s in ShardReader().samples([order[1]])}
    raw = bytearray(victim.read_bytes())
    if damage == "truncated":
        del raw[len(raw) // 2 :]
    else:
        raw[len(raw) // 3] ^= 0x01  # one bit of one sample
    victim.write_bytes(bytes(raw))
    return data, victim, victim_keys


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_shard_stops_the_run_naming_it_before_any_of_its_samples_is_used(
    tiny_dataset_dir: Path, tmp_path: Path, damage: str
):
    data, victim, victim_keys = damage_second_shard(tiny_dataset_dir, tmp_path, damage)
    batches, used = loader(data), set()
    with pytest.raises(DamagedShard, match=f"shard {victim} is damaged"):
        for _ in range(1000):
            used.update(next(batches)["keys"])
    assert used and not used & victim_keys  # the shards before it were read; none of its samples was


def test_with_damaged_shards_skip_its_samples_are_counted_never_used_and_the_positions_stay_exact(
    tiny_dataset_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """loader.damaged_shards=skip: the damaged shard's samples are never used (a micro-batch keeps its shape
    with its stream's real samples), every one is counted once, the warning names the shard; the stream's
    position counts them as passed, so a loader restarted from its state goes on exactly as the first one."""
    data, victim, victim_keys = damage_second_shard(tiny_dataset_dir, tmp_path, "flipped")
    clean = loader(tiny_dataset_dir)
    batches = loader(data, damaged="skip")
    per_epoch = sum(s.samples for s in open_dataset(data).shards("train")) // 4
    got = [next(batches) for _ in range(per_epoch)]  # one epoch of micro-batches of 4
    used = {key for b in got for key in b["keys"]}
    assert used and not used & victim_keys
    assert sum(b["damaged"] for b in got) == len(victim_keys)
    assert all(b["input_ids"].shape == (4, 64) for b in got)
    assert f"shard {victim} is damaged" in caplog.text and "skipping its" in caplog.text
    # Positions count the skipped samples: the same as a clean loader's after as many batches
    for _ in range(per_epoch):
        next(clean)
    assert batches.state() == clean.state()
    again = loader(data, damaged="skip", state=batches.state())
    assert [b["keys"] for b in (next(again) for _ in range(5))] == [next(batches)["keys"] for _ in range(5)]
    record_fault(
        "damaged-shard",
        fault="a shard with one bit flipped after preprocessing",
        injected=1,
        kinds={"stop (default)": 1, "skip": 1},
        outcome="default: stopped naming the shard before any of its samples was used; loader.damaged_shards=skip: "
        f"its {len(victim_keys)} samples never used, counted, positions exact across a restart",
        data_lost=0,
        stop_s=None,
        recovery_s=None,
        steps_redone=None,
    )


def test_a_dataset_in_an_object_store_streams_exactly_the_samples_of_its_local_copy(
    s3_env, s3_dataset: str, tiny_dataset_dir: Path
):
    assert open_dataset(s3_dataset).manifest == open_dataset(tiny_dataset_dir).manifest
    local, remote = loader(tiny_dataset_dir, workers=1), loader(s3_dataset, workers=1)
    first_local, first_remote = take(local, 30), take(remote, 30)  # 120 samples: past the first shard
    assert [k for k, _ in first_local] == [k for k, _ in first_remote]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first_local, first_remote, strict=True))
    # Exact resume: the store's loader, restarted from its state, goes on as the local one does.
    state = remote.state()
    assert state == local.state()
    assert [k for k, _ in take(loader(s3_dataset, state=state), 10)] == [k for k, _ in take(local, 10)]
    # The evaluation's batches and the token counts come from the store too.
    for a, b in zip(
        valid_batches(open_dataset(s3_dataset), micro_batch_size=4, max_batches=3, rank=0, world_size=1),
        valid_batches(open_dataset(tiny_dataset_dir), micro_batch_size=4, max_batches=3, rank=0, world_size=1),
        strict=True,
    ):
        assert a[0] == b[0] and torch.equal(a[1], b[1])
    assert np.array_equal(load_token_counts(s3_dataset), load_token_counts(tiny_dataset_dir))


def test_a_store_that_goes_away_is_retried_and_one_that_stays_away_is_named(s3_env, s3_dataset, moto_server):
    proxy = TcpProxy(moto_server.port)
    s3_env(proxy.url)
    manifest = f"{s3_dataset}/manifest.json"
    expected = storage.read_bytes(manifest)

    proxy.down()  # back 1.5 s later: the second attempt (after 1 s) fails too, the third succeeds
    threading.Timer(1.5, proxy.restore).start()
    started = time.monotonic()
    assert storage.read_bytes(manifest, attempts=5, retry_max_s=2) == expected
    assert 1.5 < time.monotonic() - started < 10

    proxy.down()
    with pytest.raises(storage.StoreError, match=f"{manifest}: unreadable after 2 attempts"):
        storage.read_bytes(manifest, attempts=2, retry_max_s=1)
    proxy.restore()
    with pytest.raises(FileNotFoundError):  # a missing object is no fault of the store: not retried
        storage.read_once(f"{s3_dataset}/no-such-shard.tar")


def test_a_store_that_goes_away_mid_run_is_waited_out_and_no_sample_changes(
    s3_env, s3_dataset, moto_server, tiny_dataset_dir: Path
):
    proxy = TcpProxy(moto_server.port)
    s3_env(proxy.url)
    remote = loader(s3_dataset, workers=1)
    before = take(remote, 5)  # the loader runs: its first shard is read
    proxy.down()  # for 1.5 s, while the loader needs several more shards (128 samples each); it retries for 2 s
    threading.Timer(1.5, proxy.restore).start()
    started = time.monotonic()
    after = take(remote, 150)  # without the outage, a fraction of a second
    assert time.monotonic() - started > 1.0  # it waited the outage out (retrying) ...
    local = take(loader(tiny_dataset_dir, workers=1), 155)
    assert [k for k, _ in before + after] == [k for k, _ in local]  # ... and delivered what a local run does
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(before + after, local, strict=True))


def test_the_cache_serves_later_epochs_and_stays_within_its_bound(s3_env, s3_dataset, moto_server, tmp_path):
    shards = open_dataset(s3_dataset).shards("train")
    size = len(storage.read_bytes(shards[0].path))
    cache = tmp_path / "cache"
    reader = ShardReader(cache_dir=str(cache), cache_max_gb=2.5 * size / 2**30)  # room for two shards
    first = reader.read(shards[0])
    assert sorted(p.name for p in cache.iterdir()) == [f"{shards[0].sha256}.tar"]

    proxy = TcpProxy(moto_server.port)
    s3_env(proxy.url)
    proxy.down()  # the store is gone: the cached shard still reads, verified
    assert reader.read(shards[0]) == first
    proxy.restore()
    for shard in shards[1:4]:
        reader.read(shard)
    kept = {p.name for p in cache.iterdir()}
    assert len(kept) == 2 and kept == {f"{s.sha256}.tar" for s in shards[2:4]}  # the least recently used went


def test_any_fsspec_url_reads_like_a_local_directory(tiny_dataset_dir: Path):
    """Schemes other than s3:// go through fsspec (gcsfs for gs://, ...); its in-memory filesystem stands in."""
    import fsspec

    memory = fsspec.filesystem("memory")
    for path in tiny_dataset_dir.rglob("*"):
        if path.is_file():
            memory.pipe(f"/fsspec-tiny/{path.relative_to(tiny_dataset_dir)}", path.read_bytes())
    try:
        remote, local = take(loader("memory://fsspec-tiny"), 40), take(loader(tiny_dataset_dir), 40)
        assert [k for k, _ in remote] == [k for k, _ in local]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(remote, local, strict=True))
    finally:
        memory.rm("/fsspec-tiny", recursive=True)


def test_skipped_damaged_samples_reach_the_step_metrics_only_where_they_happened() -> None:
    """The count a micro-batch carries goes into its step's record as train/damaged_samples_skipped (what
    metrics.jsonl and MLflow receive); a step without any has no such key."""
    from trainer.runtime.metrics import StepMeter

    meter = StepMeter(global_batch_size=8)
    for step, damaged in ((1, 0), (2, 3)):
        meter.add_micro({"loss": torch.tensor(1.0)}, tokens=64)
        meter.add_damaged(damaged)
        meter.end_step(step, lr=1e-3, grad_norm=1.0)
    records = dict(meter.flush())
    assert "train/damaged_samples_skipped" not in records[1]
    assert records[2]["train/damaged_samples_skipped"] == 3 and records[2]["train/loss"] == 1.0


def sized_copy(tiny_dataset_dir: Path, dest: Path) -> Path:
    """A copy of the dataset whose manifest gives every shard's ``bytes`` (from the files, where the preprocessing
    did not record them), which the start check compares."""
    shutil.copytree(tiny_dataset_dir, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    for split in manifest["splits"].values():
        for entry in split["shards"]:
            entry.setdefault("bytes", (dest / entry["path"]).stat().st_size)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


def test_the_start_check_names_a_removed_and_a_truncated_shard_in_one_line_without_reading_any(
    tiny_dataset_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """Before any weight loads, every shard the manifest lists is stat'ed (not read) against its recorded size:
    a complete dataset gives the start's line; one shard removed and one truncated after the preprocessing
    stop the run at once, in one line naming both and the fix, with a ConfigError's exit status. A shard
    altered without a change of size passes: the sha256 check finds it when the shard is read."""
    data = sized_copy(tiny_dataset_dir, tmp_path / "dataset")
    dataset = open_dataset(data)
    train, valid = dataset.shards("train"), dataset.shards("valid")
    total = sum(s.bytes for s in train + valid)
    altered = Path(train[0].path)
    altered.write_bytes(bytes(altered.stat().st_size))  # zeros, the same size: a read would refuse it
    assert (
        check_shards_present(dataset)
        == f"data: 8 train + 2 valid shards present, {size_text(total)} as the manifest says"
    )

    removed, truncated = Path(train[3].path), Path(valid[1].path)
    removed.unlink()
    truncated.write_bytes(truncated.read_bytes()[: valid[1].bytes // 2])
    said, took = refusal(lambda: check_shards_present(open_dataset(data)), capsys)
    assert said == (
        f"data: of the 10 shards {data / 'manifest.json'} lists, 1 missing ({removed}); {truncated} has "
        f"{valid[1].bytes // 2:,} bytes, the manifest says {valid[1].bytes:,}: copy the dataset again from where it "
        "was made, or re-run the preprocessing into a new directory"
    )
    assert took < 1.0
    record_fault(
        "shard-gone-before-start",
        fault="a shard removed and another truncated after the preprocessing, before the launch",
        injected=2,
        kinds={"removed": 1, "truncated": 1},
        outcome=f"stopped at the start in {took:.2f} s (a stat of each shard, none read), before any weight loaded: "
        "one line naming both shards, their sizes and the fix; exit status 2",
        data_lost=0,
        stop_s=None,
        recovery_s=None,
        steps_redone=None,
    )


def test_the_start_check_lists_an_object_store_and_names_a_missing_object(
    s3_env, moto_server, tiny_dataset_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """The same check against an S3 store: one listing per directory (not a read of each object)."""
    url = moto_server.upload(sized_copy(tiny_dataset_dir, tmp_path / "dataset"), "listed", "tiny")
    dataset = open_dataset(url)
    assert check_shards_present(dataset).startswith("data: 8 train + 2 valid shards present, ")
    gone = dataset.shards("train")[5].path
    moto_server.client().delete_object(Bucket="listed", Key=gone.removeprefix("s3://listed/"))
    said, took = refusal(lambda: check_shards_present(open_dataset(url)), capsys)
    assert said.startswith(f"data: of the 10 shards {url}/manifest.json lists, 1 missing ({gone}): copy the dataset")
    assert took < 5.0


def test_a_shard_that_vanishes_mid_run_stops_the_rank_in_one_line_naming_it(
    tiny_dataset_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """A shard removed after the start check, while a DataLoader worker streams: the rank stops when the worker
    reaches it, with one line naming the shard (not the worker's traceback re-raised inside another error), before
    any of its samples; the samples before it were trained on."""
    data = tmp_path / "dataset"
    shutil.copytree(tiny_dataset_dir, data)
    shards = open_dataset(data).shards("train")
    victim = SlotStream(tuple(shards), 0, 1, 0, 32).epoch_plan(0)[0][2]  # the third read: not read ahead yet
    victim_keys = {s["__key__"] for s in ShardReader().samples([victim])}
    batches, used = loader(data, workers=1), set()
    used.update(next(batches)["keys"])
    Path(victim.path).unlink()

    def drain() -> None:
        for _ in range(1000):
            used.update(next(batches)["keys"])

    said, took = refusal(drain, capsys)
    assert said == (
        f"[Errno 2] data: shard {victim.path} is gone (the manifest lists it, {victim.samples} samples): restore it, "
        "e.g. copy the dataset again, and relaunch to resume from the last checkpoint"
    )
    assert len(used) > 2 * 128 - 64 and not used & victim_keys  # two shards' samples (less the shuffle buffer's)
    assert took < 10.0
    record_fault(
        "shard-gone-mid-run",
        fault="a shard removed while the run streams it (a DataLoader worker reads it)",
        injected=1,
        kinds={"removed": 1},
        outcome=f"the rank stopped when its worker reached the shard, {took:.2f} s after, with one line naming it "
        "(no DataLoader traceback), none of its samples used; exit status 2",
        data_lost=0,
        stop_s=None,
        recovery_s=None,
        steps_redone=None,
    )
