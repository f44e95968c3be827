"""``trainer task-distill``: both stages end to end on tiny models, the best model kept and exported,
a real kill and resume, sentence pairs and regression, the launcher on two CPU ranks, and the
errors raised before any weight moves."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO

from common.config import ConfigError, from_dict
from trainer.finetuning.finetune import FinetuneConfig, finetune
from trainer.finetuning.task_distill import TaskDistillConfig, task_distill

DOCS = REPO / "tests" / "data" / "docs-classification.jsonl"


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One thread, as the subprocesses here get (OMP_NUM_THREADS=1): the same float sums in both,
    so a resumed run can be compared with an uninterrupted one exactly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def general_student(tmp_path_factory: pytest.TempPathFactory, bert_tokenizer_dir: Path) -> Path:
    """A 2-layer, 32-wide masked-LM student with the teacher's vocabulary and head count (4)."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    tokenizer = AutoTokenizer.from_pretrained(bert_tokenizer_dir)
    torch.manual_seed(1)
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    out = tmp_path_factory.mktemp("general-student")
    BertForMaskedLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def fine_tuned(model: Path, data: Path, out: Path, **values: object) -> Path:
    settings = {"model": str(model), "data": str(data), "output_dir": str(out), "epochs": 1, "max_seq_len": 48}
    finetune(from_dict(FinetuneConfig, {**settings, **values, "mlflow": {"enabled": False}}))
    return out / "model"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory, tiny_teacher_dir: Path) -> Path:
    """The tiny 4-layer teacher fine-tuned on the two-class docs task (labels 0 and 1)."""
    return fine_tuned(tiny_teacher_dir, DOCS, tmp_path_factory.mktemp("teacher"))


def settings(teacher: Path, student: Path, out: Path, **values: object) -> dict[str, object]:
    base: dict[str, object] = {
        "teacher": str(teacher),
        "student": str(student),
        "data": str(DOCS),
        "output_dir": str(out),
        "max_seq_len": 48,
        "batch_size": 16,
        "eval_every_steps": 5,
        "checkpoint_every_steps": 5,
        "layers": {"epochs": 1, "lr": 1e-3, "tinybert": {"embedding": 1.0, "hidden": 1.0, "attention": 1.0}},
        "predictions": {"epochs": 1, "lr": 1e-3, "soft": 1.0, "hard": 0.5, "temperature": 2.0},
        "mlflow": {"enabled": False},
    }
    return {**base, **values}


def run(values: dict[str, object]) -> dict:
    return task_distill(from_dict(TaskDistillConfig, values))


