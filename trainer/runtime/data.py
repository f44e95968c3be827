"""Streaming the packed train shards (WebDataset tars) to every rank, resumable to the sample on
any number of ranks.

The data order is made of ``K`` independent *streams* (``loader.streams``; by default the first
launch's world size x ``loader.num_workers``), fixed for the whole run. Each epoch the shard order
is reshuffled from ``(seed, epoch)``; then

* with at least as many shards as streams, stream ``k`` reads shards ``order[k::K]``;
* with fewer shards than streams, every stream reads all shards and keeps every ``K``-th sample,
  so no stream starves (a small dataset is read more than once, never a large one).

Each stream shuffles its samples through a buffer seeded by ``(seed, epoch, stream)`` and repeats
epochs forever: training is driven by steps, not epochs. A stream is a pure function of the seed,
so its position is one number, the samples it has delivered; a resumed stream skips whole epochs
by arithmetic on the manifest's per-shard sample counts, then replays the current epoch's shuffle
without decoding the samples it drops.

Rank ``r`` of ``W`` owns the contiguous block of streams ``[r K / W, (r + 1) K / W)`` and takes
each micro-batch from its stream that has delivered the fewest samples (the lowest-numbered on a
tie): a round robin from a fresh start, which after a change of world size first brings the
streams a rank inherited level. The checkpoint keeps every stream's position, so the run resumes
on any ``W <= K`` ranks with every stream continuing exactly where it stopped: within an epoch no
sample is skipped or seen twice, whatever the world size before and after. The DataLoader's
workers split a rank's micro-batches round-robin (micro-batch ``j`` is built by worker
``j % num_workers``); with the default ``K``, every worker reads one stream of its own.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import itertools
import json
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import webdataset as wds

from common.atomic import size_text
from common.config import ConfigError
from trainer.runtime import storage

log = logging.getLogger(__name__)

SAMPLE_FIELD = "input_ids.npy"
SAMPLE_TRACE_ENV = "ENCODER_DISTILL_SAMPLE_TRACE"
FAULT = "__fault__"  # a TrainStream item carrying the error that ended it


@dataclass(frozen=True)
class Shard:
    path: str  # a local path or an object store URL (runtime.storage)
    samples: int
    sha256: str | None = None  # from the manifest: what the shard's bytes must hash to
    bytes: int | None = None  # from the manifest, where it says (the start of a run checks it: check_shards_present)


@dataclass(frozen=True)
class Dataset:
    """A dataset written by ``python -m preprocessing`` (see docs/contracts.md): a local directory or an object
    store URL (``s3://bucket/prefix``, any fsspec URL; runtime.storage)."""

    root: str
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
        """The split's non-empty shards, as absolute paths or URLs."""
        entries = self.manifest["splits"][split]["shards"]
        return [
            Shard(storage.join(self.root, e["path"]), int(e["samples"]), e.get("sha256"), e.get("bytes"))
            for e in entries
            if int(e["samples"]) > 0
        ]


def read_manifest(location: str | Path) -> dict[str, Any] | None:
    """The dataset's ``manifest.json`` (local or in an object store), or None when there is none."""
    path = storage.join(location, "manifest.json")
    try:
        text = storage.read_bytes(path).decode("utf-8")
    except FileNotFoundError:
        return None
    except (NotADirectoryError, IsADirectoryError):
        return None
    try:
        return json.loads(text)
    except ValueError as err:
        raise ConfigError(f"data: {path} is not valid JSON: {err}") from None


def open_dataset(path: str | Path) -> Dataset:
    """Read ``manifest.json``; it is published last, so its absence means an unfinished dataset."""
    root = str(path)
    manifest_path = storage.join(root, "manifest.json")
    manifest = read_manifest(root)
    if manifest is None:
        raise ConfigError(f"data: no manifest.json in {root} (not a finished `python -m preprocessing` output)")
    for split in ("train", "valid"):
        if split not in manifest.get("splits", {}):
            raise ConfigError(f"data: {manifest_path} has no '{split}' split")
    dataset = Dataset(root, manifest)
    if not dataset.shards("train"):
        raise ConfigError(f"data: {manifest_path} lists no non-empty train shard")
    return dataset


def check_shards_present(dataset: Dataset, splits: tuple[str, ...] = ("train", "valid")) -> str:
    """The start of a run: every shard the manifest lists for ``splits`` exists, with the size the manifest gives
    it (where the manifest records sizes), found by a listing (``storage.sizes``), not a read: seconds for
    thousands of shards, where a shard missing would otherwise stop the run only when a loader reaches it, hours
    in (or never, in a short run). A ConfigError naming the shards and the fix otherwise; else its one line.
    A truncated or altered shard of the same size is the sha256 check's to find, when it is read."""
    shards = {split: dataset.shards(split) for split in splits}
    listed = [shard for split in splits for shard in shards[split]]
    try:
        found = storage.sizes([shard.path for shard in listed])
    except OSError as err:  # a store that refused the listing and the stat (credentials) or stayed away
        raise ConfigError(f"data: cannot list the shards of {dataset.root}: {err}") from None
    missing = [shard.path for shard in listed if found[shard.path] is None]
    resized = [
        f"{shard.path} has {found[shard.path]:,} bytes, the manifest says {shard.bytes:,}"
        for shard in listed
        if found[shard.path] is not None and shard.bytes is not None and found[shard.path] != shard.bytes
    ]
    if missing or resized:
        problems = (
            [f"{len(missing)} missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"]
            if missing
            else []
        )
        problems += resized[:3] + ([f"{len(resized) - 3} more of another size"] if len(resized) > 3 else [])
        raise ConfigError(
            f"data: of the {len(listed)} shards {storage.join(dataset.root, 'manifest.json')} lists, "
            + "; ".join(problems)
            + ": copy the dataset again from where it was made, or re-run the preprocessing into a new directory"
        )
    counts = " + ".join(f"{len(shards[split])} {split}" for split in splits)
    sized = [shard for shard in listed if shard.bytes is not None]
    if len(sized) == len(listed):
        return f"data: {counts} shards present, {size_text(sum(s.bytes for s in sized))} as the manifest says"
    total = sum(found[shard.path] or 0 for shard in listed)
    return f"data: {counts} shards present, {size_text(total)} (the manifest records no sizes to compare with)"


def load_token_counts(dataset_dir: str | Path) -> np.ndarray:
    """The dataset's per-token train-split frequencies (``manifest["token_counts"]``, see docs/contracts.md), which
    ``masking.frequency_smoothing`` weights the masking with."""
    try:
        manifest = json.loads(storage.read_bytes(storage.join(dataset_dir, "manifest.json")))
        counts = np.load(
            io.BytesIO(storage.read_bytes(storage.join(dataset_dir, manifest["token_counts"]))), allow_pickle=False
        )
    except (OSError, KeyError, ValueError) as err:
        raise ConfigError(
            f"masking.frequency_smoothing: cannot read the token counts of {dataset_dir}: {err}"
        ) from None
    if counts.ndim != 1 or not np.issubdtype(counts.dtype, np.integer):
        raise ConfigError(f"masking.frequency_smoothing: {dataset_dir} token counts must be a 1-D integer array")
    return counts


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


class DamagedShard(RuntimeError):
    """A shard whose bytes are not the ones the preprocessing wrote (the manifest's sha256)."""


DAMAGED = "__damaged__"  # marks a stand-in for a sample of a skipped damaged shard (loader.damaged_shards=skip)


def is_damaged(sample: dict[str, Any]) -> bool:
    return DAMAGED in sample


@dataclass(frozen=True)
class ShardReader:
    """How shards are read: whole, from a local path or an object store (runtime.storage), each checked against
    the manifest's sha256 before any of its samples is used, the next one read in the background while the
    current one's samples are consumed (so reads overlap compute; at most two shards in memory per stream).

    A shard that does not hash to the manifest's value stops the run with :class:`DamagedShard` naming it:
    never a silent wrong sample. From an object store it is read once more first (a torn transfer). With
    ``skip_damaged`` (``loader.damaged_shards=skip``) it is skipped instead, with a warning naming it: its
    samples become stand-ins (marked :data:`DAMAGED`), as many as the manifest counts, so that every stream's
    position (samples passed) and with it an exact resume stay what they would have been; the consumers drop
    them and count them.
    ``cache_dir``: fetched remote shards are kept there (by their sha256, at most ``cache_max_gb``, the least
    recently used evicted first), so that later epochs read the local copy."""

    attempts: int = 5
    retry_max_s: float = 30.0
    cache_dir: str | None = None
    cache_max_gb: float = 100.0
    skip_damaged: bool = False

    @classmethod
    def from_config(cls, loader_cfg: Any) -> ShardReader:
        return cls(
            loader_cfg.read_attempts,
            loader_cfg.read_retry_max_s,
            loader_cfg.cache_dir,
            loader_cfg.cache_max_gb,
            loader_cfg.damaged_shards == "skip",
        )

    def read(self, shard: Shard) -> bytes | None:
        """The shard's verified bytes; None for a damaged shard that is to be skipped."""
        remote = storage.is_url(shard.path)
        cached = self.from_cache(shard) if remote else None
        if cached is not None:
            return cached
        for attempt in (1, 2) if remote else (1,):
            data = self.read_bytes(shard)
            digest = hashlib.sha256(data).hexdigest()
            if shard.sha256 is None or digest == shard.sha256:
                break
            if attempt == 1 and remote:
                log.warning("data: %s does not match its sha256 (a torn read?); reading it again", shard.path)
                continue
            damage = (
                f"data: shard {shard.path} is damaged: its {len(data):,} bytes hash to sha256 {digest[:16]}..., "
                f"the manifest says {shard.sha256[:16]}... (truncated or modified after preprocessing)"
            )
            if self.skip_damaged:
                log.warning("%s; skipping its %d samples (loader.damaged_shards=skip)", damage, shard.samples)
                return None
            raise DamagedShard(
                f"{damage}; no sample of it was used. Restore the shard or re-run the preprocessing, or set "
                "loader.damaged_shards=skip to train on without its samples."
            )
        if remote:
            self.to_cache(shard, data)
        return data

    def read_bytes(self, shard: Shard) -> bytes:
        """The shard's bytes as they are; a shard removed or made unreadable after the start of the run fails in one
        line naming it (common.cli.run_cli prints a FileNotFoundError or PermissionError as that line)."""
        try:
            return storage.read_bytes(shard.path, attempts=self.attempts, retry_max_s=self.retry_max_s)
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT,
                f"data: shard {shard.path} is gone (the manifest lists it, {shard.samples} samples): restore it, "
                "e.g. copy the dataset again, and relaunch to resume from the last checkpoint",
            ) from None
        except PermissionError as err:
            raise PermissionError(
                err.errno,
                f"data: shard {shard.path} cannot be read: {(err.strerror or 'permission denied').lower()}: make it "
                "readable by this user and relaunch to resume from the last checkpoint",
            ) from None

    def samples(self, shards: list[Shard]) -> Iterator[dict[str, Any]]:
        """The raw samples of ``shards`` in order; shard i + 1 is read while shard i's samples are consumed."""
        if not shards:
            return
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-prefetch")
        try:
            ahead = pool.submit(self.read, shards[0])
            for i, shard in enumerate(shards):
                data = ahead.result()
                if i + 1 < len(shards):
                    ahead = pool.submit(self.read, shards[i + 1])
                if data is None:  # skipped: one stand-in per sample the manifest counts
                    yield from ({"__key__": f"{shard.path}#{j}", DAMAGED: True} for j in range(shard.samples))
                    continue
                files = wds.tariterators.tar_file_expander([{"url": shard.path, "stream": io.BytesIO(data)}])
                yield from wds.tariterators.group_by_keys(files)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------------------------------- the cache
    def cached_path(self, shard: Shard) -> Path | None:
        return None if self.cache_dir is None or shard.sha256 is None else Path(self.cache_dir) / f"{shard.sha256}.tar"

    def from_cache(self, shard: Shard) -> bytes | None:
        path = self.cached_path(shard)
        if path is None or not path.is_file():
            return None
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != shard.sha256:  # damaged on the local disk: fetch it again
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used
        return data

    def to_cache(self, shard: Shard, data: bytes) -> None:
        path = self.cached_path(shard)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # workers of several ranks may write at once
        tmp.write_bytes(data)
        os.replace(tmp, path)
        entries = []
        for entry in path.parent.glob("*.tar"):
            with contextlib.suppress(FileNotFoundError):  # another process evicted it meanwhile
                stat = entry.stat()
                entries.append((stat.st_mtime, stat.st_size, entry))
        excess = sum(size for _, size, _ in entries) - self.cache_max_gb * 2**30
        for _, size, entry in sorted(entries):
            if excess <= 0:
                break
            if entry != path:
                entry.unlink(missing_ok=True)
                excess -= size


