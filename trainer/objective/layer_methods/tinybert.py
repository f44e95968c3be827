"""TinyBERT transformer-layer distillation (Jiao et al., 2020): embeddings, hidden states, attention scores.

Student layer ``i`` learns from teacher layer ``g(i)``: the uniform map, or
``objective.tinybert.teacher_layers``. A narrower student is lifted to the teacher's width by two
learned projections, W_e for the embeddings and W_h for every mapped hidden state (the paper's two;
TinyBERT's reference code shares one).
"""

from __future__ import annotations

from typing import Any

import torch

from common.config import require
from trainer.config import TinyBertConfig
from trainer.objective.capture import Captured, CaptureSpec
from trainer.objective.layer_methods.base import (
    LayerMethod,
    explicit_layer_map,
    pair_specs,
    project,
    split_heads,
    uniform_layer_map,
    width_projection,
)


def hidden_mse(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean squared error over real tokens and hidden units (TinyBERT's embedding and hidden losses).

    ``student`` must already be projected to the teacher's width.
    """
    keep = mask.to(torch.float32).unsqueeze(-1)
    squared = (student.float() - teacher.float()).square() * keep
    return squared.sum() / (keep.sum() * student.shape[-1]).clamp_min(1.0)


def attention_score_mse(
    student_query: torch.Tensor,
    student_key: torch.Tensor,
    teacher_query: torch.Tensor,
    teacher_key: torch.Tensor,
    num_heads: int,
    mask: torch.Tensor,
) -> torch.Tensor:
    """TinyBERT's attention loss: the MSE of the two models' pre-softmax scores ``A = Q Kᵀ/√d``, head by head,
    over real (query, key) pairs, computed without the ``[batch, heads, seq, seq]`` score matrices.

    Per head, ``Σ (A_s - A_t)² = ‖A_s‖² + ‖A_t‖² - 2⟨A_s, A_t⟩``, and ``⟨Q₁K₁ᵀ, Q₂K₂ᵀ⟩ = ⟨Q₁ᵀQ₂, K₁ᵀK₂⟩``:
    inner products of ``d x d`` Gram matrices, which cost ``seq·d²`` per head instead of ``seq²·d`` and
    hold nothing of size ``seq²``. Written as the score matrices' difference, the loss moved the bulk of a
    TinyBERT step's bytes and memory (docs/log/benchmarks.md, "The step's floor"). The rows of a padded token's
    query and key are zeroed, so its pairs score zero in both models and add nothing; the mean is over
    real pairs. Float32 throughout: against a float64 reference the loss and its gradient are within 1e-6
    for a student far from its teacher, and within 2e-3 and 7e-5 for one whose scores are the teacher's
    within 1 % (the sum then cancels; 8 x 512 tokens, 12 heads of 64), under the bf16 rounding of the q and
    k it is computed from (``tests/trainer/test_layer_losses.py``).
    """
    real = mask.to(torch.float32)

    def heads(x: torch.Tensor) -> torch.Tensor:  # per head, scaled so that A = Q' K'ᵀ: one float32 pass over x
        scale = real.unsqueeze(-1) / (x.shape[-1] // num_heads) ** 0.25
        return split_heads(x * scale, num_heads)

    qs, ks, qt, kt = heads(student_query), heads(student_key), heads(teacher_query), heads(teacher_key)

    def inner(q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
        """Σ over batch and heads of ⟨Q₁K₁ᵀ, Q₂K₂ᵀ⟩."""
        return ((q1.mT @ q2) * (k1.mT @ k2)).sum()

    squared = inner(qs, qs, ks, ks) + inner(qt, qt, kt, kt) - 2 * inner(qs, qt, ks, kt)
    tokens = real.sum(-1)
    return squared / ((tokens * tokens).sum() * num_heads).clamp_min(1.0)


class Method(LayerMethod):
    @staticmethod
    def term_weights(config: TinyBertConfig) -> dict[str, float]:
        return {
            "tinybert_embedding": config.embedding,
            "tinybert_hidden": config.hidden,
            "tinybert_attention": config.attention,
        }

    def __init__(self, config: TinyBertConfig, teacher_config: Any, student_config: Any) -> None:
        super().__init__(config)
        n_teacher, n_student = teacher_config.num_hidden_layers, student_config.num_hidden_layers
        self.teacher_heads = teacher_config.num_attention_heads
        self.student_heads = student_config.num_attention_heads

        # (student layer, teacher layer); the embedding loss alone needs no map.
        self.pairs: list[tuple[int, int]] = []
        if config.hidden > 0 or config.attention > 0:
            key = "objective.tinybert.teacher_layers"
            teacher = (
                uniform_layer_map(n_teacher, n_student, key)
                if config.teacher_layers is None
                else explicit_layer_map(config.teacher_layers, n_student, n_teacher, key)
            )
            self.pairs = list(enumerate(teacher))
        if config.attention > 0:
            require(
                self.student_heads == self.teacher_heads,
                "objective.tinybert.attention",
                f"compares attention scores head by head, so the student needs the teacher's "
                f"{self.teacher_heads} heads (it has {self.student_heads}); set student.num_attention_heads, "
                "or use objective.minilm, which handles different head counts",
            )

        # W_e before W_h: the creation order fixes which random numbers each one is initialised with.
        self.embedding_projection = width_projection(student_config, teacher_config, config.embedding > 0)
        self.hidden_projection = width_projection(student_config, teacher_config, config.hidden > 0)

    def capture_specs(self) -> tuple[CaptureSpec, CaptureSpec]:
        return pair_specs(
            hidden=self.pairs if "tinybert_hidden" in self.weights else [],
            qkv=self.pairs if "tinybert_attention" in self.weights else [],
            embeddings="tinybert_embedding" in self.weights,
        )

    def layer_map(self) -> list[list[int]] | None:
        return [list(pair) for pair in self.pairs] or None

    def forward(self, student: Captured, teacher: Captured, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        terms: dict[str, torch.Tensor] = {}
        if "tinybert_embedding" in self.weights:
            terms["tinybert_embedding"] = hidden_mse(
                project(self.embedding_projection, student.embeddings), teacher.embeddings, mask
            )
        if "tinybert_hidden" in self.weights:
            terms["tinybert_hidden"] = sum(
                hidden_mse(project(self.hidden_projection, student.hidden[s]), teacher.hidden[t], mask)
                for s, t in self.pairs
            )
        if "tinybert_attention" in self.weights:
            # Pre-softmax scores, head by head (the two models' head counts are equal, their head sizes need not be).
            terms["tinybert_attention"] = sum(
                attention_score_mse(
                    student.query[s], student.key[s], teacher.query[t], teacher.key[t], self.student_heads, mask
                )
                for s, t in self.pairs
            )
        return terms
