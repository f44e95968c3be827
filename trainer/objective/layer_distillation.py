"""TinyBERT, PKD and MiniLM intermediate-layer distillation, resolved from the config.

:class:`LayerDistillation` is built once from ``objective.{tinybert,pkd,minilm}`` and the two
models' configs. It decides which student layer is compared with which teacher layer, what must
be captured from each model (only the mapped layers; see ``trainer.objective.capture``), and owns the
learned projections W_e / W_h that lift a narrower student to the teacher's width. It lives
inside the Distiller, so the projections are trained by the DeepSpeed engine with the student
and checkpointed with it, while the export (the student alone) leaves them behind.

Layer indices are 0-based: student layer ``i`` is the paper's layer ``m = i + 1``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from common.config import require
from trainer.config import ObjectiveConfig
from trainer.objective.capture import Captured, CaptureSpec
from trainer.objective.layer_losses import (
    attention_score_mse,
    hidden_mse,
    pkd_patient_loss,
    relation_kl,
    scaled_relation,
)


def uniform_layer_map(teacher_layers: int, student_layers: int, key: str) -> list[int]:
    """TinyBERT's g(m) = m·k with k = teacher_layers / student_layers: each student layer's teacher layer."""
    require(
        teacher_layers % student_layers == 0,
        key,
        f"the teacher's {teacher_layers} layers are not a multiple of the student's {student_layers}: "
        "list the teacher layer for each student layer",
    )
    k = teacher_layers // student_layers
    return [(i + 1) * k - 1 for i in range(student_layers)]


def pkd_layer_map(teacher_layers: int, student_layers: int, strategy: str, key: str) -> list[int]:
    """Teacher layers for the student's intermediate layers 0 .. M-2 (PKD leaves the last to the output loss).

    PKD-Skip takes every k-th teacher layer, PKD-Last the teacher's last M-1 layers before its top one.
    """
    if strategy == "skip":
        return uniform_layer_map(teacher_layers, student_layers, key)[:-1]
    return [teacher_layers - student_layers + i for i in range(student_layers - 1)]


def explicit_layer_map(layers: list[int], expected: int, teacher_layers: int, key: str) -> list[int]:
    require(len(layers) == expected, key, f"needs {expected} teacher layers (one per student layer), got {len(layers)}")
    require(max(layers) < teacher_layers, key, f"the teacher has only {teacher_layers} layers (0-based indices)")
    return list(layers)


def layer_term_weights(objective: ObjectiveConfig) -> dict[str, float]:
    """The active layer terms (positive weight) by the name they are logged under."""
    tiny, minilm = objective.tinybert, objective.minilm
    weights = {
        "tinybert_embedding": tiny.embedding,
        "tinybert_hidden": tiny.hidden,
        "tinybert_attention": tiny.attention,
        "pkd": objective.pkd.weight,
        "minilm_attention": minilm.attention,
        "minilm_value": minilm.value,
    }
    return {name: weight for name, weight in weights.items() if weight > 0}


class LayerDistillation(nn.Module):
    """The layer-level terms of the objective; ``weights`` names each active term and its weight."""

    def __init__(self, objective: ObjectiveConfig, teacher_config: Any, student_config: Any) -> None:
        super().__init__()
        tiny, pkd, minilm = objective.tinybert, objective.pkd, objective.minilm
        n_teacher, n_student = teacher_config.num_hidden_layers, student_config.num_hidden_layers
        self.teacher_heads = teacher_config.num_attention_heads
        self.student_heads = student_config.num_attention_heads
        self.weights = layer_term_weights(objective)

        self.tinybert_map: list[tuple[int, int]] = []
        if tiny.hidden > 0 or tiny.attention > 0:
            key = "objective.tinybert.teacher_layers"
            teacher = (
                uniform_layer_map(n_teacher, n_student, key)
                if tiny.teacher_layers is None
                else explicit_layer_map(tiny.teacher_layers, n_student, n_teacher, key)
            )
            self.tinybert_map = list(enumerate(teacher))
        if tiny.attention > 0:
            require(
                self.student_heads == self.teacher_heads,
                "objective.tinybert.attention",
                f"compares attention scores head by head, so the student needs the teacher's "
                f"{self.teacher_heads} heads (it has {self.student_heads}); set student.num_attention_heads, "
                "or use objective.minilm, which handles different head counts",
            )

        self.pkd_map: list[tuple[int, int]] = []
        if pkd.weight > 0:
            key = "objective.pkd.teacher_layers"
            require(n_student >= 2, "objective.pkd.weight", "PKD needs a student with at least 2 layers")
            teacher = (
                pkd_layer_map(n_teacher, n_student, pkd.strategy, key)
                if pkd.teacher_layers is None
                else explicit_layer_map(pkd.teacher_layers, n_student - 1, n_teacher, key)
            )
            self.pkd_map = list(enumerate(teacher))

        self.minilm_pair: tuple[int, int] | None = None
        self.relation_heads = minilm.relation_heads
        if minilm.attention > 0 or minilm.value > 0:
            teacher_layer = minilm.teacher_layer + n_teacher if minilm.teacher_layer < 0 else minilm.teacher_layer
            require(
                0 <= teacher_layer < n_teacher,
                "objective.minilm.teacher_layer",
                f"the teacher has {n_teacher} layers, got {minilm.teacher_layer}",
            )
            self.minilm_pair = (n_student - 1, teacher_layer)
            if minilm.relation_heads is None:
                require(
                    self.student_heads == self.teacher_heads,
                    "objective.minilm.relation_heads",
                    f"student ({self.student_heads}) and teacher ({self.teacher_heads}) head counts differ: "
                    "set a number of relation heads dividing both hidden sizes (MiniLMv2)",
                )
            else:
                for who, width in (("student", student_config.hidden_size), ("teacher", teacher_config.hidden_size)):
                    require(
                        width % minilm.relation_heads == 0,
                        "objective.minilm.relation_heads",
                        f"{minilm.relation_heads} does not divide the {who}'s hidden size {width}",
                    )

        # W_e and W_h of TinyBERT: only when the widths differ (a same-width student is compared directly).
        widths_differ = student_config.hidden_size != teacher_config.hidden_size
        self.embedding_projection = (
            nn.Linear(student_config.hidden_size, teacher_config.hidden_size)
            if widths_differ and tiny.embedding > 0
            else None
        )
        self.hidden_projection = (
            nn.Linear(student_config.hidden_size, teacher_config.hidden_size)
            if widths_differ and (tiny.hidden > 0 or pkd.weight > 0)
            else None
        )

    def capture_specs(self) -> tuple[CaptureSpec, CaptureSpec]:
        """(student, teacher) capture specs: just the layers and tensors the active terms read."""
        hidden_pairs = (self.tinybert_map if "tinybert_hidden" in self.weights else []) + self.pkd_map
        qkv_pairs = list(self.tinybert_map if "tinybert_attention" in self.weights else [])
        if self.minilm_pair is not None:
            qkv_pairs.append(self.minilm_pair)
        embeddings = "tinybert_embedding" in self.weights
        return tuple(
            CaptureSpec(
                embeddings=embeddings,
                hidden=tuple(sorted({pair[side] for pair in hidden_pairs})),
                qkv=tuple(sorted({pair[side] for pair in qkv_pairs})),
            )
            for side in (0, 1)
        )

    def layer_maps(self) -> dict[str, Any]:
        """The resolved (student layer, teacher layer) pairs, as ``plan`` reports them."""
        maps: dict[str, Any] = {}
        if self.tinybert_map:
            maps["tinybert"] = [list(pair) for pair in self.tinybert_map]
        if self.pkd_map:
            maps["pkd"] = [list(pair) for pair in self.pkd_map]
        if self.minilm_pair is not None:
            maps["minilm"] = list(self.minilm_pair)
        return maps

    def forward(self, student: Captured, teacher: Captured, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The unweighted active terms (float32 scalars); the caller weights them with ``self.weights``."""
        terms: dict[str, torch.Tensor] = {}
        if "tinybert_embedding" in self.weights:
            terms["tinybert_embedding"] = hidden_mse(
                project(self.embedding_projection, student.embeddings), teacher.embeddings, mask
            )
        if "tinybert_hidden" in self.weights:
            terms["tinybert_hidden"] = sum(
                hidden_mse(project(self.hidden_projection, student.hidden[s]), teacher.hidden[t], mask)
                for s, t in self.tinybert_map
            )
        if "tinybert_attention" in self.weights:
            terms["tinybert_attention"] = sum(
                attention_score_mse(
                    scaled_relation(student.query[s], student.key[s], self.student_heads),
                    scaled_relation(teacher.query[t], teacher.key[t], self.teacher_heads),
                    mask,
                )
                for s, t in self.tinybert_map
            )
        if "pkd" in self.weights:
            student_cls = torch.stack([student.hidden[s][:, 0] for s, _ in self.pkd_map], dim=1)
            teacher_cls = torch.stack([teacher.hidden[t][:, 0] for _, t in self.pkd_map], dim=1)
            terms["pkd"] = pkd_patient_loss(project(self.hidden_projection, student_cls), teacher_cls)
        if self.minilm_pair is not None:
            s, t = self.minilm_pair
            s_heads = self.relation_heads or self.student_heads
            t_heads = self.relation_heads or self.teacher_heads
            if "minilm_attention" in self.weights:
                terms["minilm_attention"] = relation_kl(
                    scaled_relation(student.query[s], student.key[s], s_heads),
                    scaled_relation(teacher.query[t], teacher.key[t], t_heads),
                    mask,
                )
            if "minilm_value" in self.weights:
                terms["minilm_value"] = relation_kl(
                    scaled_relation(student.value[s], student.value[s], s_heads),
                    scaled_relation(teacher.value[t], teacher.value[t], t_heads),
                    mask,
                )
        return terms


def project(projection: nn.Linear | None, x: torch.Tensor) -> torch.Tensor:
    return x if projection is None else projection(x)
