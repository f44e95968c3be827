"""Streaming the real preprocessing output: every sample once per epoch, no starving slot, exact resume."""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import pytest
import torch

from common.config import ConfigError
from common.tokenizer import load_tokenizer, tokenizer_identity
from trainer.config import LoaderConfig
from trainer.runtime.data import (
    SlotStream,
    TrainLoader,
    TrainStream,
    check_tokenizer,
    open_dataset,
    padding_mask,
    valid_batches,
)


def keys_of_epoch(stream: SlotStream, epoch: int) -> list[str]:
    return [sample["__key__"] for sample in stream.epoch_raw(epoch)]


@pytest.mark.parametrize(("world_size", "workers"), [(1, 1), (2, 2), (3, 1), (4, 3)])
def test_each_epoch_covers_every_sample_once_across_slots(
    tiny_dataset_dir: Path, world_size: int, workers: int
) -> None:
    dataset = open_dataset(tiny_dataset_dir)
    shards = dataset.shards("train")
    total = dataset.manifest["splits"]["train"]["samples"]
    slots = world_size * workers  # (4, 3): 12 slots share 8 shards
    for epoch in (0, 1):
        seen: list[str] = []
        for slot in range(slots):
            stream = SlotStream(tuple(shards), slot, slots, seed=3, shuffle_buffer=16)
            keys = keys_of_epoch(stream, epoch)
            assert keys, f"slot {slot} of {slots} starves"
            assert len(keys) == stream.epoch_size(epoch)
            seen += keys
        assert len(seen) == total and len(set(seen)) == total


def test_epochs_are_reshuffled_from_the_seed(tiny_dataset_dir: Path) -> None:
    shards = tuple(open_dataset(tiny_dataset_dir).shards("train"))
    stream = SlotStream(shards, 0, 2, seed=3, shuffle_buffer=64)
    epoch0, epoch1 = keys_of_epoch(stream, 0), keys_of_epoch(stream, 1)
    assert epoch0 != epoch1
    assert keys_of_epoch(SlotStream(shards, 0, 2, seed=3, shuffle_buffer=64), 0) == epoch0
    assert keys_of_epoch(SlotStream(shards, 0, 2, seed=4, shuffle_buffer=64), 0) != epoch0


def loader(dataset_dir: Path, rank: int, state: dict | None = None, workers: int = 2) -> TrainLoader:
    return TrainLoader(
        open_dataset(dataset_dir),
        micro_batch_size=4,
        rank=rank,
        world_size=2,
        loader_cfg=LoaderConfig(num_workers=workers, shuffle_buffer=32, streams=None),
        seed=7,
        state=state,
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_replays_the_exact_batch_sequence_across_epochs(tiny_dataset_dir: Path, workers: int) -> None:
    # 990 train samples: ~61 batches of 4 per slot and epoch with 2 ranks x 2 workers (~123 with
    # no workers), so resuming at batch 150 lands in the second epoch of every worker.
    for rank in (0, 1):
        full = loader(tiny_dataset_dir, rank, workers=workers)
        uninterrupted = [next(full)["input_ids"] for _ in range(160)]
        assert sum(full.state()["positions"].values()) == 160 * 4
        for stop in (1, 37, 150):
            interrupted = loader(tiny_dataset_dir, rank, workers=workers)
            for _ in range(stop):
                next(interrupted)
            resumed = loader(tiny_dataset_dir, rank, state=interrupted.state(), workers=workers)
            for expected in uninterrupted[stop:]:
                assert torch.equal(next(resumed)["input_ids"], expected)


def test_a_data_state_from_before_streams_resumes_where_it_stopped(tiny_dataset_dir: Path) -> None:
    """Checkpoints written before streams recorded micro-batches per rank; each (rank, worker) was a stream."""
    full = loader(tiny_dataset_dir, 1)
    uninterrupted = [next(full)["keys"] for _ in range(50)]
    legacy = {"micro_batches": 37, "world_size": 2, "num_workers": 2, "micro_batch_size": 4, "seed": 7}
    resumed = loader(tiny_dataset_dir, 1, state=legacy)
    assert [next(resumed)["keys"] for _ in range(13)] == uninterrupted[37:]


def consume(loaders: list[TrainLoader], micro_batches: int) -> tuple[list[str], dict]:
    """``micro_batches`` from every rank's loader: the sample keys taken, and the data state the ranks
    would gather into a checkpoint."""
    keys = [key for lo in loaders for _ in range(micro_batches) for key in next(lo)["keys"]]
    positions = {k: p for lo in loaders for k, p in lo.state()["positions"].items()}
    return keys, {**loaders[0].state(), "positions": positions}


def ranks(dataset_dir: Path, world_size: int, state: dict | None = None, workers: int = 1, streams: int | None = None):
    return [
        TrainLoader(
            open_dataset(dataset_dir),
            micro_batch_size=2,
            rank=rank,
            world_size=world_size,
            loader_cfg=LoaderConfig(num_workers=workers, shuffle_buffer=32, streams=streams),
            seed=7,
            state=state,
        )
        for rank in range(world_size)
    ]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (4, 2)])
