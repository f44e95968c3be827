"""TinyBERT's data augmentation on the real Beam DirectRunner: variants drawn from a real masked-LM,
deterministic for a seed whatever the worker count, labels copied, bad lines counted and skipped;
a glob of inputs written in shards that come back whole, in order, once each."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from common.config import ConfigError, from_dict
from preprocessing.augment import OUTPUT_FILE, SUMMARY_FILE, AugmentConfig, parse_row, read_lines, run

TEXTS = [
    "The logging module lets every library write to one application log.",
    "A socket server answers each client in its own thread.",
    "Regular expressions match patterns in text.",
    "The json module reads and writes structured data.",
]

REPO = Path(__file__).resolve().parents[2]
TWO_WORKERS = {"direct_num_workers": 2}  # two worker threads, each writing shards


@pytest.fixture
def task_file(tmp_path: Path) -> Path:
    lines = [json.dumps({"text": text, "pair": "second part", "label": i % 2}) for i, text in enumerate(TEXTS)]
    lines += ["this line is not json", json.dumps({"label": 1}), json.dumps({"text": "   ", "label": 0}), ""]
    path = tmp_path / "task.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return path


@pytest.fixture
def two_task_files(tmp_path: Path) -> tuple[str, list[dict[str, object]]]:
    """A glob matching a gzipped and a plain file of five examples each, and the examples in order.
    Each example has its own ``id`` (a column augmentation copies) to find it among the variants."""
    examples = []
    for name, opener in (("a.jsonl.gz", gzip.open), ("b.jsonl", open)):
        rows = [{"id": f"{name}:{i}", "text": TEXTS[i % 4], "label": i % 2} for i in range(5)]
        with opener(tmp_path / name, "wt") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))
        examples += rows
    return str(tmp_path / "*.jsonl*"), examples


def augment(task_file: Path | str, mlm: Path, out: Path, **values: object) -> dict[str, int]:
    settings = {"input": str(task_file), "mlm": str(mlm), "output": str(out), "variants": 3, "top_k": 5}
    return run(from_dict(AugmentConfig, {**settings, **values}))


def test_lines_that_cannot_be_read_or_parsed_are_skips_with_a_reason(tmp_path):
    """Each of these once ended the whole augmentation with a traceback."""
    good = json.dumps({"text": "a b", "label": 0})
    assert parse_row("[" * 100_000, ["text"]) == (None, "bad_json")  # RecursionError
    assert parse_row('{"text": "a b", "n": ' + "9" * 5000 + "}", ["text"]) == (None, "bad_json")  # 4,300 digits
    assert parse_row(good, ["text"])[1] is None

    plain = tmp_path / "bytes.jsonl"
    plain.write_bytes(good.encode() + b"\n" + b'{"text": "caf\xe9"}\n' + good.encode() + b"\n")
    assert [(line, skipped) for line, _, skipped in read_lines(str(plain))] == [
        (1, None),
        (2, "invalid_utf8"),
        (3, None),
    ]

    cut = tmp_path / "cut.jsonl.gz"
    whole = gzip.compress(("".join(good + "\n" for _ in range(2000))).encode())
    cut.write_bytes(whole[: len(whole) // 2])
    read = list(read_lines(str(cut)))
    assert read[-1][1:] == (None, "truncated_file") and all(text == good + "\n" for _, text, _ in read[:-1])


def test_variants_are_deterministic_counted_and_keep_labels(task_file, tiny_teacher_dir, tmp_path):
    counts = augment(task_file, tiny_teacher_dir, tmp_path / "a", probability=0.5)
    assert counts["examples"] == 4
    assert counts["skipped_bad_json"] == 1 and counts["skipped_missing_column"] == 1
    assert counts["skipped_empty_text"] == 1
    assert counts["variants"] + counts.get("duplicate_variants", 0) == 4 * 3
    with gzip.open(tmp_path / "a" / OUTPUT_FILE, "rt") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 4 + counts["variants"]
    assert json.loads((tmp_path / "a" / SUMMARY_FILE).read_text())["counts"] == counts
    # The original comes first, then its variants: same label and untouched columns, other words.
    assert rows[0] == {"text": TEXTS[0], "pair": "second part", "label": 0}
    variants = [r for r in rows if r["label"] == 0 and r["text"] != TEXTS[0] and r["text"] not in TEXTS]
    assert variants and all(r["pair"] == "second part" for r in variants)
    first_variant = rows[1]["text"].split()
    assert len(first_variant) == len(TEXTS[0].split())  # whole words replaced by whole words

    # Same seed, two workers: the same bytes. Another seed: other variants.
    augment(task_file, tiny_teacher_dir, tmp_path / "b", probability=0.5, beam=TWO_WORKERS)
    assert (tmp_path / "a" / OUTPUT_FILE).read_bytes() == (tmp_path / "b" / OUTPUT_FILE).read_bytes()
    augment(task_file, tiny_teacher_dir, tmp_path / "c", probability=0.5, seed=1)
    assert (tmp_path / "a" / OUTPUT_FILE).read_bytes() != (tmp_path / "c" / OUTPUT_FILE).read_bytes()


def test_glob_input_is_written_in_shards_whole_in_order_and_the_same_for_any_worker_count(
    two_task_files, tiny_teacher_dir, tmp_path
):
    """Two lines per shard: each file spans three shards, written by workers and joined by the driver.
    A shard lost or joined twice would drop or repeat an example's original and variants."""
    from trainer.finetuning.finetune import FinetuneConfig, read_dataset

    pattern, examples = two_task_files
    counts = augment(pattern, tiny_teacher_dir, tmp_path / "one", lines_per_shard=2, probability=0.5)
    augment(
        pattern, tiny_teacher_dir, tmp_path / "two", lines_per_shard=2, probability=0.5, beam={"direct_num_workers": 2}
    )
    assert (tmp_path / "one" / OUTPUT_FILE).read_bytes() == (tmp_path / "two" / OUTPUT_FILE).read_bytes()
    assert {p.name for p in (tmp_path / "one").iterdir()} == {OUTPUT_FILE, SUMMARY_FILE}  # no work files left

    with gzip.open(tmp_path / "one" / OUTPUT_FILE, "rt") as f:
        rows = [json.loads(line) for line in f]
    assert counts["examples"] == len(examples) and len(rows) == len(examples) + counts["variants"]
    # Each example once, in input order: its original, then its variants (same id and label, other words).
    ids = [row["id"] for row in rows]
    firsts = [i for i, example_id in enumerate(ids) if i == 0 or ids[i - 1] != example_id]
    assert [rows[i] for i in firsts] == examples
    for start, end in zip(firsts, [*firsts[1:], len(rows)], strict=True):
        variants = rows[start + 1 : end]
        assert all(v["label"] == rows[start]["label"] and v["text"] != rows[start]["text"] for v in variants)
    assert sum(end - start - 1 for start, end in zip(firsts, [*firsts[1:], len(rows)], strict=True)) > 0

    # The concatenated gzip members are one dataset for the trainer.
    output = tmp_path / "one" / OUTPUT_FILE
    split = read_dataset(output, FinetuneConfig(model="unused", data=str(output), output_dir="unused"))["train"]
    assert split.texts == [row["text"] for row in rows] and split.labels == [row["label"] for row in rows]


