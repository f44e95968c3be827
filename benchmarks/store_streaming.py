"""Does streaming the dataset from an object store keep a GPU fed? The loader's data wait at a GPU's rate.

    .venv/bin/python benchmarks/store_streaming.py [--seconds 20] [--out FILE.json]
    .venv/bin/python benchmarks/store_streaming.py --table FILE.json

One rank's real loader (``TrainLoader``, one worker, the run's shard reader) over the tiny test dataset
(the sample corpus at 64 tokens, 128 samples a shard), uploaded to a real S3 server (moto's) on
127.0.0.1 and read through a TCP proxy that throttles each connection's bandwidth. The loop stands in
for a GPU: it takes a micro-batch, then "computes" for as long as that GPU would take over as many
sequences (the fastest real-engine case of the committed GPU campaign, docs/gpu-campaign/throughput.json:
its tokens/s over its sequence length, in sequences/s, in its micro-batches; or ``--sequences-per-s``
and ``--micro-batch``), and measures the share
of time it stood waiting for data. The store's bandwidth is set relative to what that rate consumes
(sequences/s times this dataset's bytes per sequence): below 1x no reader keeps up; above it, the shard
prefetch has to hide each shard's fetch. Both times scale with the bytes of a sequence, so the test's
short sequences give the answer for long ones at the same relative bandwidth. The local directory is
the baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from benchmarks.suite_time import provenance, write_result  # noqa: E402  (REPO on the path first)

BANDWIDTHS = (0.8, 1.5, 3.0, None)  # x what the GPU rate consumes; None: unthrottled


def campaign_rate() -> tuple[float, int, str]:
    """The GPU campaign's fastest real-engine case: its sequences/s, its micro-batch and its name."""
    cases = json.loads((REPO / "docs" / "gpu-campaign" / "throughput.json").read_text())["cases"]
    best = max((c for c in cases if c.get("rc") == 0), key=lambda c: c["tokens_per_s"])
    return best["tokens_per_s"] / best["seq"], best["micro"], best["name"]


def measure(data: str, sequences_per_s: float, micro_batch: int, seconds: float) -> dict[str, float]:
    """Run one rank's loader at ``sequences_per_s`` in micro-batches of ``micro_batch`` for ``seconds``; its
    data-wait share."""
    from trainer.config import LoaderConfig
    from trainer.runtime.data import TrainLoader, open_dataset

    cfg = LoaderConfig(num_workers=1, shuffle_buffer=64)
    loader = TrainLoader(open_dataset(data), micro_batch_size=micro_batch, rank=0, world_size=1, loader_cfg=cfg, seed=0)
    next(loader)  # the loader worker's start and the first shard are the launch's, not the steady state's
    waited, started, batches = 0.0, time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        before = time.perf_counter()
        batch = next(loader)["input_ids"]
        waited += time.perf_counter() - before
        time.sleep(len(batch) / sequences_per_s)  # the GPU's time over as many sequences
        batches += 1
    elapsed = time.perf_counter() - started
    return {"data_wait_share": round(waited / elapsed, 4), "batches": batches, "seconds": round(elapsed, 1)}


def table(result: dict) -> str:
    sizes = result["sizes"]
    lines = [
        f"At {sizes['sequences_per_s']:,.0f} sequences/s per rank ({sizes['rate_from']}), "
        f"{sizes['bytes_per_s_needed'] / 1e6:.2f} MB/s of this dataset's shards:",
        "",
    ]
    lines += ["| source | store bandwidth | data wait, share of time |", "|---|---|---|"]
    for row in result["rows"]:
        bandwidth = (
            "local disk"
            if row["source"] == "local"
            else (f"{row['bandwidth_x']}x the need" if row["bandwidth_x"] else "unthrottled")
        )
        lines.append(f"| {row['source']} | {bandwidth} | {row['data_wait_share'] * 100:.2f} % |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="per measurement (default 20)")
    parser.add_argument("--sequences-per-s", type=float, help="one GPU's rate (default: the GPU campaign's best)")
    parser.add_argument("--micro-batch", type=int, help="sequences per micro-batch (default: that case's)")
    parser.add_argument("--out", type=Path, help="write the result JSON here")
    parser.add_argument("--table", type=Path, help="print the markdown table of this result file, and exit")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    import os

    from helpers import S3_CREDENTIALS, MotoServer, TcpProxy

    from benchmarks.launch_overhead import build_inputs
    from trainer.runtime import storage

    rate, micro, rate_from = campaign_rate()
    if args.sequences_per_s:
        rate, rate_from = args.sequences_per_s, "--sequences-per-s"
    micro = args.micro_batch or micro
    with tempfile.TemporaryDirectory(prefix="store-streaming-") as tmp:
        _, data = build_inputs(Path(tmp))
        manifest = json.loads((data / "manifest.json").read_text())
        shard_bytes = sum(p.stat().st_size for p in (data / "train").glob("*.tar"))
        bytes_per_sequence = shard_bytes / manifest["splits"]["train"]["samples"]
        needed = rate * bytes_per_sequence
        server = MotoServer(Path(tmp) / "moto.log")
        server.start()
        try:
            url = server.upload(data, "bench", "tiny")
            os.environ.update(S3_CREDENTIALS)
            rows = [{"source": "local", "bandwidth_x": None, **measure(str(data), rate, micro, args.seconds)}]
            for times in BANDWIDTHS:
                proxy = TcpProxy(server.port, bytes_per_s=times * needed if times else None)
                os.environ["AWS_ENDPOINT_URL"] = proxy.url
                storage.CLIENTS.clear()
                rows.append({"source": "s3", "bandwidth_x": times, **measure(url, rate, micro, args.seconds)})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            server.stop()
    result = {
        **provenance(" ".join(["benchmarks/store_streaming.py", *sys.argv[1:]])),
        "sizes": {
            "sequences_per_s": round(rate, 1),
            "rate_from": rate_from,
            "micro_batch": micro,
            "seq_len": manifest["max_seq_len"],
            "bytes_per_sequence": round(bytes_per_sequence, 1),
            "bytes_per_s_needed": round(needed),
            "seconds": args.seconds,
        },
        "rows": rows,
    }
    print(table(result))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