DEFAULT_READER = ShardReader()  # no cache, the default retries: what a reader without a loader config uses


@dataclass(frozen=True)
class SlotStream:
    """The infinite, deterministic sample stream ``slot`` of ``num_slots`` (see the module docstring)."""

    shards: tuple[Shard, ...]
    slot: int
    num_slots: int
    seed: int
    shuffle_buffer: int
    reader: ShardReader = DEFAULT_READER

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
        mine = itertools.islice(self.reader.samples(shards), offset, None, stride)
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

    def raw(self, skip: int = 0) -> Iterator[dict[str, Any]]:
        """The undecoded stream from sample ``skip`` on, epoch after epoch."""
        first = 0
        while skip >= (size := self.epoch_size(first)):
            skip -= size
            first += 1
        for epoch in itertools.count(first):
            yield from itertools.islice(self.epoch_raw(epoch), skip, None)
            skip = 0


def padding_mask(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor | None:
    """The attention mask of a host batch, or None when it has no padding (the packed common
    case), decided on the host so the model can take SDPA's unmasked path."""
    mask = input_ids.ne(pad_id)
    return None if bool(mask.all()) else mask


def owned_streams(rank: int, world_size: int, num_streams: int) -> range:
    """The block of streams rank ``rank`` of ``world_size`` reads."""
    return range(rank * num_streams // world_size, (rank + 1) * num_streams // world_size)


def micro_batch_plan(positions: dict[int, int], micro_batch_size: int) -> Iterator[tuple[int, int]]:
    """A rank's micro-batches in order, as (stream, its first sample's position in the stream): each
    from the stream that has delivered the fewest samples, the lowest-numbered on a tie."""
    positions = dict(positions)
    while True:
        stream = min(positions, key=lambda k: (positions[k], k))
        yield stream, positions[stream]
        positions[stream] += micro_batch_size


class TrainStream(torch.utils.data.IterableDataset):
    """One rank's micro-batches, ``{"input_ids": int64 [micro_batch, seq_len], "keys": [sample key, ...]}``,
    from its streams starting at ``positions`` (stream -> samples already delivered)."""

    def __init__(
        self,
        shards: list[Shard],
        *,
        micro_batch_size: int,
        positions: dict[int, int],
        num_streams: int,
        num_workers: int,
        seed: int,
        shuffle_buffer: int,
        reader: ShardReader = DEFAULT_READER,
    ) -> None:
        super().__init__()
        self.reader = reader
        self.shards = tuple(shards)
        self.micro_batch_size = micro_batch_size
        self.positions = dict(positions)
        self.num_streams = num_streams
        self.num_workers = max(1, num_workers)
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        check_split_feeds_streams(self.shards, num_streams)

    def stream(self, k: int) -> SlotStream:
        return SlotStream(self.shards, k, self.num_streams, self.seed, self.shuffle_buffer, self.reader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The micro-batches; a shard that cannot be read ends them with ``{FAULT: the error}``, which
        :class:`TrainLoader` raises in the rank: raised in a DataLoader worker, the error would reach the rank as
        the worker's whole traceback inside another message ("Caught FileNotFoundError in DataLoader worker
        process 0 ..."), the shard's name 40 lines down."""
        try:
            yield from self.batches()
        except (OSError, DamagedShard) as err:
            yield {FAULT: err}

    def batches(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        readers: dict[int, tuple[Iterator[dict[str, Any]], int]] = {}  # stream -> (raw samples, position)
        last_good: dict[int, list[dict[str, Any]]] = {}  # stream -> its last micro-batch's real samples
        plan = micro_batch_plan(self.positions, self.micro_batch_size)
        for j, (k, start) in enumerate(plan):
            if j % self.num_workers != worker:
                continue
            samples, at = readers.get(k) or (self.stream(k).raw(start), start)
            # Another worker's micro-batches of the same stream are passed over undecoded.
            raw = list(itertools.islice(samples, start - at, start - at + self.micro_batch_size))
            readers[k] = (samples, start + self.micro_batch_size)
            good = [sample for sample in raw if not is_damaged(sample)]
            damaged = len(raw) - len(good)
            if damaged:  # skipped shards' stand-ins: the batch keeps its shape with this stream's real samples
                good = good or last_good.get(k, [])
                if not good:
                    raise DamagedShard(
                        f"data: stream {k}'s micro-batch at sample {start} comes wholly from skipped damaged shards "
                        f"({raw[0]['__key__']} ...) and the stream has no earlier sample to stand in"
                    )
                raw = list(itertools.islice(itertools.cycle(good), len(raw)))
            last_good[k] = good
            batch = np.stack([decode(sample) for sample in raw])
            yield {
                "input_ids": torch.from_numpy(batch.astype(np.int64)),
                "keys": [r["__key__"] for r in raw],
                "damaged": damaged,
            }


def fresh_streams(loader_cfg: Any, world_size: int) -> int:
    """A new run's number of streams: ``loader.streams``, else one per rank and loader worker. A resumed run
    keeps its checkpoint's."""
    return loader_cfg.streams or world_size * max(1, loader_cfg.num_workers)


def check_streams_fit(num_streams: int, world_size: int) -> None:
    if world_size > num_streams:
        raise ConfigError(
            f"loader.streams: this run's data order has {num_streams} streams, fewer than its {world_size} "
            "ranks; it can resume on at most that many (start a run with loader.streams=N to grow to N ranks)"
        )


def check_split_feeds_streams(shards: tuple[Shard, ...] | list[Shard], num_streams: int) -> None:
    total = sum(s.samples for s in shards)
    if len(shards) < num_streams and total < num_streams:
        raise ConfigError(
            f"data: the train split has {total} samples, fewer than its {num_streams} streams "
            "(loader.streams, by default ranks x loader.num_workers)"
        )


class TrainLoader:
    """Iterator of micro-batches that knows its position; ``state()`` goes in the checkpoint.

    With the environment variable ``ENCODER_DISTILL_SAMPLE_TRACE=DIR`` every rank also appends the
    keys of each micro-batch it consumes to ``DIR/rank-R.jsonl`` (a test hook; off by default).
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        loader_cfg: Any,
        seed: int,
        state: dict[str, Any] | None = None,
    ) -> None:
        state = None if state is None else upgrade_state(state)
        if state is None:
            num_streams = fresh_streams(loader_cfg, world_size)
            positions = dict.fromkeys(range(num_streams), 0)
        else:
            num_streams, positions = int(state["streams"]), {int(k): int(p) for k, p in state["positions"].items()}
            changed = {
                key: (state.get(key), value)
                for key, value in (("seed", seed), ("shuffle_buffer", loader_cfg.shuffle_buffer))
                if state.get(key) not in (None, value)  # None: not recorded (an older checkpoint)
            }
            if loader_cfg.streams not in (None, num_streams):
                changed["streams"] = (num_streams, loader_cfg.streams)
            if changed:
                log.warning(
                    "data order changed since the checkpoint %s (before, now): the streams continue from their "
                    "positions, but not with the samples an uninterrupted run would have seen; loader.streams "
                    "stays the checkpoint's",
                    changed,
                )
        check_streams_fit(num_streams, world_size)
        mine = owned_streams(rank, world_size, num_streams)
        missing = [k for k in mine if k not in positions]
        if missing:
            raise RuntimeError(f"the checkpoint's data state has no position for streams {missing}")
        self.positions = {k: positions[k] for k in mine}
        self.num_streams = num_streams
        self.micro_batch_size = micro_batch_size
        self.order = {"seed": seed, "shuffle_buffer": loader_cfg.shuffle_buffer}
        self.plan = micro_batch_plan(self.positions, micro_batch_size)
        stream = TrainStream(
            dataset.shards("train"),
            micro_batch_size=micro_batch_size,
            positions=self.positions,
            num_streams=num_streams,
            num_workers=loader_cfg.num_workers,
            seed=seed,
            shuffle_buffer=loader_cfg.shuffle_buffer,
            reader=ShardReader.from_config(loader_cfg),
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
        trace = os.environ.get(SAMPLE_TRACE_ENV)
        self.trace = None
        if trace:
            Path(trace).mkdir(parents=True, exist_ok=True)
            self.trace = (Path(trace) / f"rank-{rank}.jsonl").open("a", buffering=1)

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> dict[str, Any]:
        batch = next(self.iterator)
        if FAULT in batch:  # a shard a worker could not read (TrainStream.__iter__): its own one-line error
            raise batch[FAULT]
        stream, start = next(self.plan)
        self.positions[stream] = start + self.micro_batch_size  # samples passed, skipped stand-ins included
        if self.trace is not None:
            self.trace.write(json.dumps({"stream": stream, "keys": batch["keys"]}) + "\n")
        return batch

    def state(self) -> dict[str, Any]:
        """Every stream's position (gathered from all ranks: a collective when a process group is up;
        without one, this rank's streams only) and what the order depends on."""
        positions = dict(self.positions)
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[dict[int, int] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, positions)
            positions = {k: p for part in gathered for k, p in part.items()}
        return {"streams": self.num_streams, "positions": positions, **self.order}


def upgrade_state(state: dict[str, Any]) -> dict[str, Any]:
    """A data state from before streams (micro-batches per rank, every rank's worker a stream of its
    own) in today's form, so that older checkpoints resume where they stopped."""
    if "streams" in state:
        return state
    workers, micro_batches = max(1, int(state["num_workers"])), int(state["micro_batches"])
    per_batch = int(state["micro_batch_size"])
    positions = {
        rank * workers + w: per_batch * max(0, (micro_batches - w + workers - 1) // workers)
        for rank in range(int(state["world_size"]))
        for w in range(workers)
    }
    return {"streams": len(positions), "positions": positions, "seed": state["seed"], "shuffle_buffer": None}


def valid_batches(
    dataset: Dataset,
    *,
    micro_batch_size: int,
    max_batches: int,
    rank: int,
    world_size: int,
    reader: ShardReader = DEFAULT_READER,
) -> list[tuple[int, torch.Tensor]]:
    """This rank's share of the first ``max_batches`` valid batches, in file order, each with its index among them.

    Every rank gets the same number of batches (ZeRO-3 forwards are collective); when there
    are fewer batches than ranks, some are evaluated twice, and when the ranks do not divide them, the
    last few are left out. An empty valid split gives none.
    """
    shards = dataset.shards("valid")
    samples = (sample for sample in reader.samples(shards) if not is_damaged(sample))  # skipped shards: left out
    rows = [decode(s) for s in itertools.islice(samples, max_batches * micro_batch_size)]
    batches = [np.stack(rows[i : i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]
    if not batches:
        return []
    per_rank = max(1, len(batches) // world_size)
    mine = [(rank * per_rank + i) % len(batches) for i in range(per_rank)]
    return [(index, torch.from_numpy(batches[index].astype(np.int64))) for index in mine]
