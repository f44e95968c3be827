"""Masked-LM pretraining without a teacher (``teacher: null``): the config's rules, each error naming
its key; the student made from ``student.model``; a Distiller that trains and evaluates the student
alone; and ``plan`` for the pretraining preset. The launcher runs it in ``test_launcher.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoModelForMaskedLM, PreTrainedModel

from common.config import ConfigError, load_config
from trainer.config import MaskingConfig, TrainConfig
from trainer.modeling import build_student, load_teacher_config
from trainer.objective.distiller import Distiller, eval_metrics, validate_against_teacher
from trainer.objective.masking import DynamicMasker, seeded_generator
from trainer.planning.plan import build_plan, render
from trainer.runtime.optim import param_groups

REPO = Path(__file__).resolve().parents[2]
PRESET = str(REPO / "configs" / "pretrain-bert-mini.yaml")
BERT_BASE = str(REPO / "configs" / "teachers" / "bert-base-uncased")
ROBERTA_BASE = str(REPO / "configs" / "teachers" / "roberta-base")
MLM_ONLY = ["objective.ce=0", "objective.cos=0", "objective.mse=0", "objective.mlm=1"]


def config(*overrides: str, path: str | None = None) -> TrainConfig:
    required = ["data=d", "output_dir=o"] if path is None else []
    return load_config(TrainConfig, path, [*required, *overrides])


def pretraining(*overrides: str) -> TrainConfig:
    """A valid teacher-less config (random init from bert-base's architecture) plus ``overrides``."""
    return config("teacher=null", "student.init=random", f"student.model={BERT_BASE}", *MLM_ONLY, *overrides)


@pytest.mark.parametrize(
    ("overrides", "key", "message"),
    [
        (["objective.ce=5"], "objective.ce", "compares with a teacher, but teacher is null"),
        (["objective.cos=1"], "objective.cos", "compares with a teacher"),
        (["objective.mse=1"], "objective.mse", "compares with a teacher"),
        (["objective.mlm=0"], "objective.mlm", "the only loss without a teacher"),
        (["student.init=from_teacher", "student.model=null"], "student.init", "from_teacher needs a teacher"),
        (["student.model=null"], "student.model", "without a teacher, name the model"),
        (["student.init=pretrained", "student.num_layers=2"], "student.num_layers", "keeps its own architecture"),
        (["student.init=pretrained", "student.model=null"], "student.model", "init=pretrained needs the model"),
        (["student.trainable=head"], "student.trainable", "student.init=random leaves random"),
        (["student.trainable=all_but_embeddings"], "student.trainable", "must be one of"),
    ],
)
def test_teacherless_config_errors_name_the_key(overrides: list[str], key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key}: .*{message}"):
        pretraining(*overrides)


def test_the_teacher_key_is_still_required_and_null_must_be_explicit() -> None:
    with pytest.raises(ConfigError, match="missing required config key 'teacher'"):
        config(*MLM_ONLY)


def test_a_distillation_uses_the_teacher_s_tokenizer() -> None:
    with pytest.raises(ConfigError, match=r"^tokenizer: the teacher's tokenizer is used"):
        config(f"teacher={BERT_BASE}", "tokenizer=bert-base-uncased")
    with pytest.raises(ConfigError, match=r"^student\.model: does not apply to student\.init=from_teacher"):
        config(f"teacher={BERT_BASE}", f"student.model={BERT_BASE}")


def test_tokenizer_comes_from_the_teacher_else_the_tokenizer_key_else_student_model() -> None:
    assert config(f"teacher={BERT_BASE}").tokenizer_source() == (BERT_BASE, "teacher")
    assert pretraining("tokenizer=tok").tokenizer_source() == ("tok", "tokenizer")
    assert pretraining().tokenizer_source() == (BERT_BASE, "student.model")


@pytest.mark.parametrize("section", ["tinybert", "pkd", "minilm"])
def test_layer_distillation_without_a_teacher_names_its_section(section: str) -> None:
    weight = {"tinybert": "tinybert.hidden", "pkd": "pkd.weight", "minilm": "minilm.attention"}[section]
    cfg = pretraining(f"objective.{weight}=1")
    with pytest.raises(ConfigError, match=rf"^objective\.{section}: layer distillation compares with a teacher"):
        validate_against_teacher(cfg, None)


def test_student_model_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^student\.model: cannot load the model config"):
        validate_against_teacher(pretraining(f"student.model={tmp_path / 'missing'}"), None)
    # A student distilled from a teacher must read the teacher's token ids.
    cfg = config(f"teacher={BERT_BASE}", "student.init=random", f"student.model={ROBERTA_BASE}", "student.num_layers=2")
    with pytest.raises(ConfigError, match=r"^student\.model: has 50265 token embeddings but the teacher .* 30522"):
        validate_against_teacher(cfg, load_teacher_config(BERT_BASE))


def test_pretraining_preset_plans_the_student_alone(capsys: pytest.CaptureFixture[str]) -> None:
    plan = build_plan(config(path=PRESET), world_size=2, seq_len=128)
    assert plan["teacher"] is None and plan["teacher_params"] is None and plan["layer_map"] is None
    student = plan["student"]
    assert (student["class"], student["num_layers"], student["hidden_size"]) == ("BertForMaskedLM", 4, 256)
    assert (student["num_attention_heads"], student["intermediate_size"], student["vocab_size"]) == (4, 1024, 30522)
    # BERT-Mini: embeddings (30522 words + 512 positions + 1 type row) x 256 + LayerNorm, 4 layers of 256/1024.
    layer = 4 * (256 * 256 + 256) + 2 * 256 + (256 * 1024 + 1024) + (1024 * 256 + 256) + 2 * 256
    assert plan["student_params"] == (30522 + 512 + 1) * 256 + 2 * 256 + 4 * layer
    assert abs(plan["student_params"] - 11.3e6) <= 0.03 * 11.3e6  # Turc et al.'s BERT-Mini (docs/objectives.md)
    flops = plan["flops_per_token"]
    assert flops["teacher_forward"] == 0 and flops["total"] == flops["student_forward_backward"] > 0
    assert plan["batch"]["gradient_accumulation_steps"] == 2  # 64 = 16 x 2 x 2 ranks
    assert "teacher: none (masked-LM pretraining" in render(plan)


@pytest.fixture(scope="module")
def batch():
    ids = torch.randint(1000, 30000, (2, 32), generator=torch.Generator().manual_seed(0))
    masker = DynamicMasker(MaskingConfig(), vocab_size=30522, mask_id=103, special_ids=[0, 100, 101, 102, 103])
    return masker(ids, None, seeded_generator(0, 0, 0))


def test_distiller_without_a_teacher_trains_and_evaluates_the_student_alone(tiny_teacher_dir: Path, batch) -> None:
    cfg = pretraining(f"student.model={tiny_teacher_dir}", "student.num_layers=2")
    torch.manual_seed(0)
    student = build_student(cfg.student, None)
    assert type(student).__name__ == "BertForMaskedLM" and student.config.num_hidden_layers == 2
    distiller = Distiller(student, None, cfg.objective)
    assert distiller.teacher is None and list(distiller.state_dict()) == [f"student.{k}" for k in student.state_dict()]
    out = distiller(batch=batch, attention_mask=None)
    assert set(out) == {"loss", "mlm"} and torch.equal(out["loss"], out["mlm"])
    out["loss"].backward()
    assert all(p.grad is not None for p in student.parameters())
    sums = distiller.evaluate(batch, None)
    assert set(sums) == {"predicted", "student_loss_sum", "student_correct"}
    metrics = eval_metrics({k: v.item() for k, v in sums.items()})
    assert set(metrics) == {"student_mlm_loss", "student_mlm_accuracy"}


def encoder_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.base_model.state_dict().items() if "pooler" not in k}


