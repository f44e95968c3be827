"""MiniLM deep self-attention distillation (Wang et al., 2020) on the student's last layer.

The student's last layer learns the self-attention distributions and value relations of one
teacher layer (``objective.minilm.teacher_layer``, the last by default). Relations are S×S per
head, so the widths never have to match and nothing is learned; with ``relation_heads`` set
(MiniLMv2) the head counts need not match either.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from common.config import require
from trainer.config import MiniLmConfig
from trainer.objective.capture import Captured, CaptureSpec
from trainer.objective.layer_methods.base import LayerMethod, pair_specs, scaled_relation


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


class Method(LayerMethod):
    @staticmethod
    def term_weights(config: MiniLmConfig) -> dict[str, float]:
        return {"minilm_attention": config.attention, "minilm_value": config.value}

    def __init__(self, config: MiniLmConfig, teacher_config: Any, student_config: Any) -> None:
        super().__init__(config)
        n_teacher, n_student = teacher_config.num_hidden_layers, student_config.num_hidden_layers
        teacher_layer = config.teacher_layer + n_teacher if config.teacher_layer < 0 else config.teacher_layer
        require(
            0 <= teacher_layer < n_teacher,
            "objective.minilm.teacher_layer",
            f"the teacher has {n_teacher} layers, got {config.teacher_layer}",
        )
        self.pair = (n_student - 1, teacher_layer)

        # Relation heads: each model's own (MiniLM v1, counts must be equal) or r for both (MiniLMv2).
        teacher_heads, student_heads = teacher_config.num_attention_heads, student_config.num_attention_heads
        if config.relation_heads is None:
            require(
                student_heads == teacher_heads,
                "objective.minilm.relation_heads",
                f"student ({student_heads}) and teacher ({teacher_heads}) head counts differ: "
                "set a number of relation heads dividing both hidden sizes (MiniLMv2)",
            )
        else:
            for who, width in (("student", student_config.hidden_size), ("teacher", teacher_config.hidden_size)):
                require(
                    width % config.relation_heads == 0,
                    "objective.minilm.relation_heads",
                    f"{config.relation_heads} does not divide the {who}'s hidden size {width}",
                )
        self.student_heads = config.relation_heads or student_heads
        self.teacher_heads = config.relation_heads or teacher_heads

    def capture_specs(self) -> tuple[CaptureSpec, CaptureSpec]:
        return pair_specs(qkv=[self.pair])

    def layer_map(self) -> list[int]:
        return list(self.pair)

    def forward(self, student: Captured, teacher: Captured, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        (s, t), terms = self.pair, {}
        if "minilm_attention" in self.weights:
            terms["minilm_attention"] = relation_kl(
                scaled_relation(student.query[s], student.key[s], self.student_heads),
                scaled_relation(teacher.query[t], teacher.key[t], self.teacher_heads),
                mask,
            )
        if "minilm_value" in self.weights:
            terms["minilm_value"] = relation_kl(
                scaled_relation(student.value[s], student.value[s], self.student_heads),
                scaled_relation(teacher.value[t], teacher.value[t], self.teacher_heads),
                mask,
            )
        return terms