def test_both_stages_keep_the_best_student_and_export_a_classifier(teacher, general_student, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from trainer.finetuning.finetune import encode, evaluate, load_splits

    out = tmp_path / "run"
    values = settings(teacher, general_student, out)
    result = run(values)

    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["stage"] == 2 and state["best"]["best_step"] == result["best_step"]
    assert result["best_step"] % 5 == 0 or result["best_step"] == 15  # a validation step of stage 2
    # The export is the best validated student, a plain Hugging Face classifier with the teacher's labels.
    model = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert model.config.num_hidden_layers == 2 and model.config.id2label == {0: "0", 1: "1"}
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    cfg = from_dict(TaskDistillConfig, values)
    _, valid = load_splits(cfg)
    from transformers import DataCollatorWithPadding

    scored = evaluate(model, DataCollatorWithPadding(tokenizer), encode(tokenizer, valid, {"0": 0, "1": 1}, 48), 16)
    assert scored["accuracy"] == pytest.approx(result["accuracy"])
    # The layer projections trained in stage 1 (student 32 wide, teacher 64) are not in the export.
    assert not any("projection" in key for key in model.state_dict())


def test_a_test_split_is_scored_once_by_the_student_chosen_on_validation(teacher, general_student, tmp_path):
    """``test=``: the best student is chosen on validation only; the exported one is then scored on the test
    split, and with ``save_predictions`` each test example's prediction is kept, in the test file's order."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    from trainer.finetuning.finetune import encode, evaluate, read_dataset

    rows = DOCS.read_text().splitlines(keepends=True)
    data, validation, test = tmp_path / "train.jsonl", tmp_path / "dev.jsonl", tmp_path / "test.jsonl"
    data.write_text("".join(rows[:200]))
    validation.write_text("".join(rows[200:250]))
    test.write_text("".join(rows[250:]))
    out = tmp_path / "run"
    values = settings(
        teacher, general_student, out, data=str(data), validation=str(validation), test=str(test), save_predictions=True
    )
    result = run(values)

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["total"] == 50 and metrics["test"]["total"] == 50  # validation's best, and the test's own
    model = AutoModelForSequenceClassification.from_pretrained(out / "model")
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    split = next(iter(read_dataset(test, from_dict(TaskDistillConfig, values)).values()))
    scored = evaluate(model, DataCollatorWithPadding(tokenizer), encode(tokenizer, split, {"0": 0, "1": 1}, 48), 16, [])
    assert result["test"]["accuracy"] == pytest.approx(scored["accuracy"]) == metrics["test"]["accuracy"]
    kept = json.loads((out / "predictions.json").read_text())["test"]
    assert kept["label"] == [str(label) for label in split.labels]
    assert [int(p) for p in kept["predicted"]] == [int(p) for p in scored["predictions"]["predicted"]]
    # A test label the teacher does not know fails before any weight moves, as the training data's do.
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"text": "a third kind", "label": 2}) + "\n")
    with pytest.raises(ConfigError, match=r"labels \['2'\] .* are not in the teacher's label set"):
        run({**values, "test": str(odd), "output_dir": str(tmp_path / "odd-run")})
    assert not (tmp_path / "odd-run" / "checkpoint").exists()


def test_a_killed_run_resumes_to_the_uninterrupted_result(teacher, general_student, tmp_path):
    """A real SIGKILL mid-stage-2, then the same command again: the same weights as a run never killed."""
    from safetensors.torch import load_file

    rows = DOCS.read_text().splitlines()
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(rows[:40] + rows[-40:]) + "\n")  # both labels, 64 training examples: 4 steps an epoch
    values = settings(teacher, general_student, tmp_path / "whole", data=str(data))
    values.update(checkpoint_every_steps=3, predictions={"epochs": 6, "lr": 1e-3, "mse": 1.0})
    run(values)

    out = tmp_path / "killed"
    args = [f"{k}={json.dumps(v)}" for k, v in {**values, "output_dir": str(out)}.items()]
    command = [sys.executable, "-m", "trainer", "task-distill", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state_file = out / "checkpoint" / "state.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:  # the checkpoint directory is replaced by renames: it can be absent for an instant
            state = json.loads(state_file.read_text())
        except FileNotFoundError:
            state = {}
        if state.get("stage") == 1 and state["step"] >= 3:
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    killed_at = json.loads(state_file.read_text())
    assert killed_at["stage"] == 1 and 3 <= killed_at["step"] < 24

    resumed = run({**values, "output_dir": str(out)})
    whole = load_file(tmp_path / "whole" / "model" / "model.safetensors")
    again = load_file(out / "model" / "model.safetensors")
    assert whole.keys() == again.keys()
    for key in whole:
        torch.testing.assert_close(again[key], whole[key], rtol=0, atol=1e-6, msg=key)
    assert resumed["best_step"] == json.loads((tmp_path / "whole" / "metrics.json").read_text())["best_step"]


def test_sentence_pairs_read_the_second_segment(tiny_teacher_dir, general_student, tmp_path):
    """Each example's label is that of its second segment, drawn at random from the docs: a student that
    did not read the pair would score chance (0.5; one standard error 0.065 on the 60 held out)."""
    rows = [json.loads(line) for line in DOCS.read_text().splitlines()]
    draw = random.Random(0)
    pairs = tmp_path / "pairs.jsonl"
    with pairs.open("w") as out:
        for row in rows:
            second = rows[draw.randrange(len(rows))]
            out.write(json.dumps({"text": row["text"], "second": second["text"], "label": second["label"]}) + "\n")
    pair_teacher = fine_tuned(
        tiny_teacher_dir, pairs, tmp_path / "pair-teacher", text_pair_column="second", epochs=3, lr=1e-3
    )
    values = settings(pair_teacher, general_student, tmp_path / "pair", data=str(pairs), text_pair_column="second")
    values["predictions"] = {**values["predictions"], "epochs": 4, "lr": 3e-3}
    result = run(values)
    assert result["total"] == 60 and result["accuracy"] > 0.7, result  # measured: 0.82


def test_regression_distils_a_learnable_target(tiny_teacher_dir, general_student, tmp_path):
    """The docs' topic as a number (0 or 1): the student, trained on its teacher's outputs alone (MSE), predicts
    it on the 60 held out with a Pearson r no untrained model reaches by chance (one standard error 0.13)."""
    rows = [json.loads(line) for line in DOCS.read_text().splitlines()]
    scores = tmp_path / "scores.jsonl"
    scores.write_text("".join(json.dumps({"text": r["text"], "label": float(r["label"])}) + "\n" for r in rows))
    regression_teacher = fine_tuned(
        tiny_teacher_dir, scores, tmp_path / "reg-teacher", task="regression", epochs=3, lr=1e-3
    )
    values = settings(regression_teacher, general_student, tmp_path / "reg", data=str(scores), task="regression")
    values["predictions"] = {"epochs": 4, "lr": 3e-3, "soft": 0.0, "mse": 1.0}
    result = run(values)
    assert result["total"] == 60 and result["pearson"] > 0.3, result  # measured: 0.40
    from transformers import AutoModelForSequenceClassification

    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "reg" / "model").config.num_labels == 1


def test_bad_inputs_are_errors_before_any_weight_moves(teacher, tiny_teacher_dir, general_student, tmp_path):
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

    # A teacher that was never fine-tuned (a masked-LM, no classification head).
    with pytest.raises(ConfigError, match=r"teacher: .* has no classification head"):
        run(settings(tiny_teacher_dir, general_student, tmp_path / "a"))
    # Dataset labels the teacher does not know.
    odd = tmp_path / "odd.jsonl"
    odd.write_text("".join(json.dumps({"text": f"text number {i}", "label": i % 3}) + "\n" for i in range(30)))
    with pytest.raises(ConfigError, match=r"labels \['2'\] .* are not in the teacher's label set \['0', '1'\]"):
        run(settings(teacher, general_student, tmp_path / "b", data=str(odd)))
    # A student with another vocabulary.
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "python"]) + "\n")
    other = tmp_path / "other-student"
    BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(other)
    BertForMaskedLM(
        BertConfig(vocab_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    ).save_pretrained(other)
    with pytest.raises(ConfigError, match=r"student: its tokenizer \(\d+ tokens\) is not the teacher.s \(30522 tokens"):
        run(settings(teacher, other, tmp_path / "c"))
    # A layer method that does not fit the two architectures (TinyBERT's attention needs equal head counts),
    # found from the configs: the student's weights are unreadable here, and not read.
    heads = tmp_path / "two-heads"
    shutil.copytree(general_student, heads)
    config = json.loads((heads / "config.json").read_text())
    (heads / "config.json").write_text(json.dumps({**config, "num_attention_heads": 2}))
    (heads / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(ConfigError, match=r"tinybert\.attention"):
        run(settings(teacher, heads, tmp_path / "e"))
    for name in "abce":  # nothing was trained or written
        assert not (tmp_path / name / "checkpoint").exists() and not (tmp_path / name / "model").exists()
    # A config error names its key before anything is read.
    with pytest.raises(ConfigError, match=r"predictions\.soft"):
        run(settings(teacher, general_student, tmp_path / "d", task="regression"))


@pytest.mark.full
def test_two_ranks_through_the_deepspeed_launcher(teacher, general_student, tmp_path):
    """``deepspeed launch/run.sh task-distill ...`` on two CPU ranks (gloo): rank 0 records, both train."""
    out = tmp_path / "launched"
    values = settings(teacher, general_student, out)
    args = [f"{k}={json.dumps(v)}" for k, v in values.items()]
    deepspeed = Path(sys.executable).parent / "deepspeed"
    command = [str(deepspeed), "--num_gpus", "2", "launch/run.sh", "task-distill", *args]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert "rank 0 of 2" in log and "rank 1 of 2" in log
    assert (out / "model" / "model.safetensors").is_file()
    assert json.loads((out / "metrics.json").read_text())["best_step"] >= 5


@pytest.mark.parametrize("preset", ["tinybert-4l-312", "tiny-roberta-4l-312"])
def test_presets_validate(preset, tmp_path):
    from common.config import load_config

    required = ["teacher=T", "student=S", "data=D", f"output_dir={tmp_path}"]
    cfg = load_config(TaskDistillConfig, str(REPO / "configs" / "task-distill" / f"{preset}.yaml"), required)
    assert cfg.layers.tinybert.attention == 1.0 and cfg.layers.epochs > 0 and cfg.predictions.epochs > 0
    assert (cfg.predictions.soft, cfg.predictions.mse) == ((1.0, 0.0) if preset.startswith("tinybert") else (0.0, 1.0))