def test_command_line_with_two_worker_threads(two_task_files, tiny_teacher_dir, tmp_path):
    """A fresh process, where the two worker threads are the first to import transformers, at once."""
    pattern, examples = two_task_files
    out = tmp_path / "out"
    args = [f"input={pattern}", f"mlm={tiny_teacher_dir}", f"output={out}", "variants=2", "top_k=5"]
    proc = subprocess.run(
        [sys.executable, "-m", "preprocessing.augment", *args, "lines_per_shard=2", "beam.direct_num_workers=2"],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts == json.loads((out / SUMMARY_FILE).read_text())["counts"] and counts["examples"] == len(examples)


@pytest.mark.full
def test_the_runner_carries_keys_and_paths_never_rows(tiny_teacher_dir, tmp_path, monkeypatch):
    """Every PCollection of the real pipeline is measured (a step added to each, on the DirectRunner
    with two workers): with rows of ~9,000 characters, no element passing between steps is more
    than a few paths long. Rows or input lines carried by the runner, which the DirectRunner
    buffers whole, would fail this. A line over 16 Mi characters is a counted skip in passing."""
    import apache_beam as beam
    from apache_beam.pipeline import PipelineVisitor

    long_text = " ".join(TEXTS * 40)
    path = tmp_path / "long.jsonl"
    lines = [json.dumps({"text": f"{i}: {long_text}", "label": i % 2}) for i in range(6)]
    lines.insert(2, json.dumps({"text": "x" * (16 * 2**20), "label": 0}))  # over 16 Mi characters
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")

    class Outputs(PipelineVisitor):
        def __init__(self) -> None:
            self.outputs: dict[str, beam.PCollection] = {}

        def visit_transform(self, node: Any) -> None:
            self.outputs.update({f"{node.full_label}:{tag}": pcoll for tag, pcoll in node.outputs.items()})

    def size(element: object, step: str) -> None:
        beam.metrics.Metrics.distribution("element_chars", step).update(len(repr(element)))

    results, original_run = [], beam.Pipeline.run

    def measured_run(pipeline: beam.Pipeline, *args: Any, **kwargs: Any) -> Any:
        if not results:  # the user's pipeline, not the runner's copy of it
            visitor = Outputs()
            pipeline.visit(visitor)
            for i, (step, pcoll) in enumerate(visitor.outputs.items()):
                _ = pcoll | f"Measure {i}" >> beam.Map(size, step)
        results.append(original_run(pipeline, *args, **kwargs))
        return results[-1]

    monkeypatch.setattr(beam.Pipeline, "run", measured_run)
    counts = augment(path, tiny_teacher_dir, tmp_path / "out", lines_per_shard=4, beam=TWO_WORKERS)
    assert counts["skipped_too_long"] == 1 and counts["examples"] == 6

    with gzip.open(tmp_path / "out" / OUTPUT_FILE, "rt") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 6 + counts["variants"] and min(len(row["text"]) for row in rows) > 8_000
    query = beam.metrics.MetricsFilter().with_namespace("element_chars")
    largest = {d.key.metric.name: d.committed.max for d in results[0].metrics().query(query)["distributions"]}
    steps = {step.split("/")[0].split(":")[0] for step in largest}
    assert {"Files", "Split", "Spread", "Augment", "Group", "Write"} <= steps, largest
    assert max(largest.values()) < 1_000, largest


def test_a_failed_run_leaves_no_output_and_no_work_files(task_file, tiny_teacher_dir, tmp_path):
    """The MLM fails to load in the workers after the input was split into work files: the run
    raises, and neither the output nor its work directory is left behind."""
    import shutil

    broken = tmp_path / "broken-mlm"
    broken.mkdir()
    shutil.copy(tiny_teacher_dir / "config.json", broken)  # passes validation, has no weights
    before = set(tmp_path.iterdir())
    with pytest.raises(RuntimeError, match=r"no file named model\.safetensors"):  # the worker's error, wrapped
        augment(task_file, broken, tmp_path / "out")
    assert set(tmp_path.iterdir()) == before


def test_a_shard_streamed_from_its_rows_files_is_the_member_the_rows_compressed_at_once_were(tmp_path):
    """The output's bytes rest on this: rows files fed to zlib a chunk at a time (pieces of several
    chunks, given out of order) give ``gzip.compress(rows, mtime=0)``'s bytes; the files are then
    deleted, and a retry that finds the shard in place leaves it alone."""
    import random

    from preprocessing.augment import shard_name, write_shard

    rng = random.Random(0)
    words = [w for text in TEXTS for w in text.split()]
    pieces = [("".join(f"{' '.join(rng.choices(words, k=30))}\n" for _ in range(n))).encode() for n in (9000, 1, 15000)]
    for part in ("rows", "shards"):
        (tmp_path / part).mkdir()
    names = []
    for first_line, piece in zip((1, 101, 201), pieces, strict=True):
        path = tmp_path / "rows" / f"{first_line}.jsonl.gz"
        path.write_bytes(gzip.compress(piece, compresslevel=1))
        names.append((first_line, str(path)))
    write_shard(((0, 3), reversed(names)), str(tmp_path))
    shard = tmp_path / "shards" / shard_name(0, 3)
    assert shard.read_bytes() == gzip.compress(b"".join(pieces), mtime=0) and len(b"".join(pieces)) > 3 * 2**20
    assert not any((tmp_path / "rows").iterdir())
    write_shard(((0, 3), names), str(tmp_path))  # a retried bundle: its rows files are gone
    assert shard.read_bytes() == gzip.compress(b"".join(pieces), mtime=0)


def test_bad_config_names_the_key(task_file, tmp_path):
    with pytest.raises(ConfigError, match="input"):
        augment(tmp_path / "nothing-*.jsonl", tmp_path, tmp_path / "out")
    with pytest.raises(ConfigError, match="mlm"):
        augment(task_file, tmp_path / "nothing", tmp_path / "out")
    with pytest.raises(ConfigError, match="probability"):
        augment(task_file, tmp_path, tmp_path / "out", probability=0)


def test_an_output_that_holds_other_files_or_an_input_is_refused_before_any_work(task_file, tiny_teacher_dir, tmp_path):
    """The output directory is replaced whole: ``output=task`` beside ``task/dev.jsonl`` once deleted it."""
    task = tmp_path / "task"
    task.mkdir()
    (task / "dev.jsonl").write_text('{"text": "kept", "label": 0}\n')
    with pytest.raises(ConfigError, match=r"^output: .* holds dev\.jsonl, which replacing it would delete"):
        augment(task_file, tiny_teacher_dir, task)
    assert (task / "dev.jsonl").read_text() == '{"text": "kept", "label": 0}\n'
    own = tmp_path / "own"
    own.mkdir()
    (own / OUTPUT_FILE).write_bytes(task_file.read_bytes())
    with pytest.raises(ConfigError, match=r"^output: .* holds the input"):
        augment(own / OUTPUT_FILE, tiny_teacher_dir, own)
    with pytest.raises(ConfigError, match=r"^beam\.direct_num_workerz: not a Beam pipeline option"):
        augment(task_file, tiny_teacher_dir, tmp_path / "out", beam={"direct_num_workerz": 2})
    assert not (tmp_path / "out").exists()


def test_tinybert_preset(task_file, tiny_teacher_dir, tmp_path):
    from common.config import load_config

    preset = Path(__file__).resolve().parents[2] / "configs" / "augment" / "tinybert.yaml"
    overrides = [f"input={task_file}", f"mlm={tiny_teacher_dir}", f"output={tmp_path / 'out'}"]
    cfg = load_config(AugmentConfig, preset, overrides)
    assert (cfg.variants, cfg.probability, cfg.top_k) == (20, 0.4, 15)


def test_words_past_max_seq_len_get_no_candidates(tiny_teacher_dir):
    from preprocessing.augment import MaskedLmCandidates

    candidates = MaskedLmCandidates(str(tiny_teacher_dir), top_k=3, max_seq_len=8)
    spans, found = candidates("one two three four five six seven eight nine ten")
    assert len(spans) == 10 and [len(words) for words in found] == [3] * 6 + [0] * 4  # [CLS] 6 words [SEP]
    text = "one two three four five six seven eight nine ten"
    assert all(word.lower() != text[a:b] for (a, b), words in zip(spans, found, strict=True) for word in words)
