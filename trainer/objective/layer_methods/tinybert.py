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
    scaled_relation,
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


def attention_score_mse(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TinyBERT's attention loss: MSE of ``[batch, heads, seq, seq]`` scores over real (query, key) pairs."""
    real = mask.to(torch.float32)
    pairs = (real.unsqueeze(-1) * real.unsqueeze(-2)).unsqueeze(1)  # [batch, 1, seq, seq]
    squared = (student.float() - teacher.float()).square() * pairs
    return squared.sum() / (pairs.sum() * student.shape[1]).clamp_min(1.0)


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
            # Pre-softmax scores, each model with its own (equal) head count.
            terms["tinybert_attention"] = sum(
                attention_score_mse(
                    scaled_relation(student.query[s], student.key[s], self.student_heads),
                    scaled_relation(teacher.query[t], teacher.key[t], self.teacher_heads),
                    mask,
                )
                for s, t in self.pairs
            )
        return terms