def test_a_resume_on_another_world_size_neither_skips_nor_repeats_a_sample(
    tiny_dataset_dir: Path, before: int, after: int
) -> None:
    """Global batches of 8: 8 steps on ``before`` ranks, then 8 on ``after``, consume exactly the samples of
    16 uninterrupted steps (the streams' first 32 samples each, within their first epoch)."""
    uninterrupted, _ = consume(ranks(tiny_dataset_dir, before, streams=4), 16 * 4 // before)
    first, state = consume(ranks(tiny_dataset_dir, before, streams=4), 8 * 4 // before)
    assert sorted(state["positions"].values()) == [16] * 4
    second, state = consume(ranks(tiny_dataset_dir, after, state, workers=2), 8 * 4 // after)
    assert sorted(first + second) == sorted(uninterrupted)
    assert len(set(uninterrupted)) == 16 * 8
    assert sum(state["positions"].values()) == 16 * 8


def test_more_ranks_than_streams_is_a_clear_error(tiny_dataset_dir: Path) -> None:
    _, state = consume(ranks(tiny_dataset_dir, 1), 1)
    with pytest.raises(ConfigError, match=r"^loader\.streams: .* 1 streams, fewer than its 2 ranks"):
        ranks(tiny_dataset_dir, 2, state)


def test_batches_are_int64_sequences_of_the_manifest_length(tiny_dataset_dir: Path) -> None:
    batch = next(loader(tiny_dataset_dir, 0, workers=0))["input_ids"]
    assert batch.dtype == torch.int64 and batch.shape == (4, 64)
    assert (batch[:, 0] == 101).all()  # every packed sequence starts with [CLS]


def test_ranks_see_different_samples(tiny_dataset_dir: Path) -> None:
    first = [next(loader(tiny_dataset_dir, r, workers=0))["input_ids"] for r in (0, 1)]
    assert not torch.equal(first[0], first[1])


def test_fewer_samples_than_slots_is_a_clear_error(tiny_dataset_dir: Path) -> None:
    tiny = open_dataset(tiny_dataset_dir).shards("train")[:1]
    tiny = [type(tiny[0])(tiny[0].path, 3)]
    with pytest.raises(ConfigError, match=r"fewer than its 4 streams"):
        TrainStream(tiny, micro_batch_size=1, positions={0: 0}, num_streams=4, num_workers=2, seed=0, shuffle_buffer=1)


def test_valid_batches_are_split_evenly_over_ranks(tiny_dataset_dir: Path) -> None:
    dataset = open_dataset(tiny_dataset_dir)
    shares = [valid_batches(dataset, micro_batch_size=8, max_batches=5, rank=r, world_size=2) for r in range(2)]
    assert [len(s) for s in shares] == [2, 2]
    rows = collections.Counter(tuple(row.tolist()) for share in shares for _, batch in share for row in batch)
    assert sum(rows.values()) == 32 and max(rows.values()) == 1
    # each batch with its index among all: what the evaluation's mask is drawn from, whichever rank has it
    alone = valid_batches(dataset, micro_batch_size=8, max_batches=5, rank=0, world_size=1)
    assert [i for share in shares for i, _ in share] == [0, 1, 2, 3] == [i for i, _ in alone][:4]
    assert all(torch.equal(batch, alone[i][1]) for share in shares for i, batch in share)


def test_missing_manifest_and_foreign_tokenizer_are_clear_errors(
    tiny_dataset_dir: Path, tmp_path: Path, tiny_teacher_dir: Path
) -> None:
    with pytest.raises(ConfigError, match=r"no manifest\.json"):
        open_dataset(tmp_path)

    dataset = open_dataset(tiny_dataset_dir)
    identity = tokenizer_identity(load_tokenizer(str(tiny_teacher_dir)), str(tiny_teacher_dir))
    check_tokenizer(dataset, identity, str(tiny_teacher_dir))  # the same vocabulary: accepted

    # A tokenizer with a different vocabulary must be refused before any training.
    foreign = shutil.copytree(tiny_teacher_dir, tmp_path / "foreign")
    tokenizer_json = json.loads((foreign / "tokenizer.json").read_text())
    tokenizer_json["model"]["vocab"]["zzzz-new-token"] = len(tokenizer_json["model"]["vocab"])
    (foreign / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    identity = tokenizer_identity(load_tokenizer(str(foreign)), str(foreign))
    with pytest.raises(ConfigError, match=r"^data: .* different tokenizer"):
        check_tokenizer(dataset, identity, str(foreign))


def test_a_dataset_without_valid_samples_gives_no_eval_batches(tiny_dataset_dir: Path, tmp_path: Path) -> None:
    manifest = json.loads((tiny_dataset_dir / "manifest.json").read_text())
    manifest["splits"]["valid"] = {"samples": 0, "tokens": 0, "shards": []}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "train").symlink_to(tiny_dataset_dir / "train")
    dataset = open_dataset(tmp_path)
    assert valid_batches(dataset, micro_batch_size=4, max_batches=3, rank=0, world_size=2) == []
    assert next(loader(tmp_path, 0, workers=0))["input_ids"].shape == (4, 64)


def test_padding_mask_is_none_for_packed_batches() -> None:
    packed = torch.tensor([[101, 7, 8, 102], [101, 9, 102, 5]])
    assert padding_mask(packed, pad_id=0) is None
    padded = torch.tensor([[101, 7, 102, 0]])
    assert padding_mask(padded, pad_id=0).tolist() == [[True, True, True, False]]
