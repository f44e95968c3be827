"""``python -m trainer finetune`` on real text: it learns, it is deterministic, bad data is a clear error."""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO
from safetensors.torch import load_file

from common.config import ConfigError, load_config
from trainer.finetuning.finetune import (
    FinetuneConfig,
    correlation,
    encode,
    finetune,
    hold_out,
    label_mapping,
    load_splits,
    read_dataset,
    spearman_ranks,
    start_at_mean,
)

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


def test_eleven_integer_classes_keep_their_ids_in_jsonl_and_csv(tmp_path):
    """Sorted as text, 10 came before 2: eleven integer classes were refused, and a CSV's "10" became class 2."""
    rows = [{"text": f"doc {i}", "label": i % 11} for i in range(33)]
    jsonl, table = tmp_path / "eleven.jsonl", tmp_path / "eleven.csv"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with table.open("w", newline="") as f:
        csv.DictWriter(f, fieldnames=["text", "label"]).writeheader()
        csv.DictWriter(f, fieldnames=["text", "label"]).writerows(rows)
    for data in (jsonl, table):
        cfg = config(tmp_path, data, tmp_path / "o", "valid_fraction=0.3")
        names, ids = label_mapping(*load_splits(cfg), cfg)
        assert names == [str(i) for i in range(11)] and ids["10"] == 10, data


def test_validation_is_a_saved_datasets_validation_split_never_its_train_split(tmp_path):
    """``validation=`` a saved DatasetDict (task distillation: the augmented data to train on, the original
    dataset to score on) once took its first split, its train split: scored on what it trained on."""
    import datasets

    rows = [{"text": f"doc {i}", "label": i % 2} for i in range(12)]
    augmented = tmp_path / "augmented.jsonl"
    augmented.write_text("".join(json.dumps(r) + "\n" for r in rows))
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        train=datasets.Dataset.from_list(rows[:8]), validation=datasets.Dataset.from_list(rows[8:])
    ).save_to_disk(saved)
    _, valid = load_splits(config(tmp_path, augmented, tmp_path / "o", f"validation={saved}"))
    assert valid.texts == [r["text"] for r in rows[8:]]

    no_train = tmp_path / "no-train"
    datasets.DatasetDict(
        validation=datasets.Dataset.from_list(rows[:8]), test=datasets.Dataset.from_list(rows[8:])
    ).save_to_disk(no_train)
    with pytest.raises(ConfigError, match=r"holds the splits \['test', 'validation'\] and none named 'train'"):
        load_splits(config(tmp_path, no_train, tmp_path / "o"))


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


def test_sentence_pairs_are_encoded_as_one_sequence_of_two_segments(tiny_student_dir, tmp_path):
    """text_pair_column: both texts reach the model, as [CLS] a [SEP] b [SEP] with token types 0 and 1."""
    from transformers import AutoTokenizer

    pairs = tmp_path / "pairs.jsonl"
    rows = [{"a": f"first text {i}", "b": f"second text {i}", "same": i % 2} for i in range(12)]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config(tiny_student_dir, pairs, tmp_path / "o", "text_column=a", "text_pair_column=b", "label_column=same")
    split = read_dataset(pairs, cfg)["train"]
    assert (split.texts[3], split.pairs[3], split.labels[3]) == ("first text 3", "second text 3", 1)

    tokenizer = AutoTokenizer.from_pretrained(tiny_student_dir)
    (example,) = encode(tokenizer, split.subset([3]), {"0": 0, "1": 1}, 64)
    assert tokenizer.decode(example["input_ids"]) == "[CLS] first text 3 [SEP] second text 3 [SEP]"
    assert example["token_type_ids"] == [0] * 5 + [1] * 4 and example["labels"] == 1
    # A model with one token-type row (a student built from a config) reads the pair by its [SEP]s alone.
    (single,) = encode(tokenizer, split.subset([3]), {"0": 0, "1": 1}, 64, token_types=1)
    assert "token_type_ids" not in single and single["input_ids"] == example["input_ids"]

    result = finetune(dataclasses.replace(cfg, epochs=1))
    assert result["total"] == 2 and result["labels"] == ["0", "1"]  # 12 rows, a fifth held out

    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"a": "x", "same": 0}) + "\n")
    with pytest.raises(ConfigError, match=r"missing.jsonl:1 has no column 'b' \(set text_pair_column\)"):
        finetune(config(tiny_student_dir, missing, tmp_path / "o", "text_column=a", "text_pair_column=b"))


