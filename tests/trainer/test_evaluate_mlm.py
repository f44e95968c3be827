"""``python -m trainer evaluate-mlm``: held-out masked-LM accuracy, perplexity and top-1 agreement with a
teacher, on a real preprocessed dataset, checked against the same figures computed by hand."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer

from common.config import ConfigError, load_config
from trainer.commands.evaluate_mlm import main
from trainer.config import MaskingConfig
from trainer.evaluation.mlm import EvaluateMlmConfig, evaluate_mlm
from trainer.objective.masking import DynamicMasker
from trainer.runtime.data import open_dataset
from trainer.runtime.evaluate import fixed_masked_batches
from trainer.runtime.ranks import local_device


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory, tiny_teacher_dir: Path) -> Path:
    """The tiny teacher with noise on its output bias: some of its guesses change, not all."""
    dest = Path(shutil.copytree(tiny_teacher_dir, tmp_path_factory.mktemp("other") / "model"))
    model = AutoModelForMaskedLM.from_pretrained(dest)
    bias = model.cls.predictions.bias
    with torch.no_grad():
        bias += 0.1 * torch.randn(bias.shape, generator=torch.Generator().manual_seed(1))
    model.save_pretrained(dest, safe_serialization=True)
    return dest


def config(*overrides: str) -> EvaluateMlmConfig:
    return load_config(EvaluateMlmConfig, None, list(overrides))


def test_figures_match_a_hand_computation(tiny_dataset_dir: Path, tiny_teacher_dir: Path, other_model: Path) -> None:
    cfg = config(
        f"data={tiny_dataset_dir}",
        f"models={json.dumps([str(other_model)])}",
        f"teacher={tiny_teacher_dir}",
        "max_batches=3",
        "batch_size=8",
    )
    report = evaluate_mlm(cfg)

    # By hand: the same fixed mask, both models' top-1 predictions at the masked positions.
    tokenizer = AutoTokenizer.from_pretrained(other_model)
    masker = DynamicMasker.from_tokenizer(MaskingConfig(), tokenizer)
    batches = fixed_masked_batches(
        open_dataset(tiny_dataset_dir),
        masker,
        micro_batch_size=8,
        max_batches=3,
        seed=0,
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
    )
    student, teacher = (AutoModelForMaskedLM.from_pretrained(p).eval() for p in (other_model, tiny_teacher_dir))
    correct = agree = total = 0
    loss_sum = 0.0
    with torch.no_grad():
        for masked, attention_mask in batches:
            s_logits = student(input_ids=masked.input_ids, attention_mask=attention_mask).logits
            t_logits = teacher(input_ids=masked.input_ids, attention_mask=attention_mask).logits
            labels = masked.labels  # the dense form: the original id where chosen, -100 elsewhere
            chosen = labels != -100
            s_top, t_top = s_logits.argmax(-1)[chosen], t_logits.argmax(-1)[chosen]
            correct += int((s_top == labels[chosen]).sum())
            agree += int((s_top == t_top).sum())
            total += int(chosen.sum())
            loss_sum += float(torch.nn.functional.cross_entropy(s_logits[chosen], labels[chosen], reduction="sum"))

    [entry] = report["models"]
    assert entry["masked_tokens"] == total > 50
    assert entry["mlm_accuracy"] == pytest.approx(correct / total)
    assert entry["top1_agreement"] == pytest.approx(agree / total)
    assert entry["mlm_loss"] == pytest.approx(loss_sum / total, rel=1e-4)
    assert entry["perplexity"] == pytest.approx(math.exp(entry["mlm_loss"]))
    assert 0 < entry["top1_agreement"] < 1  # a different model: neither all nor none of its guesses agree
    assert report["teacher"]["model"] == str(tiny_teacher_dir) and report["teacher"]["mlm_accuracy"] >= 0
    assert report["device"] == str(local_device())  # named, for whoever compares two reports


def test_a_model_agrees_with_itself_and_a_headless_teacher_gives_no_agreement(
    tiny_dataset_dir: Path,
    tiny_teacher_dir: Path,
    bert_tokenizer_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "mlm.json"
    args = [str(tiny_teacher_dir), f"data={tiny_dataset_dir}", "max_batches=2", "batch_size=8"]
    assert main([*args, f"teacher={tiny_teacher_dir}", f"output={out}"]) == 0
    report = json.loads(out.read_text())
    [entry] = report["models"]
    assert entry["top1_agreement"] == 1.0 and entry["mlm_loss"] == pytest.approx(report["teacher"]["mlm_loss"])
    assert entry["hidden_cosine"] == pytest.approx(1.0) and entry["centred_cosine"] == pytest.approx(1.0)
    printed = capsys.readouterr().out
    assert "top-1 agreement with the teacher 1.0000" in printed
    assert "hidden-state cosine with the teacher 1.0000 (centred 1.0000)" in printed

    headless = evaluate_mlm(
        config(*args[1:], f"models={json.dumps([str(tiny_teacher_dir)])}", f"teacher={bert_tokenizer_dir}")
    )  # all-MiniLM-L6-v2: no MLM head
    assert headless["teacher"] is None and headless["models"][0]["top1_agreement"] is None
    # MiniLM is 384 wide, the tiny model 64: no hidden states to compare either.
    assert headless["models"][0]["hidden_cosine"] is None and headless["models"][0]["centred_cosine"] is None


def test_differences_come_with_paired_intervals_over_batches(
    tiny_dataset_dir: Path, tiny_teacher_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 4's question (does a student beat another on held-out masked LM?) needs a difference with its
    interval: a copy of the teacher differs from it by exactly nothing, a model that always guesses [PAD] is
    worse on accuracy and loss with intervals clear of zero, and the per-batch sums kept in the report add up
    to the figures printed."""
    # The tiny teacher guesses no masked token: "teacher" always guesses the commonest masked token instead,
    # "broken" always [PAD] (id 0, never a target).
    tokenizer = AutoTokenizer.from_pretrained(tiny_teacher_dir)
    masker = DynamicMasker.from_tokenizer(MaskingConfig(), tokenizer)
    batches = fixed_masked_batches(
        open_dataset(tiny_dataset_dir), masker, micro_batch_size=8, max_batches=4, seed=0, rank=0, world_size=1,
        device=torch.device("cpu"),
    )  # fmt: skip
    targets = torch.cat([masked.labels[masked.labels != -100] for masked, _ in batches])
    commonest = int(torch.mode(targets).values)

    def always(token: int, name: str) -> Path:
        dest = Path(shutil.copytree(tiny_teacher_dir, tmp_path / name))
        model = AutoModelForMaskedLM.from_pretrained(dest)
        with torch.no_grad():
            model.cls.predictions.bias[token] = 50.0  # wins every position
        model.save_pretrained(dest, safe_serialization=True)
        return dest

    teacher, broken = always(commonest, "teacher"), always(0, "broken")
    copy = shutil.copytree(teacher, tmp_path / "copy")
    models = json.dumps([str(copy), str(broken)])
    args = [f"data={tiny_dataset_dir}", f"models={models}", f"teacher={teacher}", "max_batches=4"]
    report = evaluate_mlm(config(*args, "batch_size=8", "bootstrap=200"))

    same, worse = report["models"]
    assert worse["mlm_accuracy"] == 0.0 and same["mlm_accuracy"] == report["teacher"]["mlm_accuracy"] > 0
    for entry in [same, worse, report["teacher"]]:
        kept = entry["per_batch"]
        assert len(kept["masked"]) == 4  # one sum a batch: what the bootstrap resamples
        assert sum(kept["correct"]) / sum(kept["masked"]) == pytest.approx(entry["mlm_accuracy"])
        assert sum(kept["loss_sum"]) / sum(kept["masked"]) == pytest.approx(entry["mlm_loss"])
        low, high = entry["mlm_accuracy_ci"]
        assert low <= entry["mlm_accuracy"] <= high
    by_pair = {(d["first"], d["second"]): d for d in report["differences"]}
    assert len(by_pair) == 3  # every two of the models and the teacher
    identical = by_pair[(str(copy), str(teacher))]
    assert identical["mlm_accuracy"]["ci95"] == [0.0, 0.0] and identical["mlm_loss"]["ci95"] == [0.0, 0.0]
    assert identical["mlm_accuracy"]["verdict"] == "no measurable difference"
    better = by_pair[(str(copy), str(broken))]
    assert better["mlm_accuracy"]["difference"] == pytest.approx(same["mlm_accuracy"])
    assert better["mlm_accuracy"]["ci95"][0] > 0 and better["mlm_accuracy"]["verdict"] == "first better"
    assert better["mlm_loss"]["difference"] < 0 and better["mlm_loss"]["ci95"][1] < 0  # lower loss: better
    assert better["mlm_loss"]["verdict"] == "first better"
    assert evaluate_mlm(config(*args, "batch_size=8", "bootstrap=200"))["differences"] == report["differences"]

    assert main([str(copy), *args[::2], "batch_size=8", "bootstrap=0"]) == 0  # no intervals asked: none printed
    assert " - " not in capsys.readouterr().out.split("masked tokens")[-1]


