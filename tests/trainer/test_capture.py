"""Capture records exactly the mapped layers, changes nothing, and its tensors are the model's own."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertForMaskedLM, BertModel, RobertaConfig, RobertaForMaskedLM

from trainer.objective.capture import CaptureSpec, capture, encoder_parts
from trainer.objective.layer_methods.base import scaled_relation

SHAPE = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64, vocab_size=120)


def build(cls: type, config_cls: type, attn: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    extra = {"pad_token_id": 1, "max_position_embeddings": 40} if config_cls is RobertaConfig else {}
    model = cls(config_cls(**SHAPE, **extra, attn_implementation=attn))
    return model.eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(5, 120, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    ids[1, 6:] = 1  # padding
    return ids, mask


MODELS = [(BertForMaskedLM, BertConfig), (BertModel, BertConfig), (RobertaForMaskedLM, RobertaConfig)]


@pytest.mark.parametrize(("cls", "config_cls"), MODELS)
def test_capture_records_only_the_mapped_layers_and_leaves_outputs_unchanged(cls, config_cls):
    model = build(cls, config_cls)
    ids, mask = batch()
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        hooks_before = sum(len(m._forward_hooks) for m in model.modules())  # transformers' own, lazily added
        spec = CaptureSpec(embeddings=True, hidden=(1, 3), qkv=(2,))
        with capture(model, spec) as got:
            captured_out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    first = "logits" if "logits" in plain else "last_hidden_state"
    assert torch.equal(plain[first], captured_out[first])
    assert sorted(got.hidden) == [1, 3] and sorted(got.query) == sorted(got.key) == sorted(got.value) == [2]
    states = captured_out.hidden_states  # (embeddings, layer 0, ..., layer 3)
    assert torch.equal(got.embeddings, states[0])
    for layer in (1, 3):
        assert torch.equal(got.hidden[layer], states[layer + 1])
    assert model.config._attn_implementation == "sdpa"  # no layer was switched to eager attention
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks_before  # ours are gone after the block
    assert got.query[2].shape == (2, 9, 32) and len(encoder_parts(model)[1]) == 4


@pytest.mark.parametrize(("cls", "config_cls"), [MODELS[0], MODELS[2]])
def test_recomputed_scores_are_the_models_attention(cls, config_cls):
    """softmax(Q Kᵀ/√d + padding mask) from captured Q, K equals what eager attention computes."""
    model = build(cls, config_cls, attn="eager")
    ids, mask = batch()
    with torch.no_grad(), capture(model, CaptureSpec(qkv=(0, 2))) as got:
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    for layer in (0, 2):
        scores = scaled_relation(got.query[layer], got.key[layer], num_heads=4)
        scores = scores.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
        torch.testing.assert_close(scores.softmax(-1), out.attentions[layer], rtol=1e-5, atol=1e-6)


def test_capture_keeps_gradients_flowing_to_the_student():
    model = build(BertForMaskedLM, BertConfig).train()
    ids, mask = batch()
    with capture(model, CaptureSpec(hidden=(0,), qkv=(1,))) as got:
        model(input_ids=ids, attention_mask=mask)
    (got.hidden[0].square().mean() + got.value[1].square().mean()).backward()
    assert model.bert.encoder.layer[0].output.dense.weight.grad.abs().sum() > 0
    assert model.bert.encoder.layer[1].attention.self.value.weight.grad.abs().sum() > 0
    assert model.bert.encoder.layer[2].output.dense.weight.grad is None  # above the captured layers


def test_capture_rejects_missing_layers_and_non_bert_models():
    model = build(BertModel, BertConfig)
    with pytest.raises(IndexError, match="has 4 layers"), capture(model, CaptureSpec(hidden=(4,))):
        pass
    with pytest.raises(TypeError, match="BERT-style encoder"), capture(nn.Linear(2, 2), CaptureSpec()):
        pass


def test_distiller_layer_terms_equal_a_direct_computation():
    """The Distiller's layer terms, recomputed from ``output_hidden_states`` and the layers' own Q/K/V linears."""
    from helpers import score_matrix_mse

    from common.config import load_config
    from trainer.config import ObjectiveConfig, StudentConfig
    from trainer.modeling import build_student
    from trainer.objective.distiller import Distiller
    from trainer.objective.layer_methods.minilm import relation_kl
    from trainer.objective.layer_methods.pkd import pkd_patient_loss
    from trainer.objective.layer_methods.tinybert import hidden_mse
    from trainer.objective.masking import MaskedBatch

    teacher = build(BertForMaskedLM, BertConfig)
    settings = ["ce=1", "mlm=1", "cos=0", "tinybert.embedding=1", "tinybert.hidden=2", "tinybert.attention=3"]
    settings += [
        "pkd.weight=10",
        "pkd.strategy=last",
        "minilm.attention=1",
        "minilm.value=1",
        "minilm.relation_heads=2",
    ]
    objective = load_config(ObjectiveConfig, None, settings)
    student = build_student(
        StudentConfig(init="random", num_layers=2, hidden_size=16, num_attention_heads=4, intermediate_size=32), teacher
    ).eval()
    distiller = Distiller(student, teacher, objective)
    ids, mask = batch()
    labels = torch.full_like(ids, -100)
    labels[:, 2] = ids[:, 2]
    out = distiller(MaskedBatch.from_labels(ids, labels, budget=1), mask)

    s_states = student(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    t_states = teacher(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states

    def projection(model, states, layer, name):  # the layer's own linear applied to its input
        return getattr(encoder_parts(model)[1][layer].attention.self, name)(states[layer])

    layers = distiller.layer_distillation
    w_e, w_h = layers.methods["tinybert"].embedding_projection, layers.methods["tinybert"].hidden_projection
    w_p = layers.methods["pkd"].projection  # PKD's own, not TinyBERT's W_h
    expected = {
        "tinybert_embedding": hidden_mse(w_e(s_states[0]), t_states[0], mask),
        "tinybert_hidden": hidden_mse(w_h(s_states[1]), t_states[2], mask)
        + hidden_mse(w_h(s_states[2]), t_states[4], mask),
        "tinybert_attention": sum(
            score_matrix_mse(
                projection(student, s_states, i, "query"),
                projection(student, s_states, i, "key"),
                projection(teacher, t_states, j, "query"),
                projection(teacher, t_states, j, "key"),
                4,
                mask,
            )
            for i, j in [(0, 1), (1, 3)]
        ),
        "pkd": pkd_patient_loss(w_p(s_states[1][:, :1]), t_states[3][:, :1]),  # PKD-Last 4 -> 2: teacher layer 2
        "minilm_attention": relation_kl(
            scaled_relation(projection(student, s_states, 1, "query"), projection(student, s_states, 1, "key"), 2),
            scaled_relation(projection(teacher, t_states, 3, "query"), projection(teacher, t_states, 3, "key"), 2),
            mask,
        ),
        "minilm_value": relation_kl(
            scaled_relation(projection(student, s_states, 1, "value"), projection(student, s_states, 1, "value"), 2),
            scaled_relation(projection(teacher, t_states, 3, "value"), projection(teacher, t_states, 3, "value"), 2),
            mask,
        ),
    }
    for name, value in expected.items():
        torch.testing.assert_close(out[name], value, rtol=1e-5, atol=1e-6, msg=name)
    weights = {"ce": 1, "mlm": 1, "tinybert_embedding": 1, "tinybert_hidden": 2, "tinybert_attention": 3}
    weights |= {"pkd": 10, "minilm_attention": 1, "minilm_value": 1}
    assert set(out) == {"loss", *weights}
    torch.testing.assert_close(out["loss"], sum(w * out[name] for name, w in weights.items()))

    out["loss"].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layers.parameters())
    assert all(p.grad is None for p in teacher.parameters())
    assert not any("projection" in key for key in distiller.student_model().state_dict())
