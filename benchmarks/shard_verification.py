"""What checking every shard against the manifest's sha256 costs a training step.

    python benchmarks/shard_verification.py --data DATASET [--repeats 20] [--out docs/training/shard-verification.json]

The reader (``trainer.runtime.data.ShardReader``) hashes each shard whole, in its prefetch thread, before any of
its samples is used. Measured here, side by side in one process on this machine's CPU: reading every train
shard of DATASET from memory through the reader's own ``samples`` with verification and without (the manifest's
sha256 removed), and the bare sha256 rate. The cost per step is then the bytes a step of the
``distilbert-base`` preset consumes (its tokens times the dataset's shard bytes per token) over the hash rate,
set against that step's measured time on the GPU (the committed GPU campaign): the share of step time the
prefetch thread spends hashing, an upper bound on what the loop can feel, since the thread runs beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.suite_time import provenance, write_result  # noqa: E402
from trainer.planning.cluster import campaign_throughput  # noqa: E402
from trainer.runtime.data import Shard, ShardReader, open_dataset  # noqa: E402

PRESET = ("distilbert-base", 512, 64, 4096)  # preset, sequence length, micro-batch, global batch


class MemoryReader(ShardReader):
    """The reader with the shard bytes served from memory, so that the hash is what differs, not the disk."""

    def __init__(self, blobs: dict[str, bytes]) -> None:
        super().__init__()
        object.__setattr__(self, "blobs", blobs)

    def read(self, shard: Shard) -> bytes | None:
        data = self.blobs[shard.path]
        if shard.sha256 is not None and hashlib.sha256(data).hexdigest() != shard.sha256:
            raise RuntimeError(f"{shard.path} does not match its sha256")
        return data


def seconds_to_read(reader: ShardReader, shards: list[Shard]) -> float:
    started = time.perf_counter()
    for _ in reader.samples(shards):
        pass
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a dataset written by python -m preprocessing")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "training" / "shard-verification.json")
    args = parser.parse_args()
    header = provenance(" ".join(["python benchmarks/shard_verification.py", *sys.argv[1:]]))

    dataset = open_dataset(args.data)
    shards = dataset.shards("train")
    blobs = {s.path: Path(s.path).read_bytes() for s in shards}
    total = sum(len(b) for b in blobs.values())
    tokens = sum(s.samples for s in shards) * dataset.max_seq_len
    unverified = [dataclasses.replace(s, sha256=None) for s in shards]
    reader = MemoryReader(blobs)
    with_hash, without_hash, bare = [], [], []
    for _ in range(args.repeats):  # interleaved, so that drift hits both alike
        with_hash.append(seconds_to_read(reader, shards))
        without_hash.append(seconds_to_read(reader, unverified))
        started = time.perf_counter()
        for blob in blobs.values():
            hashlib.sha256(blob).digest()
        bare.append(time.perf_counter() - started)
    hash_rate = total / statistics.median(bare)  # bytes/s

    preset, seq_len, micro, global_batch = PRESET
    measured = campaign_throughput(preset, seq_len, micro, global_batch)
    step_tokens = global_batch * seq_len
    step_s = step_tokens / measured.tokens_per_s
    step_bytes = step_tokens * total / tokens
    result = {
        **header,
        "dataset": {"path": str(args.data), "train_shards": len(shards), "bytes": total, "tokens": tokens},
        "repeats": args.repeats,
        "read_s": {"verified": statistics.median(with_hash), "unverified": statistics.median(without_hash)},
        "read_ratio": statistics.median(with_hash) / statistics.median(without_hash),
        "sha256_mb_per_s": hash_rate / 1e6,
        "shard_bytes_per_token": total / tokens,
        "step": {"preset": preset, "tokens": step_tokens, "seconds": step_s, "source": measured.source},
        "hash_s_per_step": step_bytes / hash_rate,
        "share_of_step": step_bytes / hash_rate / step_s,
    }
    write_result(args.out, result)
    print(
        f"sha256 {hash_rate / 1e6:,.0f} MB/s; reading shards verified / unverified {result['read_ratio']:.3f}; "
        f"a {preset} step reads {step_bytes / 1e6:.1f} MB: {result['hash_s_per_step'] * 1e3:.1f} ms of hashing "
        f"against a {step_s * 1e3:,.0f} ms step = {result['share_of_step']:.3%}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
