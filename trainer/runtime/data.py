"""Streaming the packed train shards (WebDataset tars) to every rank, resumable to the sample.

Every (rank, dataloader worker) pair is one *slot* of ``world_size x num_workers``. Each epoch
the shard order is reshuffled from ``(seed, epoch)``; then

* with at least as many shards as slots, slot ``s`` reads shards ``order[s::slots]``;
* with fewer shards than slots, every slot reads all shards and keeps every ``slots``-th sample,
  so no slot starves (a small dataset is read more than once, never a large one).

Each slot shuffles its samples through a buffer seeded by ``(seed, epoch, slot)`` and the
stream repeats epochs forever: training is driven by steps, not epochs. Everything above is a
pure function of the seed, so a resumed run replays its position instead of saving buffers: it
skips whole epochs by arithmetic on the manifest's per-shard sample counts, then replays the
current epoch's shuffle without decoding the samples it drops.

The DataLoader hands out a worker's batches round-robin (batch ``b`` comes from worker
``b % num_workers``), so the number of micro-batches a rank has consumed pins down every one
of its workers' positions; that single number is the data state kept in the checkpoint.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import webdataset as wds

from common.config import ConfigError

log = logging.getLogger(__name__)

SAMPLE_FIELD = "input_ids.npy"


@dataclass(frozen=True)
class Shard:
    path: str
    samples: int


@dataclass(frozen=True)
class Dataset:
    """A dataset directory written by ``python -m preprocessing`` (see docs/contracts.md)."""

    root: Path
    manifest: dict[str, Any]

    @property
    def tokenizer(self) -> dict[str, Any]:
        return self.manifest["tokenizer"]

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer["special_token_ids"]["pad"])

    @property
    def max_seq_len(self) -> int:
        return int(self.manifest["max_seq_len"])

    def shards(self, split: str) -> list[Shard]:
        """The split's non-empty shards, as absolute paths."""
        entries = self.manifest["splits"][split]["shards"]
        return [Shard(str(self.root / e["path"]), int(e["samples"])) for e in entries if int(e["samples"]) > 0]


def open_dataset(path: str | Path) -> Dataset:
    """Read ``manifest.json``; it is published last, so its absence means an unfinished dataset."""
    root = Path(path)
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        raise ConfigError(f"data: no manifest.json in {root} (not a finished `python -m preprocessing` output)")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    for split in ("train", "valid"):
        if split not in manifest.get("splits", {}):
            raise ConfigError(f"data: {manifest_path} has no '{split}' split")
    dataset = Dataset(root, manifest)
    if not dataset.shards("train"):
        raise ConfigError(f"data: {manifest_path} lists no non-empty train shard")
    return dataset


def check_tokenizer(dataset: Dataset, teacher_identity: dict[str, Any], teacher: str, key: str = "teacher") -> None:
    """A dataset tokenized for another tokenizer would train on garbage: refuse it up front.

    ``teacher`` is where the run's tokenizer came from, and ``key`` the config key that named it
    (``tokenizer`` or ``student.model`` when there is no teacher).
    """
    expected = dataset.tokenizer["fingerprint"]
    if teacher_identity["fingerprint"] != expected:
        raise ConfigError(
            f"data: {dataset.root} was tokenized with {dataset.tokenizer['name_or_path']!r} "
            f"(fingerprint {expected[:12]}), but {key} {teacher!r} has a different tokenizer "
            f"(fingerprint {teacher_identity['fingerprint'][:12]}); re-run preprocessing with the {key}'s tokenizer"
        )


def decode(sample: dict[str, Any]) -> np.ndarray:
    return np.load(io.BytesIO(sample[SAMPLE_FIELD]), allow_pickle=False)


@dataclass(frozen=True)
class SlotStream:
    """The infinite, deterministic sample stream of one slot (see the module docstring)."""

    shards: tuple[Shard, ...]
    slot: int
    num_slots: int
    seed: int
    shuffle_buffer: int

    def epoch_plan(self, epoch: int) -> tuple[list[Shard], int, int]:
        """(shards this slot reads, stride, offset): it keeps sample ``g`` when ``g % stride == offset``."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
        ordered = [self.shards[i] for i in order]
        if len(ordered) >= self.num_slots:
            return ordered[self.slot :: self.num_slots], 1, 0
        return ordered, self.num_slots, self.slot

    def epoch_size(self, epoch: int) -> int:
        shards, stride, offset = self.epoch_plan(epoch)
        return len(range(offset, sum(s.samples for s in shards), stride))

    def epoch_raw(self, epoch: int) -> Iterator[dict[str, Any]]:
        """This slot's raw (undecoded) samples of one epoch, shuffled through the buffer."""
        shards, stride, offset = self.epoch_plan(epoch)
        mine = itertools.islice(wds.tarfile_samples([{"url": s.path} for s in shards]), offset, None, stride)
        rng = np.random.default_rng([self.seed, epoch, self.slot])
        buffer: list[dict[str, Any]] = []
        for sample in mine:
            if len(buffer) < self.shuffle_buffer:
                buffer.append(sample)
                continue
            i = int(rng.integers(len(buffer)))
            yield buffer[i]
            buffer[i] = sample
        rng.shuffle(buffer)
        yield from buffer

    def samples(self, skip: int = 0) -> Iterator[np.ndarray]:
        """The decoded stream from sample ``skip`` on, epoch after epoch."""
        first = 0
        while skip >= (size := self.epoch_size(first)):
            skip -= size
            first += 1
        for epoch in itertools.count(first):
            for sample in itertools.islice(self.epoch_raw(epoch), skip, None):
                yield decode(sample)
            skip = 0


