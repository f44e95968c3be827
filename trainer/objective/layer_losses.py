"""Intermediate-layer distillation losses: TinyBERT, PKD and MiniLM, as pure tensor functions.

Every function takes already-captured tensors (see ``trainer.objective.capture``) and the ``[batch, seq]``
mask of real tokens, and returns a scalar in float32 whatever the training dtype, so that bf16
activations do not lose the small differences these losses are made of. Padded positions never
contribute: not to a sum, not to a mean's denominator (an all-padding batch gives 0, not NaN).
The formulas are written out in ``docs/objectives.md``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[batch, seq, heads * d]`` -> ``[batch, heads, seq, d]`` (the layout attention uses)."""
    batch, seq, width = x.shape
    if width % num_heads:
        raise ValueError(f"width {width} is not divisible into {num_heads} heads")
    return x.view(batch, seq, num_heads, width // num_heads).transpose(1, 2)


def scaled_relation(a: torch.Tensor, b: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Per-head ``a_h b_hᵀ / √d_h`` as ``[batch, heads, seq, seq]`` float32.

    With ``a, b`` = a layer's query and key projections and ``num_heads`` its own head count this
    is exactly the layer's pre-softmax attention score matrix (before the padding mask); with
    ``a = b`` = values it is MiniLM's value relation.
    """
    a_h = split_heads(a.float(), num_heads)
    b_h = split_heads(b.float(), num_heads)
    return a_h @ b_h.transpose(-1, -2) / math.sqrt(a_h.shape[-1])


def hidden_mse(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean squared error over real tokens and hidden units (TinyBERT's embedding and hidden losses).

    ``student`` must already be projected to the teacher's width.
    """
    keep = mask.to(torch.float32).unsqueeze(-1)
    squared = (student.float() - teacher.float()).square() * keep
    return squared.sum() / (keep.sum() * student.shape[-1]).clamp_min(1.0)


def attention_score_mse(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TinyBERT's attention loss: MSE of ``[batch, heads, seq, seq]`` scores over real (query, key) pairs."""
    real = mask.to(torch.float32)
    pairs = (real.unsqueeze(-1) * real.unsqueeze(-2)).unsqueeze(1)  # [batch, 1, seq, seq]
    squared = (student.float() - teacher.float()).square() * pairs
    return squared.sum() / (pairs.sum() * student.shape[1]).clamp_min(1.0)


def relation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """MiniLM's ``KL(softmax(teacher) ‖ softmax(student))`` over keys, averaged over heads and real queries.

    Both inputs are ``[batch, heads, seq, seq]`` relation logits (e.g. from :func:`scaled_relation`);
    padded keys are removed from the softmax, padded queries from the average.
    """
    keys = mask.bool()[:, None, None, :]
    floor = torch.finfo(torch.float32).min
    log_s = F.log_softmax(student_logits.float().masked_fill(~keys, floor), dim=-1)
    log_t = F.log_softmax(teacher_logits.float().masked_fill(~keys, floor), dim=-1)
    per_key = torch.where(keys, log_t.exp() * (log_t - log_s), 0.0)
    queries = mask.to(torch.float32)[:, None, :]  # [batch, 1, seq]
    per_query = per_key.sum(-1) * queries  # [batch, heads, seq]
    return per_query.sum() / (queries.sum() * student_logits.shape[1]).clamp_min(1.0)


def pkd_patient_loss(student_cls: torch.Tensor, teacher_cls: torch.Tensor) -> torch.Tensor:
    """PKD's patient loss: MSE between L2-normalised first-token states, ``[batch, layers, width]``.

    Averaged over samples, layers and hidden units like the reference implementation
    (``mse_loss`` of the normalised vectors), so the paper's β values keep their meaning.
    """
    return F.mse_loss(F.normalize(student_cls.float(), dim=-1), F.normalize(teacher_cls.float(), dim=-1))
