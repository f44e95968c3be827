"""Teacher loading, student derivation (exact layer copy), parameter counts and the FLOPs formula."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForMaskedLM, BertForMaskedLM, RobertaConfig, RobertaForMaskedLM

from common.config import ConfigError
from trainer.config import StudentConfig
from trainer.modeling import (
    build_on_meta,
    build_student,
    default_layer_map,
    encoder_layers,
    load_teacher,
    load_teacher_config,
    mlm_head,
    student_config,
    student_layer_map,
)
from trainer.planning.plan import count_parameters, encoder_flops_per_token

REPO = Path(__file__).resolve().parents[2]
BERT_BASE = str(REPO / "configs" / "teachers" / "bert-base-uncased")
ROBERTA_BASE = str(REPO / "configs" / "teachers" / "roberta-base")


@pytest.fixture(scope="module")
def teacher(tiny_teacher_dir: Path) -> BertForMaskedLM:
    return load_teacher(str(tiny_teacher_dir), torch.float32)


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    a_params, b_params = dict(a.named_parameters()), dict(b.named_parameters())
    assert a_params.keys() == b_params.keys()
    for name, value in a_params.items():
        assert torch.equal(value, b_params[name]), name


def test_teacher_is_frozen_eval_sdpa(teacher: BertForMaskedLM) -> None:
    assert isinstance(teacher, BertForMaskedLM)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert teacher.config._attn_implementation == "sdpa"


def test_teacher_without_mlm_head_loads_as_encoder(bert_tokenizer_dir: Path) -> None:
    minilm = load_teacher(str(bert_tokenizer_dir), torch.bfloat16)  # the real all-MiniLM-L6-v2
    assert type(minilm).__name__ == "BertModel" and mlm_head(minilm) is None
    assert next(minilm.parameters()).dtype == torch.bfloat16


def test_unloadable_teacher_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="teacher"):
        load_teacher(str(tmp_path / "missing"), torch.float32)
    with pytest.raises(ConfigError, match="teacher"):
        load_teacher(BERT_BASE, torch.float32)  # a config without weights


@pytest.mark.parametrize("layers", [None, [1, 2, 3], [3]])
def test_student_layers_are_exact_copies(teacher: BertForMaskedLM, layers: list[int] | None) -> None:
    cfg = StudentConfig(teacher_layers=layers)
    student = build_student(cfg, teacher)
    layer_map = student_layer_map(cfg, 4)
    assert layer_map == (layers or [0, 3])
    assert isinstance(student, BertForMaskedLM) and student.config.num_hidden_layers == len(layer_map)
    for i, t in enumerate(layer_map):
        assert_same_parameters(encoder_layers(student)[i], encoder_layers(teacher)[t])
    s_emb, t_emb = student.bert.embeddings, teacher.bert.embeddings
    for name in ("word_embeddings", "position_embeddings", "LayerNorm"):
        assert_same_parameters(getattr(s_emb, name), getattr(t_emb, name))
    assert torch.equal(s_emb.token_type_embeddings.weight, t_emb.token_type_embeddings.weight[:1])
    assert_same_parameters(mlm_head(student), mlm_head(teacher))
    assert student.cls.predictions.decoder.weight is s_emb.word_embeddings.weight  # still tied
    assert all(p.requires_grad for p in student.parameters()) and student.dtype == torch.float32


def test_student_outputs_equal_teacher_when_all_layers_are_copied(teacher: BertForMaskedLM) -> None:
    """With every layer copied, the only difference is the token-type table: its row 0 is all we use."""
    student = build_student(StudentConfig(teacher_layers=[0, 1, 2, 3]), teacher).eval()
    ids = torch.randint(1000, 30000, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(student(input_ids=ids).logits, teacher(input_ids=ids).logits)


def test_student_saves_as_a_standard_masked_lm(teacher: BertForMaskedLM, tmp_path: Path) -> None:
    student = build_student(StudentConfig(), teacher).eval()
    student.save_pretrained(tmp_path)
    reloaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is BertForMaskedLM and reloaded.config.type_vocab_size == 1
    assert not any("pooler" in name for name in reloaded.state_dict())
    ids = torch.randint(1000, 30000, (1, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(reloaded(input_ids=ids).logits, student(input_ids=ids).logits)


@pytest.mark.parametrize("init", ["from_teacher", "pretrained"])
def test_attention_dropout_is_set_for_training_and_the_saved_config_keeps_the_base_value(
    teacher: BertForMaskedLM, tiny_teacher_dir: Path, tmp_path: Path, init: str
) -> None:
    """student.attention_dropout=0: in train mode the student computes what it computes in eval mode, once its
    other dropouts are off; the base's 0.1 does not. The saved config says 0.1, for a fine-tune."""
    assert teacher.config.attention_probs_dropout_prob > 0

    def trained_as_evaluated(attention_dropout: float | None) -> bool:
        model = tiny_teacher_dir if init == "pretrained" else None
        cfg = StudentConfig(init=init, model=str(model) if model else None, attention_dropout=attention_dropout)
        student = build_student(cfg, teacher)
        for name, module in student.named_modules():  # every dropout but the attention probabilities' off
            if isinstance(module, torch.nn.Dropout) and not name.endswith("attention.self.dropout"):
                module.p = 0.0
        ids = torch.randint(1000, 30000, (2, 16), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(0)
        trained = student.train()(input_ids=ids).logits
        same = torch.allclose(trained, student.eval()(input_ids=ids).logits, atol=1e-5)
        student.save_pretrained(tmp_path / f"saved-{attention_dropout}")
        saved = AutoModelForMaskedLM.from_pretrained(tmp_path / f"saved-{attention_dropout}").config
        assert saved.attention_probs_dropout_prob == teacher.config.attention_probs_dropout_prob
        return same

    assert trained_as_evaluated(0.0)
    assert not trained_as_evaluated(None)


def test_attention_dropout_errors_name_the_key() -> None:
    from transformers import DistilBertConfig

    from trainer.modeling import with_attention_dropout

    for bad in (-0.1, 1.0):
        with pytest.raises(ConfigError, match=r"^student\.attention_dropout: must be in \[0, 1\)"):
            StudentConfig(attention_dropout=bad).validate()
    with pytest.raises(ConfigError, match=r"^student\.attention_dropout: model_type 'distilbert' has no"):
        with_attention_dropout(DistilBertConfig(), 0.0)


def test_random_student_has_the_explicit_architecture(teacher: BertForMaskedLM) -> None:
    cfg = StudentConfig(init="random", num_layers=3, hidden_size=32, num_attention_heads=2, intermediate_size=48)
    student = build_student(cfg, teacher)
    c = student.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.intermediate_size) == (3, 32, 2, 48)
    assert c.vocab_size == teacher.config.vocab_size
    with pytest.raises(ConfigError, match=r"student\.hidden_size"):
        build_student(StudentConfig(init="random", hidden_size=30), teacher)  # 30 is not divisible by 4 heads