def padding_mask(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor | None:
    """The attention mask of a host batch, or None when it has no padding (the packed common
    case), decided on the host so the model can take SDPA's unmasked path."""
    mask = input_ids.ne(pad_id)
    return None if bool(mask.all()) else mask


def batches_before(consumed: int, worker: int, num_workers: int) -> int:
    """How many of the first ``consumed`` round-robin batches came from ``worker``."""
    return max(0, (consumed - worker + num_workers - 1) // num_workers)


class TrainStream(torch.utils.data.IterableDataset):
    """One rank's micro-batches, ``{"input_ids": int64 [micro_batch, seq_len]}``."""

    def __init__(
        self,
        shards: list[Shard],
        *,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        num_workers: int,
        seed: int,
        shuffle_buffer: int,
        start_batch: int = 0,
    ) -> None:
        super().__init__()
        self.shards = tuple(shards)
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.num_workers = max(1, num_workers)
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.start_batch = start_batch
        total = sum(s.samples for s in shards)
        slots = world_size * self.num_workers
        if len(shards) < slots and total < slots:
            raise ConfigError(
                f"data: the train split has {total} samples, fewer than ranks x loader.num_workers = {slots}"
            )

    def stream(self, worker: int) -> SlotStream:
        slot = self.rank * self.num_workers + worker
        slots = self.world_size * self.num_workers
        return SlotStream(self.shards, slot, slots, self.seed, self.shuffle_buffer)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        # The DataLoader starts its round-robin at its worker 0, which on resume is the stream
        # that owns batch `start_batch`, so loader worker i plays stream (start_batch + i).
        worker = ((info.id if info is not None else 0) + self.start_batch) % self.num_workers
        done = batches_before(self.start_batch, worker, self.num_workers)
        samples = self.stream(worker).samples(skip=done * self.micro_batch_size)
        while True:
            batch = np.stack(list(itertools.islice(samples, self.micro_batch_size)))
            yield {"input_ids": torch.from_numpy(batch.astype(np.int64))}


class TrainLoader:
    """Iterator of micro-batches that knows its position; ``state()`` goes in the checkpoint."""

    def __init__(
        self,
        dataset: Dataset,
        *,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        loader_cfg: Any,
        seed: int,
        state: dict[str, int] | None = None,
    ) -> None:
        self.layout = {
            "world_size": world_size,
            "num_workers": loader_cfg.num_workers,
            "micro_batch_size": micro_batch_size,
            "seed": seed,
        }
        start = 0
        if state is not None:
            start = int(state["micro_batches"])
            changed = {k: (state.get(k), v) for k, v in self.layout.items() if state.get(k) != v}
            if changed:
                log.warning(
                    "data layout changed since the checkpoint %s: resuming at the same batch count, "
                    "but ranks will not see the exact samples an uninterrupted run would",
                    changed,
                )
        self.consumed = start
        stream = TrainStream(
            dataset.shards("train"),
            micro_batch_size=micro_batch_size,
            rank=rank,
            world_size=world_size,
            num_workers=loader_cfg.num_workers,
            seed=seed,
            shuffle_buffer=loader_cfg.shuffle_buffer,
            start_batch=start,
        )
        workers = loader_cfg.num_workers
        self.loader = torch.utils.data.DataLoader(
            stream,
            batch_size=None,
            num_workers=workers,
            pin_memory=torch.cuda.is_available(),
            prefetch_factor=4 if workers else None,
        )
        self.iterator = iter(self.loader)

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = next(self.iterator)
        self.consumed += 1
        return batch

    def state(self) -> dict[str, int]:
        return {"micro_batches": self.consumed, **self.layout}


def valid_batches(
    dataset: Dataset, *, micro_batch_size: int, max_batches: int, rank: int, world_size: int
) -> list[torch.Tensor]:
    """This rank's share of the first ``max_batches`` valid batches, in file order.

    Every rank gets the same number of batches (ZeRO-3 forwards are collective); when there
    are fewer batches than ranks, some are evaluated twice. An empty valid split gives none.
    """
    shards = dataset.shards("valid")
    samples = wds.tarfile_samples([{"url": s.path} for s in shards])
    rows = [decode(s) for s in itertools.islice(samples, max_batches * micro_batch_size)]
    batches = [np.stack(rows[i : i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]
    if not batches:
        return []
    per_rank = max(1, len(batches) // world_size)
    mine = [batches[(rank * per_rank + i) % len(batches)] for i in range(per_rank)]
    return [torch.from_numpy(b.astype(np.int64)) for b in mine]