def test_a_teacher_of_another_vocabulary_is_refused_before_any_scoring(
    tiny_dataset_dir: Path, tiny_teacher_dir: Path, tmp_path: Path
) -> None:
    """It once read the dataset's ids as its own words: an agreement and cosines of no meaning, or an IndexError."""
    foreign = shutil.copytree(tiny_teacher_dir, tmp_path / "foreign")
    tokenizer_json = json.loads((foreign / "tokenizer.json").read_text())
    tokenizer_json["model"]["vocab"]["zzzz-new-token"] = len(tokenizer_json["model"]["vocab"])
    (foreign / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    models = json.dumps([str(tiny_teacher_dir)])
    with pytest.raises(ConfigError, match=r"^data: .* but teacher .* has a different tokenizer"):
        evaluate_mlm(config(f"data={tiny_dataset_dir}", f"models={models}", f"teacher={foreign}"))


def test_bad_input_names_the_key(tiny_dataset_dir: Path, bert_tokenizer_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"^masking\.frequency_smoothing: held-out scores use a uniform mask"):
        config(f"data={tiny_dataset_dir}", 'models=["m"]', "masking.frequency_smoothing=0.7")
    with pytest.raises(ConfigError, match=r"^bootstrap: must be 0 \(none\) or >= 100"):
        config(f"data={tiny_dataset_dir}", 'models=["m"]', "bootstrap=10")
    with pytest.raises(ConfigError, match=r"^models: name at least one model"):
        config(f"data={tiny_dataset_dir}")
    with pytest.raises(ConfigError, match=r"^models: .* has no masked-LM head to score"):
        evaluate_mlm(config(f"data={tiny_dataset_dir}", f"models={json.dumps([str(bert_tokenizer_dir)])}"))


def test_the_device_is_the_gpu_where_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """``local_device``, which evaluate-mlm, the probe, finetune and task-distill run on: CUDA where it is
    present, unless DS_ACCELERATOR (the launcher's switch) says cpu. (tests/gpu scores on a real GPU.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert local_device() == torch.device("cuda", 0) and local_device(3) == torch.device("cuda", 3)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert local_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("DS_ACCELERATOR")
    assert local_device() == torch.device("cpu")
