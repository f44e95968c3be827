"""The layer losses against their formulas written out element by element, and the layer maps."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import score_matrix_mse
from transformers import BertConfig

from common.config import ConfigError, load_config
from trainer.config import ObjectiveConfig
from trainer.objective.capture import Captured
from trainer.objective.layer_distillation import LayerDistillation
from trainer.objective.layer_methods.base import scaled_relation, uniform_layer_map
from trainer.objective.layer_methods.minilm import relation_kl
from trainer.objective.layer_methods.pkd import pkd_layer_map, pkd_patient_loss
from trainer.objective.layer_methods.tinybert import attention_score_mse, hidden_mse

# Two sequences of length 5; the second has two padded positions.
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])


def real_positions(b: int) -> list[int]:
    return [i for i in range(MASK.shape[1]) if MASK[b, i]]


def fixed(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_hidden_mse_is_the_mean_over_real_tokens_and_units():
    s, t = fixed(2, 5, 3, seed=1), fixed(2, 5, 3, seed=2)
    squares = [(s[b, i, d] - t[b, i, d]) ** 2 for b in range(2) for i in real_positions(b) for d in range(3)]
    assert len(squares) == 8 * 3
    assert hidden_mse(s, t, MASK).item() == pytest.approx(sum(squares).item() / len(squares), rel=1e-6)


def test_hidden_mse_of_a_hand_computed_case():
    s = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    t = torch.tensor([[[0.0, 0.0], [100.0, 100.0]]])
    assert hidden_mse(s, t, torch.tensor([[1, 0]])).item() == pytest.approx((1 + 4) / 2)


def test_scaled_relation_is_per_head_dot_product_over_sqrt_head_dim():
    q, k = fixed(2, 5, 6, seed=3), fixed(2, 5, 6, seed=4)
    scores = scaled_relation(q, k, num_heads=3)
    assert scores.shape == (2, 3, 5, 5) and scores.dtype == torch.float32
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 4, 1), (0, 1, 3, 2)]:
        expected = sum(q[b, i, 2 * h + d] * k[b, j, 2 * h + d] for d in range(2)) / math.sqrt(2)
        assert scores[b, h, i, j].item() == pytest.approx(expected.item(), rel=1e-5)


def test_attention_score_mse_averages_real_query_key_pairs_per_head():
    """Element by element: the scores of 2 heads, the student's 2 wide and the teacher's 3 (head sizes may differ)."""
    sq, sk, tq, tk = fixed(2, 5, 4, seed=5), fixed(2, 5, 4, seed=6), fixed(2, 5, 6, seed=9), fixed(2, 5, 6, seed=10)
    tq[1, 3:], tk[1, 3:] = 1e4, 1e4  # padded queries and keys: must not count

    def score(q: torch.Tensor, k: torch.Tensor, b: int, h: int, i: int, j: int) -> torch.Tensor:
        size = q.shape[-1] // 2
        return sum(q[b, i, h * size + d] * k[b, j, h * size + d] for d in range(size)) / math.sqrt(size)

    squares = [
        (score(sq, sk, b, h, i, j) - score(tq, tk, b, h, i, j)) ** 2
        for b in range(2)
        for h in range(2)
        for i in real_positions(b)
        for j in real_positions(b)
    ]
    assert len(squares) == 2 * (25 + 9)
    loss = attention_score_mse(sq, sk, tq, tk, 2, MASK)
    assert loss.item() == pytest.approx(sum(squares).item() / len(squares), rel=1e-5)


@pytest.mark.parametrize(("noise", "loss_error", "gradient_error"), [(None, 1e-5, 1e-5), (0.01, 1e-2, 1e-3)])
def test_attention_score_mse_without_score_matrices_is_as_precise_as_the_bf16_it_reads(
    noise: float | None, loss_error: float, gradient_error: float
) -> None:
    """Against the float64 score matrices, at the sizes of a step (128 tokens, 4 heads of 32). A student near its
    teacher (scores within 1 %) is the hard case: the Gram matrices' sum cancels. Its errors stay below bf16's
    rounding (4e-3) of the q and k they are computed from (at 8 x 512 tokens, 12 heads of 64: 1.6e-3 and 6.3e-5)."""
    generator = torch.Generator().manual_seed(0)
    tq, tk = (2 * torch.randn(2, 128, 128, generator=generator) for _ in range(2))
    if noise is None:  # a student far from its teacher, half its width
        sq, sk = (2 * torch.randn(2, 128, 64, generator=generator) for _ in range(2))
    else:
        sq, sk = (t + noise * torch.randn(t.shape, generator=generator) for t in (tq, tk))
    mask = torch.ones(2, 128, dtype=torch.long)
    mask[1, 100:] = 0
    exact = [x.double().requires_grad_() for x in (sq, sk)]
    reference = score_matrix_mse(*exact, tq, tk, 4, mask, dtype=torch.float64)
    reference.backward()
    fast = [x.clone().requires_grad_() for x in (sq, sk)]
    loss = attention_score_mse(*fast, tq, tk, 4, mask)
    loss.backward()
    assert loss.dtype == torch.float32
    assert abs(loss.item() - reference.item()) <= loss_error * reference.item()
    for got, want in zip(fast, exact, strict=True):
        assert (got.grad.double() - want.grad).norm() <= gradient_error * want.grad.norm()
    assert fast[0].grad[1, 100:].abs().max() == 0  # a padded token's query gets no gradient


def test_relation_kl_is_kl_teacher_student_over_real_keys_mean_over_heads_and_real_queries():
    s, t = fixed(2, 3, 5, 5, seed=7), fixed(2, 3, 5, 5, seed=8)
    s[1, :, :, 3:] = 50.0  # padded keys would dominate both softmaxes if they were not removed
    total, rows = 0.0, 0
    for b in range(2):
        keys = real_positions(b)
        for h in range(3):
            for i in real_positions(b):
                p_t = torch.softmax(t[b, h, i, keys], dim=0)
                p_s = torch.softmax(s[b, h, i, keys], dim=0)
                total += float((p_t * (p_t.log() - p_s.log())).sum())
                rows += 1
    assert rows == 3 * 8
    assert relation_kl(s, t, MASK).item() == pytest.approx(total / rows, rel=1e-5)
    assert relation_kl(t, t, MASK).item() == pytest.approx(0.0, abs=1e-6)


def test_pkd_patient_loss_compares_unit_vectors():
    s, t = fixed(2, 3, 4, seed=9), fixed(2, 3, 4, seed=10)
    squares = [
        (s[b, j, d] / s[b, j].norm() - t[b, j, d] / t[b, j].norm()) ** 2
        for b in range(2)
        for j in range(3)
        for d in range(4)
    ]
    assert pkd_patient_loss(s, t).item() == pytest.approx(sum(squares).item() / len(squares), rel=1e-6)
    assert pkd_patient_loss(3.0 * t, t).item() == pytest.approx(0.0, abs=1e-7)  # scale-free


@pytest.mark.parametrize(
    ("student_layers", "uniform", "skip", "last"),
    [
        (6, [1, 3, 5, 7, 9, 11], [1, 3, 5, 7, 9], [6, 7, 8, 9, 10]),  # PKD paper: {2,4,6,8,10} / {7,...,11}
        (4, [2, 5, 8, 11], [2, 5, 8], [8, 9, 10]),
        (3, [3, 7, 11], [3, 7], [9, 10]),  # PKD paper's BERT3: {4,8} / {10,11}
    ],
)
def test_layer_maps_from_12_teacher_layers(student_layers, uniform, skip, last):
    assert uniform_layer_map(12, student_layers, "k") == uniform
    assert pkd_layer_map(12, student_layers, "skip", "k") == skip
    assert pkd_layer_map(12, student_layers, "last", "k") == last


def test_uniform_map_needs_a_divisor():
    with pytest.raises(ConfigError, match=r"objective\.tinybert\.teacher_layers"):
        uniform_layer_map(12, 5, "objective.tinybert.teacher_layers")


def objective(*overrides: str) -> ObjectiveConfig:
    return load_config(ObjectiveConfig, None, ["ce=0", "mlm=0", "cos=0", *overrides])


TEACHER = BertConfig(hidden_size=24, num_hidden_layers=4, num_attention_heads=4, intermediate_size=32)
NARROW = BertConfig(hidden_size=12, num_hidden_layers=2, num_attention_heads=4, intermediate_size=16)


def captured(config: BertConfig, layers: range, seed: int, requires_grad: bool = False) -> Captured:
    def tensor(offset: int) -> torch.Tensor:
        x = fixed(2, 5, config.hidden_size, seed=seed + offset).float()
        return x.requires_grad_(requires_grad)

    return Captured(
        embeddings=tensor(0),
        hidden={i: tensor(10 + i) for i in layers},
        query={i: tensor(20 + i) for i in layers},
        key={i: tensor(30 + i) for i in layers},
        value={i: tensor(40 + i) for i in layers},
    )


def test_tinybert_terms_use_the_uniform_map_and_the_projections():
    layers = LayerDistillation(
        objective("tinybert.embedding=1", "tinybert.hidden=1", "tinybert.attention=1"), TEACHER, NARROW
    )
    assert layers.methods["tinybert"].pairs == [(0, 1), (1, 3)]
    student_spec, teacher_spec = layers.capture_specs()
    assert (student_spec.embeddings, student_spec.hidden, student_spec.qkv) == (True, (0, 1), (0, 1))
    assert (teacher_spec.embeddings, teacher_spec.hidden, teacher_spec.qkv) == (True, (1, 3), (1, 3))

    s, t = captured(NARROW, range(2), seed=100, requires_grad=True), captured(TEACHER, range(4), seed=200)
    terms = layers(s, t, MASK)
    assert set(terms) == {"tinybert_embedding", "tinybert_hidden", "tinybert_attention"}
    w_e, w_h = layers.methods["tinybert"].embedding_projection, layers.methods["tinybert"].hidden_projection
    assert terms["tinybert_embedding"].item() == pytest.approx(
        hidden_mse(w_e(s.embeddings), t.embeddings, MASK).item(), rel=1e-6
    )
    expected_hidden = sum(hidden_mse(w_h(s.hidden[i]), t.hidden[j], MASK) for i, j in [(0, 1), (1, 3)])
    assert terms["tinybert_hidden"].item() == pytest.approx(expected_hidden.item(), rel=1e-6)
    expected_attention = sum(
        score_matrix_mse(s.query[i], s.key[i], t.query[j], t.key[j], 4, MASK) for i, j in [(0, 1), (1, 3)]
    )
    assert terms["tinybert_attention"].item() == pytest.approx(expected_attention.item(), rel=1e-6)

    sum(terms.values()).backward()
    for projection in (w_e, w_h):
        assert projection.weight.grad is not None and projection.weight.grad.abs().sum() > 0
        assert projection.bias.grad is not None and projection.bias.grad.abs().sum() > 0
    assert s.hidden[0].grad.abs().sum() > 0 and s.query[1].grad.abs().sum() > 0


def test_same_width_students_need_no_projection():
    same = BertConfig(hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)
    layers = LayerDistillation(objective("tinybert.embedding=1", "tinybert.hidden=1", "pkd.weight=1"), TEACHER, same)
    tiny, pkd = layers.methods["tinybert"], layers.methods["pkd"]
    assert tiny.embedding_projection is None and tiny.hidden_projection is None and pkd.projection is None
    assert list(layers.parameters()) == []


def test_pkd_compares_normalised_first_tokens_of_intermediate_layers():
    student = BertConfig(hidden_size=24, num_hidden_layers=3, num_attention_heads=4, intermediate_size=32)
    teacher = BertConfig(hidden_size=24, num_hidden_layers=6, num_attention_heads=4, intermediate_size=32)
    for strategy, expected in (("skip", [(0, 1), (1, 3)]), ("last", [(0, 3), (1, 4)])):
        layers = LayerDistillation(objective("pkd.weight=100", f"pkd.strategy={strategy}"), teacher, student)
        assert layers.methods["pkd"].pairs == expected and layers.weights == {"pkd": 100.0}
        assert layers.capture_specs()[1].hidden == tuple(t for _, t in expected)
        s, t = captured(student, range(3), seed=300), captured(teacher, range(6), seed=400)
        terms = layers(s, t, MASK)
        cls_s = torch.stack([s.hidden[i][:, 0] for i, _ in expected], dim=1)
        cls_t = torch.stack([t.hidden[j][:, 0] for _, j in expected], dim=1)
        assert terms["pkd"].item() == pytest.approx(pkd_patient_loss(cls_s, cls_t).item(), rel=1e-6)


def test_minilm_with_relation_heads_handles_different_width_and_head_count():
    student = BertConfig(hidden_size=12, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16)
    with pytest.raises(ConfigError, match=r"objective\.minilm\.relation_heads"):
        LayerDistillation(objective("minilm.attention=1"), TEACHER, student)
    layers = LayerDistillation(
        objective("minilm.attention=1", "minilm.value=1", "minilm.relation_heads=3", "minilm.teacher_layer=-2"),
        TEACHER,
        student,
    )
    assert layers.methods["minilm"].pair == (1, 2) and list(layers.parameters()) == []
    assert layers.capture_specs()[0].qkv == (1,) and layers.capture_specs()[1].qkv == (2,)
    s, t = captured(student, range(2), seed=500), captured(TEACHER, range(4), seed=600)
    terms = layers(s, t, MASK)
    expected_value = relation_kl(
        scaled_relation(s.value[1], s.value[1], 3), scaled_relation(t.value[2], t.value[2], 3), MASK
    )
    assert terms["minilm_value"].item() == pytest.approx(expected_value.item(), rel=1e-6)
    assert terms["minilm_attention"].item() > 0


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["tinybert.attention=1"], "objective.tinybert.attention"),  # 2 student heads vs 4
        (["tinybert.hidden=1", "tinybert.teacher_layers=[1]"], "objective.tinybert.teacher_layers"),
        (["tinybert.hidden=1", "tinybert.teacher_layers=[1,4]"], "objective.tinybert.teacher_layers"),
        (["minilm.value=1", "minilm.teacher_layer=4"], "objective.minilm.teacher_layer"),
        (["minilm.value=1", "minilm.relation_heads=5"], "objective.minilm.relation_heads"),
        (["pkd.weight=1", "pkd.teacher_layers=[0,1]"], "objective.pkd.teacher_layers"),
    ],
)
def test_layer_config_errors_name_the_key(overrides, key):
    student = BertConfig(hidden_size=12, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        LayerDistillation(objective(*overrides), TEACHER, student)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("tinybert.hidden=-1", "objective.tinybert.hidden"),
        ("pkd.strategy=middle", "pkd.strategy"),
        ("pkd.teacher_layers=[-1]", "objective.pkd.teacher_layers"),
        ("minilm.relation_heads=0", "objective.minilm.relation_heads"),
    ],
)
def test_config_validation_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        objective(override)