def test_layer_map_errors_name_the_key(teacher: BertForMaskedLM) -> None:
    with pytest.raises(ConfigError, match=r"student\.teacher_layers"):
        build_student(StudentConfig(teacher_layers=[0, 4]), teacher)
    with pytest.raises(ConfigError, match=r"student\.num_layers"):
        build_student(StudentConfig(num_layers=5), teacher)


def test_default_layer_maps() -> None:
    assert default_layer_map(12, 6) == [0, 2, 4, 7, 9, 11]  # DistilBERT
    assert default_layer_map(12, 12) == list(range(12))
    assert default_layer_map(24, 6) == [0, 4, 8, 15, 19, 23]
    for teacher_layers, student_layers in [(12, 4), (12, 3), (6, 3), (12, 5), (12, 1)]:
        layer_map = default_layer_map(teacher_layers, student_layers)
        assert len(layer_map) == student_layers and layer_map == sorted(set(layer_map))
        assert layer_map[0] == 0 and 0 <= layer_map[-1] < teacher_layers


def test_distilbert_student_has_66m_parameters() -> None:
    """DistilBERT's 66,362,880 (word + position embeddings, LayerNorm, 6 x 768 layers) plus the one
    constant 768-wide token-type row every Hugging Face BERT carries."""
    teacher_config = load_teacher_config(BERT_BASE)
    counts = count_parameters(build_on_meta(student_config(StudentConfig(), teacher_config)))
    assert counts["encoder"] == 66_362_880 + 768
    assert round(counts["encoder"] / 1e6) == 66
    assert round(count_parameters(build_on_meta(teacher_config))["encoder"] / 1e6) == 109  # BERT-base, no pooler


def test_distilroberta_student_has_82m_parameters() -> None:
    teacher_config = load_teacher_config(ROBERTA_BASE)
    student = build_on_meta(student_config(StudentConfig(), teacher_config))
    assert isinstance(student, RobertaForMaskedLM)
    assert round(count_parameters(student)["encoder"] / 1e6) == 82


def test_encoder_flops_formula_matches_counted_matmuls(teacher: BertForMaskedLM) -> None:
    ids = torch.randint(1000, 30000, (2, 48), generator=torch.Generator().manual_seed(2))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        teacher.base_model(input_ids=ids)
    assert counter.get_total_flops() == encoder_flops_per_token(teacher.config, 48) * ids.numel()


def test_roberta_family_student_is_copied_exactly(tmp_path: Path) -> None:
    """RoBERTa keeps its head in ``lm_head`` and offsets positions by the pad id: the copy still holds."""
    torch.manual_seed(0)
    config = RobertaConfig(
        vocab_size=500,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=66,
        type_vocab_size=1,
    )
    RobertaForMaskedLM(config).save_pretrained(tmp_path)
    teacher = load_teacher(str(tmp_path), torch.float32)
    student = build_student(StudentConfig(teacher_layers=[0, 1, 2, 3]), teacher).eval()
    assert isinstance(student, RobertaForMaskedLM) and mlm_head(student) is student.lm_head
    assert_same_parameters(mlm_head(student), mlm_head(teacher))
    ids = torch.randint(3, 500, (2, 20), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(student(input_ids=ids).logits, teacher(input_ids=ids).logits)
