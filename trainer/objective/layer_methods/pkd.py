"""Patient knowledge distillation (Sun et al., 2019): normalised first-token states of intermediate layers.

The student's layers 0 .. M-2 learn from teacher layers chosen by PKD-Skip, PKD-Last or
``objective.pkd.teacher_layers``; its top layer is left to the output-level loss. A narrower
student's states go through PKD's own learned projection before normalising.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from common.config import require
from trainer.config import PkdConfig
from trainer.objective.capture import Captured, CaptureSpec
from trainer.objective.layer_methods.base import (
    LayerMethod,
    explicit_layer_map,
    pair_specs,
    project,
    uniform_layer_map,
    width_projection,
)


def pkd_layer_map(teacher_layers: int, student_layers: int, strategy: str, key: str) -> list[int]:
    """Teacher layers for the student's intermediate layers 0 .. M-2 (PKD leaves the last to the output loss).

    PKD-Skip takes every k-th teacher layer, PKD-Last the teacher's last M-1 layers before its top one.
    """
    if strategy == "skip":
        return uniform_layer_map(teacher_layers, student_layers, key)[:-1]
    return [teacher_layers - student_layers + i for i in range(student_layers - 1)]


def pkd_patient_loss(student_cls: torch.Tensor, teacher_cls: torch.Tensor) -> torch.Tensor:
    """PKD's patient loss: MSE between L2-normalised first-token states, ``[batch, layers, width]``.

    Averaged over samples, layers and hidden units like the reference implementation
    (``mse_loss`` of the normalised vectors), so the paper's β values keep their meaning.
    """
    return F.mse_loss(F.normalize(student_cls.float(), dim=-1), F.normalize(teacher_cls.float(), dim=-1))


class Method(LayerMethod):
    @staticmethod
    def term_weights(config: PkdConfig) -> dict[str, float]:
        return {"pkd": config.weight}

    def __init__(self, config: PkdConfig, teacher_config: Any, student_config: Any) -> None:
        super().__init__(config)
        n_teacher, n_student = teacher_config.num_hidden_layers, student_config.num_hidden_layers
        require(n_student >= 2, "objective.pkd.weight", "PKD needs a student with at least 2 layers")
        key = "objective.pkd.teacher_layers"
        teacher = (
            pkd_layer_map(n_teacher, n_student, config.strategy, key)
            if config.teacher_layers is None
            else explicit_layer_map(config.teacher_layers, n_student - 1, n_teacher, key)
        )
        self.pairs: list[tuple[int, int]] = list(enumerate(teacher))
        self.projection = width_projection(student_config, teacher_config, wanted=True)

    def capture_specs(self) -> tuple[CaptureSpec, CaptureSpec]:
        return pair_specs(hidden=self.pairs)

    def layer_map(self) -> list[list[int]]:
        return [list(pair) for pair in self.pairs]

    def forward(self, student: Captured, teacher: Captured, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        # The mask is not needed: PKD reads only each sequence's first token ([CLS] / <s>).
        student_cls = torch.stack([student.hidden[s][:, 0] for s, _ in self.pairs], dim=1)
        teacher_cls = torch.stack([teacher.hidden[t][:, 0] for _, t in self.pairs], dim=1)
        return {"pkd": pkd_patient_loss(project(self.projection, student_cls), teacher_cls)}
