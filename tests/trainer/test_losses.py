"""Each output-level loss against its formula written out element by element."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.objective.losses import cosine_loss, kl_distillation_loss, logit_mse_loss, masked_lm_loss

# Two sequences x three positions x a vocabulary of 5; the last position of the second sequence is not valid.
STUDENT = torch.tensor(
    [
        [[1.0, 0.5, -0.3, 2.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2], [-1.0, 3.0, 0.5, 0.0, 1.5]],
        [[0.3, -2.0, 1.1, 0.4, 0.9], [2.5, 0.0, -0.5, 1.0, -1.0], [9.0, -9.0, 9.0, -9.0, 9.0]],
    ]
)
TEACHER = torch.tensor(
    [
        [[0.5, 1.5, -1.0, 2.5, 0.3], [1.0, -1.0, 0.0, 0.5, 2.0], [0.0, 2.0, 1.0, -0.5, 1.0]],
        [[0.0, -1.0, 2.0, 0.0, 0.5], [3.0, 0.5, -1.0, 0.5, 0.0], [-9.0, 9.0, -9.0, 9.0, -9.0]],
    ]
)
VALID = torch.tensor([[True, True, True], [True, True, False]])
LABELS = torch.tensor([[3, 0, 1], [2, 0, -100]])
POSITIONS = [(b, i) for b in range(2) for i in range(3) if VALID[b, i]]


def softmax(row: list[float], temperature: float = 1.0) -> list[float]:
    exps = [math.exp(x / temperature) for x in row]
    return [e / sum(exps) for e in exps]


@pytest.mark.parametrize("temperature", [1.0, 2.0, 4.0])
def test_kl_distillation_loss_matches_formula(temperature: float) -> None:
    total = 0.0
    for b, i in POSITIONS:
        p_t = softmax(TEACHER[b, i].tolist(), temperature)
        p_s = softmax(STUDENT[b, i].tolist(), temperature)
        total += sum(t * (math.log(t) - math.log(s)) for t, s in zip(p_t, p_s, strict=True))
    expected = temperature**2 * total / len(POSITIONS)
    got = kl_distillation_loss(STUDENT, TEACHER, temperature, VALID)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(expected, rel=1e-5)


def test_masked_lm_loss_matches_formula() -> None:
    expected = sum(-math.log(softmax(STUDENT[b, i].tolist())[LABELS[b, i]]) for b, i in POSITIONS) / len(POSITIONS)
    assert masked_lm_loss(STUDENT, LABELS, VALID).item() == pytest.approx(expected, rel=1e-5)


def test_cosine_loss_matches_formula() -> None:
    def cos(u: list[float], v: list[float]) -> float:
        dot = sum(a * b for a, b in zip(u, v, strict=True))
        return dot / (math.sqrt(sum(a * a for a in u)) * math.sqrt(sum(b * b for b in v)))

    expected = sum(1 - cos(STUDENT[b, i].tolist(), TEACHER[b, i].tolist()) for b, i in POSITIONS) / len(POSITIONS)
    assert cosine_loss(STUDENT, TEACHER, VALID).item() == pytest.approx(expected, rel=1e-5)


def test_logit_mse_loss_matches_formula() -> None:
    expected = sum(
        sum((s - t) ** 2 for s, t in zip(STUDENT[b, i].tolist(), TEACHER[b, i].tolist(), strict=True)) / 5
        for b, i in POSITIONS
    ) / len(POSITIONS)
    assert logit_mse_loss(STUDENT, TEACHER, VALID).item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    "loss",
    [
        lambda s, t, v: kl_distillation_loss(s, t, 2.0, v),
        lambda s, t, v: masked_lm_loss(s, LABELS, v),
        cosine_loss,
        logit_mse_loss,
    ],
    ids=["ce", "mlm", "cos", "mse"],
)
def test_invalid_positions_never_count(loss) -> None:
    """Whatever sits at an invalid position (here the +-9 rows) does not move the loss; no valid position gives 0."""
    changed_s, changed_t = STUDENT.clone(), TEACHER.clone()
    changed_s[1, 2], changed_t[1, 2] = torch.arange(5.0), -torch.arange(5.0)
    assert loss(changed_s, changed_t, VALID).item() == pytest.approx(loss(STUDENT, TEACHER, VALID).item(), rel=1e-6)
    assert loss(STUDENT, TEACHER, torch.zeros_like(VALID)).item() == 0.0
    changed_s[1, 2] = float("inf")  # not even an overflow there leaks into the mean
    assert loss(changed_s, changed_t, VALID).item() == pytest.approx(loss(STUDENT, TEACHER, VALID).item(), rel=1e-6)


def test_bf16_inputs_are_computed_in_float32() -> None:
    got = kl_distillation_loss(STUDENT.bfloat16(), TEACHER.bfloat16(), 2.0, VALID)
    reference = kl_distillation_loss(STUDENT.bfloat16().float(), TEACHER.bfloat16().float(), 2.0, VALID)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(reference.item(), rel=1e-6)


def test_kl_is_zero_when_student_equals_teacher_and_gradients_flow() -> None:
    student = TEACHER.clone().requires_grad_(True)
    loss = kl_distillation_loss(student, TEACHER, 2.0, VALID)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    shifted = (TEACHER + STUDENT).requires_grad_(True)
    kl_distillation_loss(shifted, TEACHER, 2.0, VALID).backward()
    assert shifted.grad[0].abs().sum() > 0 and shifted.grad[1, 2].abs().sum() == 0