def test_pretrained_student_continues_from_the_model_s_weights(tiny_teacher_dir: Path) -> None:
    """A masked LM is loaded whole, in train mode and float32; it is the model, not a derived one."""
    cfg = pretraining("student.init=pretrained", f"student.model={tiny_teacher_dir}")
    validate_against_teacher(cfg, None)
    student = build_student(cfg.student, None)
    original = AutoModelForMaskedLM.from_pretrained(tiny_teacher_dir)
    assert student.training and next(student.parameters()).dtype == torch.float32
    assert student.state_dict().keys() == original.state_dict().keys()
    assert all(torch.equal(v, original.state_dict()[k]) for k, v in student.state_dict().items())


def test_pretrained_encoder_without_an_mlm_head_gets_a_fresh_one(bert_tokenizer_dir: Path) -> None:
    """all-MiniLM-L6-v2 (a BertModel): the encoder is kept exactly, the head is new, the config a masked LM."""
    cfg = pretraining("student.init=pretrained", f"student.model={bert_tokenizer_dir}")
    torch.manual_seed(0)
    student = build_student(cfg.student, None)
    assert type(student).__name__ == "BertForMaskedLM"
    assert student.config.architectures == ["BertForMaskedLM"]
    encoder = AutoModel.from_pretrained(bert_tokenizer_dir)
    expected = encoder_state(encoder)
    assert encoder_state(student).keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in encoder_state(student).items())
    assert student.cls.predictions.decoder.weight is student.bert.embeddings.word_embeddings.weight