def test_a_test_file_is_scored_once_by_the_final_model_and_predictions_are_kept(tiny_student_dir, tmp_path):
    """``test=`` scores the final model on a held-out file (no choice is made on it) and
    ``save_predictions=true`` writes each validation and test example's prediction and label, from which the
    reported accuracies follow; a test label the model was not trained on is refused, naming the key."""
    rows = [json.loads(line) for line in DOCS.read_text().splitlines() if line.strip()]
    splits = {"train": rows[:40], "dev": rows[40:60], "test": rows[60:90]}
    for name, part in splits.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    out = tmp_path / "run"
    cfg = config(tiny_student_dir, tmp_path / "train.jsonl", out, f"validation={tmp_path / 'dev.jsonl'}")
    result = finetune(dataclasses.replace(cfg, test=str(tmp_path / "test.jsonl"), save_predictions=True, epochs=1))
    kept = json.loads((out / "predictions.json").read_text())
    for split, scored in (("validation", result), ("test", result["test"])):
        predicted, label = kept[split]["predicted"], kept[split]["label"]
        assert label == [str(r["label"]) for r in splits["dev" if split == "validation" else "test"]]
        assert scored["accuracy"] == sum(p == t for p, t in zip(predicted, label, strict=True)) / len(label)
    assert result["test"]["total"] == 30 and "predictions" not in json.loads((out / "metrics.json").read_text())
    (tmp_path / "odd.jsonl").write_text(json.dumps({"text": "a new kind", "label": 7}) + "\n")
    with pytest.raises(ConfigError, match=r"test: labels \['7'\] do not occur in the training data"):
        finetune(dataclasses.replace(cfg, test=str(tmp_path / "odd.jsonl"), output_dir=str(tmp_path / "odd")))


def test_regression_reports_what_its_model_predicts(tiny_student_dir, tmp_path):
    """task=regression on real data (Debian descriptions -> log10 installed size, gzipped JSONL): one
    output trained with MSE; the Pearson correlation and the loss it reports are those of its saved
    model's predictions on the validation split."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    sizes = Path(__file__).resolve().parents[2] / "benchmarks" / "quality" / "tasks" / "debian-size"
    cfg = config(tiny_student_dir, sizes / "train.jsonl.gz", tmp_path, "task=regression", "valid_fraction=0.1")
    result = finetune(dataclasses.replace(cfg, epochs=1, batch_size=64, lr=1e-3))
    assert {"pearson", "spearman", "loss", "total"} <= result.keys() and result["total"] == 200

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "model").eval()
    assert (model.config.num_labels, model.config.problem_type) == (1, "regression")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    _, valid = hold_out(read_dataset(sizes / "train.jsonl.gz", cfg)["train"], cfg.valid_fraction, cfg.seed)
    with torch.no_grad():
        batch = tokenizer(valid.texts, truncation=True, max_length=64, padding=True, return_tensors="pt")
        predicted = model(**batch).logits.squeeze(-1)
    target = torch.tensor(valid.labels)
    assert result["pearson"] == pytest.approx(correlation(predicted, target), abs=1e-4)
    assert result["spearman"] == pytest.approx(correlation(spearman_ranks(predicted), spearman_ranks(target)), abs=1e-4)
    assert result["loss"] == pytest.approx(float(((predicted - target) ** 2).mean()), rel=1e-3)


def test_regression_output_starts_at_the_mean_target(tiny_student_dir):
    """Else a short fine-tune spends itself moving the output from 0 to the targets' mean (see start_at_mean)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_student_dir, num_labels=1)
    start_at_mean(model, [1.0, 2.0, 6.0])
    assert model.classifier.bias.tolist() == [3.0]


