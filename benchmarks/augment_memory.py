"""Peak memory of ``python -m preprocessing.augment`` (DirectRunner) at a few input sizes.

Each size runs in a fresh process; its peak RSS is the kernel's ``ru_maxrss`` for that child
(``os.wait4``; the DirectRunner's worker threads live in that process). The input is synthetic:
``--lines`` JSONL examples of ``--words`` words (about 6 characters each) drawn from a fixed word
list (seeded, so every run reads the same text). The masked LM is ``--mlm``, or the tests' tiny
one (the real bert-base-uncased vocabulary, 4 layers of width 64) built once into ``--work``.
Memory is what is measured, so the defaults make the rows long (every variant copies the whole
text) and the MLM cheap (``max_seq_len=16``: candidates for the first dozen words only)::

    python benchmarks/augment_memory.py --lines 100 400 1600 [--variants 20] [--words 500 700] [--mlm DIR]
        [--out docs/preprocessing/augment-memory.json] [--docs docs/benchmarks.md]

``--out`` keeps the figures as a result file, ``--docs`` renders its table into that page (between the
``augment-memory`` markers); ``--from-result`` renders an existing file without measuring.
``tests/test_benchmark_augment_memory.py`` holds the result: 4x the input must not raise the peak.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.suite_time import add_result_options, made_by, measured_or_committed, provenance  # noqa: E402

VOCABULARY = (
    "the a socket server answers each client in its own thread logging module lets every library write to "
    "one application log regular expressions match patterns in text json reads and writes structured data "
    "river mountain city music film history school team game season album song station road bridge"
)
WORDS = VOCABULARY.split()


def write_input(path: Path, lines: int, words: tuple[int, int]) -> None:
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(lines):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))).capitalize() + "."
            f.write(json.dumps({"text": text, "label": i % 2}) + "\n")


def tiny_mlm(dest: Path) -> Path:
    if not (dest / "config.json").is_file():
        sys.path.insert(0, str(REPO / "tests"))
        from helpers import bert_tokenizer_dir, build_tiny_teacher

        build_tiny_teacher(dest, bert_tokenizer_dir())
    return dest


def measure(input_file: Path, output: Path, args: argparse.Namespace, mlm: Path) -> tuple[float, float, str]:
    """(peak RSS in GB, seconds, the command's last stdout line) of one fresh command-line run."""
    command = [
        sys.executable, "-m", "preprocessing.augment", f"input={input_file}", f"mlm={mlm}", f"output={output}",
        f"variants={args.variants}", f"max_seq_len={args.max_seq_len}", f"beam.direct_num_workers={args.workers}",
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    stdout = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(command)}")
    return usage.ru_maxrss / 2**20, time.monotonic() - started, stdout.strip().splitlines()[-1]


def table(result: dict) -> str:
    rows = ["| input lines | input | rows written (uncompressed) | peak RSS | time |", "|---:|---:|---:|---:|---:|"]
    for r in result["sizes"]:
        rows.append(
            f"| {r['lines']:,} | {r['input_mb']:.1f} MB | {r['rows_mb']:.0f} MB | {r['peak_rss_gb']:.2f} GB | "
            f"{r['seconds']:.0f} s |"
        )
    rows += [
        "",
        made_by(
            result, f"{result['machine']['cpus']} CPUs", f"{result['variants']} variants", f"{result['workers']} worker"
        )
        + ".",
    ]
    return "\n".join(rows)


def measure_sizes(args: argparse.Namespace) -> list[dict]:
    args.work.mkdir(parents=True, exist_ok=True)
    mlm = args.mlm or tiny_mlm(args.work / "tiny-mlm")
    sizes = []
    for lines in args.lines:
        input_file = args.work / f"input-{lines}.jsonl"
        write_input(input_file, lines, args.words)
        output = args.work / f"out-{lines}"
        shutil.rmtree(output, ignore_errors=True)
        peak, seconds, _ = measure(input_file, output, args, mlm)
        with gzip.open(output / "train.jsonl.gz", "rb") as f:
            rows = sum(len(line) for line in f) / 2**20
        size = {"lines": lines, "input_mb": input_file.stat().st_size / 2**20, "rows_mb": rows}
        sizes.append({**size, "peak_rss_gb": peak, "seconds": seconds})
        print(json.dumps(sizes[-1]), flush=True)
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, nargs="+", default=[100, 400, 1600])
    parser.add_argument("--variants", type=int, default=20)
    parser.add_argument("--words", type=int, nargs=2, default=[500, 700], help="words per text: min, max")
    parser.add_argument("--max-seq-len", type=int, default=16)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--mlm", type=Path)
    parser.add_argument("--work", type=Path, default=Path("/tmp/augment-memory"))
    add_result_options(parser, None)
    args = parser.parse_args()

    def measure() -> dict:
        return {
            **provenance(" ".join(["python benchmarks/augment_memory.py", *sys.argv[1:]])),
            "result_file": str(args.out.resolve().relative_to(REPO)) if args.out else None,
            "variants": args.variants,
            "workers": args.workers,
            "words": args.words,
            "sizes": measure_sizes(args),
        }

    print(table(measured_or_committed(args, measure, table, "augment-memory")))


if __name__ == "__main__":
    main()
