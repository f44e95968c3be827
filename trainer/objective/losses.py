"""DistilBERT's output-level losses (plus prediction-layer MSE), as pure tensor functions.

Every function takes tensors already gathered at the positions it applies to, a boolean
``valid`` mask over those positions (padding, or unused slots of the fixed masked-position
budget, are False), and returns a float32 scalar averaged over the valid positions. Logits and
hidden states may be bf16; the arithmetic is done in float32. A batch with no valid position
gives 0, not NaN, and nothing here reads a value back to the host.

Shapes: logits ``[..., vocab]``, hidden states ``[..., hidden]``, ``valid`` and labels ``[...]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the valid positions (0 if there are none).

    ``where`` rather than a multiplication, so that whatever an invalid slot holds (even inf) stays out.
    """
    return torch.where(valid, values, 0.0).sum() / valid.sum().clamp_min(1)


def kl_distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float, valid: torch.Tensor
) -> torch.Tensor:
    """L_ce = T^2 KL(softmax(t/T) || softmax(s/T)), summed over the vocabulary, averaged over positions.

    The T^2 factor keeps the gradient scale independent of the temperature (Hinton et al., 2015).
    """
    log_p_student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p_teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    kl = F.kl_div(log_p_student, log_p_teacher, reduction="none", log_target=True).sum(-1)
    return masked_mean(kl, valid) * temperature**2


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """L_mlm: cross-entropy of the student's prediction against the original token (label -100: ignored)."""
    ce = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="none", ignore_index=-100)
    return masked_mean(ce.view(labels.shape), valid)


def cosine_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """L_cos = 1 - cos(student, teacher) of the last hidden states, averaged over real tokens."""
    cos = F.cosine_similarity(student_hidden.float(), teacher_hidden.float(), dim=-1)
    return masked_mean(1.0 - cos, valid)


def logit_mse_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """L_mse: squared error of the raw logits, averaged over the vocabulary and the positions.

    The prediction-layer distillation of the Korean RoBERTa paper (no temperature).
    """
    mse = (student_logits.float() - teacher_logits.float()).pow(2).mean(-1)
    return masked_mean(mse, valid)
