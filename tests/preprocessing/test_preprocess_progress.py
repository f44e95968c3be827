"""Progress on every long stage: the driver's per-stage lines, from the markers the workers leave."""

import re
import time
from pathlib import Path

from helpers import REPO, preprocess

from preprocessing.progress import Markers, StageWatch, rate_and_eta


def test_the_driver_adds_up_the_workers_markers_stage_by_stage(tmp_path):
    """Reading in bytes on disk (the latest position of each file), tokenizing in hash buckets (a share of
    the input each), writing in shards of those planned; a stage that did not move is reported once per look."""
    markers = Markers(str(tmp_path))
    watch = StageWatch(str(tmp_path), files=2, input_bytes=4_000_000, buckets=4, interval=60)
    assert watch.lines() == ["progress: read 0.0 of 4.0 MB on disk (0%), 0 of 2 files begun, 0 documents; ETA unknown"]
    markers.mark("read", "a", 500_000, 10)
    markers.mark("read", "a", 1_000_000, 20)  # a later position of the same file replaces the earlier one
    markers.mark("read", "b", 1_000_000, 5)
    time.sleep(0.01)
    [line] = watch.lines()
    assert line.startswith("progress: read 2.0 of 4.0 MB on disk (50%), 2 of 2 files begun, 25 documents; ")
    assert re.search(r"[\d.]+ MB/s, ETA \dm\d\ds$", line)
    markers.mark("tokenize", "000001", 7, 700)
    assert watch.lines() == [
        "progress: tokenized 1 of 4 hash buckets (25% of the input), 7 documents, 700 tokens; ETA unknown"
    ]
    markers.mark("tokenize", "000003", 3, 300)
    time.sleep(0.01)
    [line] = watch.lines()
    assert line.startswith("progress: tokenized 2 of 4 hash buckets (50% of the input), 10 documents, 1,000 tokens;")
    assert "MB of input/s, ETA" in line
    markers.mark("plan", "train", 3)
    markers.mark("plan", "valid", 1)
    markers.mark("write", "train", "000000", 100)
    assert watch.lines() == ["progress: wrote 1 of 4 shards (25%), 100 sequences packed; ETA unknown"]
    time.sleep(0.01)
    [line] = watch.lines()  # nothing moved: the stage in progress, once
    assert line.startswith("progress: wrote 1 of 4 shards (25%), 100 sequences packed; ") and "shards/s, ETA" in line


def test_rate_and_eta():
    assert rate_and_eta(25, 100, 10, "MB") == "2.5 MB/s, ETA 0m30s"
    assert rate_and_eta(100, 100, 10, "MB") == "10.0 MB/s, done"
    assert rate_and_eta(1, 10_000, 1, "shards") == "1.0 shards/s, ETA 2h46m"
    assert rate_and_eta(0, 100, 10, "MB") == "ETA unknown"


def test_a_run_reports_each_stage_with_a_rate_and_an_eta(tmp_path, bert_tokenizer_dir):
    """The real pipeline (two worker processes) at a 0.05 s interval: every stage's line rises to its end,
    and the markers go with the work directory."""
    corpus = Path(REPO) / "demo" / "corpus.jsonl.gz"
    run = preprocess(
        tmp_path / "data", bert_tokenizer_dir, corpus, max_seq_len=128, samples_per_shard=20, progress_seconds=0.05
    )
    stages = {
        "read": r"progress: read ([\d.]+) of ([\d.]+) MB on disk \((\d+)%\)",
        "tokenize": r"progress: tokenized (\d+) of (\d+) hash buckets \((\d+)% of the input\)",
        "write": r"progress: wrote (\d+) of (\d+) shards \((\d+)%\)",
    }
    for stage, pattern in stages.items():
        percents = [int(m[2]) for m in re.findall(pattern, run.stderr)]
        assert percents and percents == sorted(percents) and percents[-1] == 100, (stage, run.stderr[-3000:])
    assert re.search(r"progress: tokenized .* MB of input/s, (ETA \dm\d\ds|done)", run.stderr)
    assert re.search(r"progress: wrote .* sequences packed; [\d,.]+ shards/s, (ETA \dm\d\ds|done)", run.stderr)
    assert not (tmp_path / "data" / ".work").exists()