def test_rank_correlation_and_bad_regression_labels(tiny_student_dir, tmp_path):
    ties = torch.tensor([10.0, 30.0, 20.0, 20.0])
    assert spearman_ranks(ties).tolist() == [1.0, 4.0, 2.5, 2.5]  # ties share their mean
    assert correlation(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 7.0])) == pytest.approx(0.9934, abs=1e-4)
    assert correlation(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1.0, 2.0, 3.0])) == 0.0  # constant: no correlation

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "a", "label": 1.5}) + "\n" + json.dumps({"text": "b", "label": "big"}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2 has 'label' = 'big', not a finite number \(task=regression\)"):
        finetune(config(tiny_student_dir, bad, tmp_path / "o", "task=regression"))
    with pytest.raises(ConfigError, match="task: must be one of classification, regression, got 'ranking'"):
        config(tiny_student_dir, bad, tmp_path / "o", "task=ranking")


@pytest.mark.full
def test_two_ranks_through_the_deepspeed_launcher_optimise_the_one_process_run(tiny_student_dir, tmp_path):
    """``deepspeed launch/run.sh finetune ...`` on two CPU ranks (gloo) takes the same steps as one process:
    each rank's share of a batch of 7 (4 and 3 rows, an uneven split) is weighted so that the averaged
    gradient is the whole batch's. Dropout is off (its masks are drawn per rank), so the weights match
    to float rounding (the two ranks sum the batch in another order)."""
    from transformers import AutoModelForMaskedLM

    model_dir = tmp_path / "no-dropout"
    model = AutoModelForMaskedLM.from_pretrained(
        tiny_student_dir, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    model.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (tiny_student_dir / name).is_file():
            (model_dir / name).write_bytes((tiny_student_dir / name).read_bytes())
    overrides = ["epochs=2", "batch_size=7", "lr=3.0e-3", "log_every_steps=1"]
    one = finetune(config(model_dir, DOCS, tmp_path / "one", *overrides))

    args = [f"model={model_dir}", f"data={DOCS}", f"output_dir={tmp_path / 'two'}", "max_seq_len=64"]
    deepspeed = Path(sys.executable).parent / "deepspeed"
    command = [
        str(deepspeed),
        "--num_gpus",
        "2",
        "launch/run.sh",
        "finetune",
        *args,
        "mlflow.enabled=false",
        *overrides,
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert "rank 0 of 2" in log and "rank 1 of 2" in log
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert two["steps"] == one["steps"] and two["total"] == one["total"]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-4)
    first = load_file(tmp_path / "one" / "model" / "model.safetensors")
    second = load_file(tmp_path / "two" / "model" / "model.safetensors")
    assert first.keys() == second.keys()
    for key in first:
        # A key bias adds the same amount to every score of a query, which softmax ignores: its true
        # gradient is 0, so what it gets is rounding noise, which Adam scales up to steps of size lr.
        if not key.endswith("attention.self.key.bias"):
            torch.testing.assert_close(second[key], first[key], rtol=0, atol=1e-5, msg=key)


def test_new_pooler_starts_a_teachers_pooler_afresh_as_a_students(bert_tokenizer_dir):
    """The real MiniLM encoder brings a trained pooler; a student has none and gets transformers' initialisation.
    ``new_pooler`` (what evaluate-suite sets for every model) gives the teacher the same start: its pooler no
    longer the checkpoint's, at the initialiser's scale, the same for the same seed; without it, kept."""
    from trainer.finetuning.finetune import load_classifier

    trained = load_file(bert_tokenizer_dir / "model.safetensors")
    name = next(k for k in trained if k.endswith("pooler.dense.weight"))
    head = {"num_labels": 3}
    kept = load_classifier(bert_tokenizer_dir, head).base_model.pooler.dense.weight
    assert torch.equal(kept, trained[name])
    torch.manual_seed(0)
    fresh = load_classifier(bert_tokenizer_dir, head, new_pooler=True).base_model.pooler.dense.weight
    torch.manual_seed(0)
    again = load_classifier(bert_tokenizer_dir, head, new_pooler=True).base_model.pooler.dense.weight
    assert not torch.equal(fresh, trained[name]) and torch.equal(fresh, again)
    assert abs(fresh.std().item() - 0.02) < 0.002  # initializer_range, as a student's missing pooler gets