def test_pretrained_student_with_missing_encoder_weights_is_a_config_error(
    tiny_teacher_dir: Path, tmp_path: Path
) -> None:
    """Only a missing MLM head is made fresh; a missing layer would silently train a partly random encoder."""
    partial = Path(shutil.copytree(tiny_teacher_dir, tmp_path / "partial"))
    config_json = json.loads((partial / "config.json").read_text())
    (partial / "config.json").write_text(json.dumps({**config_json, "num_hidden_layers": 5}))  # weights for 4
    cfg = pretraining("student.init=pretrained", f"student.model={partial}")
    with pytest.raises(ConfigError, match=r"^student\.model: .* has no weights for bert\.encoder\.layer\.4\."):
        build_student(cfg.student, None)


HEAD_OWN = {  # what student.trainable=head trains in a BertForMaskedLM: the transform and the output bias
    "cls.predictions.bias",
    "cls.predictions.transform.dense.weight",
    "cls.predictions.transform.dense.bias",
    "cls.predictions.transform.LayerNorm.weight",
    "cls.predictions.transform.LayerNorm.bias",
}


def test_a_head_fitted_to_a_frozen_encoder_changes_nothing_else(bert_tokenizer_dir: Path, batch) -> None:
    """``student.trainable=head`` on the headless all-MiniLM-L6-v2: optimizer steps change the fresh head's
    transform and bias, and not one value of the encoder, nor the decoder matrix tied to its embeddings."""
    cfg = pretraining("student.init=pretrained", f"student.model={bert_tokenizer_dir}", "student.trainable=head")
    validate_against_teacher(cfg, None)
    torch.manual_seed(0)
    student = build_student(cfg.student, None)
    assert {name for name, p in student.named_parameters() if p.requires_grad} == HEAD_OWN
    before = {k: v.clone() for k, v in student.state_dict().items()}
    distiller = Distiller(student, None, cfg.objective)
    optimizer = torch.optim.AdamW(param_groups(distiller, weight_decay=0.01), lr=1e-3)
    losses = []
    for _ in range(3):
        loss = distiller(batch=batch, attention_mask=None)["loss"]
        loss.backward()
        assert all(p.grad is None for p in student.parameters() if not p.requires_grad)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    after = student.state_dict()
    changed = {k for k, v in after.items() if not torch.equal(v, before[k])}
    tied_bias = {"cls.predictions.decoder.bias"} & set(after)  # the same tensor as cls.predictions.bias
    assert changed == HEAD_OWN | tied_bias
    assert student.cls.predictions.decoder.weight is student.bert.embeddings.word_embeddings.weight
    assert losses[-1] < losses[0]  # the same batch three times: the head fits it


def test_a_frozen_student_trains_no_hidden_state_term(bert_tokenizer_dir: Path) -> None:
    """With a teacher, L_cos and the layer methods would train nothing under student.trainable=head: each is an
    error naming its key, before any weight is loaded."""
    distil = [f"teacher={bert_tokenizer_dir}", "student.trainable=head", "objective.ce=0", "objective.mse=0"]
    with pytest.raises(ConfigError, match=r"^objective\.cos: .*student\.trainable=head freezes"):
        config(*distil)
    cfg = config(*distil, "objective.cos=0", "objective.tinybert.hidden=1")
    with pytest.raises(ConfigError, match=r"^objective\.tinybert: .*student\.trainable=head freezes"):
        validate_against_teacher(cfg, load_teacher_config(str(bert_tokenizer_dir)))


def test_plan_counts_a_frozen_encoder_s_weights_but_not_its_optimizer_states(bert_tokenizer_dir: Path) -> None:
    """Frozen weights are held like any other, but have no AdamW states, and no backward pass through the encoder."""
    fit = ["student.init=pretrained", f"student.model={bert_tokenizer_dir}", "deepspeed.precision=fp32"]
    plans = {mode: build_plan(pretraining(*fit, f"student.trainable={mode}"), 2, 128) for mode in ("all", "head")}
    whole, head = plans["all"]["memory_gib"], plans["head"]["memory_gib"]
    assert head["student_weights"] == whole["student_weights"]
    head_params = 384 * 384 + 384 + 2 * 384 + 30522  # transform dense, LayerNorm, output bias
    assert head["optimizer_states"] * 2**30 == 12 * head_params // 2
    flops = {mode: plan["flops_per_token"]["student_forward_backward"] for mode, plan in plans.items()}
    encoder = 6 * 2 * (4 * 384 * 384 + 2 * 384 * 1536 + 2 * 128 * 384)
    assert flops["all"] - flops["head"] == 2 * encoder
    assert "student.trainable=head: the encoder is frozen" in render(plans["head"])
