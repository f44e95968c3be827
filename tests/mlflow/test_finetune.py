"""``python -m trainer finetune`` on real text: it learns, it is deterministic, bad data is a clear error."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.config import ConfigError, load_config
from trainer.commands.finetune import FinetuneConfig, finetune, hold_out, read_dataset

DOCS = Path(__file__).resolve().parents[1] / "data" / "docs-classification.jsonl"


def config(model: Path, data: Path, out: Path, *overrides: str) -> FinetuneConfig:
    args = [f"model={model}", f"data={data}", f"output_dir={out}", "max_seq_len=64", "mlflow.enabled=false"]
    return load_config(FinetuneConfig, None, [*args, *overrides])


def test_finetune_learns_python_docs_from_linux_docs(tiny_student_dir, tmp_path):
    """A tiny random student still learns to tell the two manuals apart, and the accuracy it reports is
    what its saved classifier scores on the held-out split."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cfg = config(tiny_student_dir, DOCS, tmp_path, "epochs=5", "lr=3.0e-3")
    result = finetune(cfg)

    _, valid = hold_out(read_dataset(DOCS, cfg)["train"], cfg.valid_fraction, cfg.seed)
    majority = max(valid.labels.count(0), valid.labels.count(1)) / len(valid.labels)
    assert result["accuracy"] >= majority + 0.1, (result["accuracy"], majority)

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    with torch.no_grad():
        batch = tokenizer(valid.texts, truncation=True, max_length=64, padding=True, return_tensors="pt")
        predicted = model(**batch).logits.argmax(-1).tolist()
    correct = sum(int(model.config.id2label[p]) == label for p, label in zip(predicted, valid.labels, strict=True))
    assert (result["correct"], result["total"]) == (correct, len(valid.labels))
    assert json.loads((tmp_path / "metrics.json").read_text())["accuracy"] == result["accuracy"]


def test_finetune_is_deterministic_and_reads_csv_and_saved_datasets(tiny_student_dir, tmp_path):
    import datasets

    rows = [json.loads(line) for line in DOCS.read_text().splitlines()][:80]
    table = tmp_path / "docs.csv"
    with table.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["body", "topic"])
        writer.writeheader()
        writer.writerows({"body": r["text"], "topic": ["python", "linux"][r["label"]]} for r in rows)
    first = finetune(config(tiny_student_dir, table, tmp_path / "a", "text_column=body", "label_column=topic"))
    again = finetune(config(tiny_student_dir, table, tmp_path / "b", "text_column=body", "label_column=topic"))
    assert first["labels"] == ["linux", "python"]  # string labels, sorted
    assert (first["accuracy"], first["correct"]) == (again["accuracy"], again["correct"])
    a, b = (load_file(tmp_path / run / "model" / "model.safetensors") for run in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    saved = tmp_path / "saved"
    datasets.DatasetDict(
        train=datasets.Dataset.from_list(rows[:60]), validation=datasets.Dataset.from_list(rows[60:])
    ).save_to_disk(saved)
    result = finetune(config(tiny_student_dir, saved, tmp_path / "c", "epochs=1"))
    assert result["total"] == 20  # the dataset's own validation split


def test_bad_data_is_a_clear_error_or_a_counted_skip(tiny_student_dir, tmp_path, caplog):
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"text": "a", "label": 0}\n{"txt": "b", "label": 1}\n')
    with pytest.raises(ConfigError, match=r"missing.jsonl:2 has no column 'text'"):
        finetune(config(tiny_student_dir, missing, tmp_path / "o"))

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a", "label": 0}\n{"text": \n')
    with pytest.raises(ConfigError, match=r"broken.jsonl:2 is not JSON"):
        finetune(config(tiny_student_dir, broken, tmp_path / "o"))

    train, valid = tmp_path / "train.jsonl", tmp_path / "valid.jsonl"
    train.write_text("".join(json.dumps({"text": f"doc {i}", "label": i % 2}) + "\n" for i in range(8)))
    valid.write_text(json.dumps({"text": "doc", "label": 2}) + "\n")
    with pytest.raises(ConfigError, match=r"labels \['2'\] do not occur in the training data"):
        finetune(config(tiny_student_dir, train, tmp_path / "o", f"validation={valid}"))

    with_empty = tmp_path / "with-empty.jsonl"
    with_empty.write_text(train.read_text() + json.dumps({"text": " ", "label": 0}) + "\n")
    with caplog.at_level(logging.WARNING):
        result = finetune(config(tiny_student_dir, with_empty, tmp_path / "o", "epochs=1", "valid_fraction=0.25"))
    assert "skipped 1 rows with an empty 'text'" in caplog.text
    assert result["total"] == 2  # 8 usable rows, a quarter held out
