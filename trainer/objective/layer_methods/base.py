"""The contract every layer-distillation method follows, and the pieces several methods share.

Losses are pure tensor functions of already-captured tensors (see ``trainer.objective.capture``)
and the ``[batch, seq]`` mask of real tokens. Each returns a scalar in float32 whatever the
training dtype, so that bf16 activations do not lose the small differences these losses are made
of. Padded positions never contribute: not to a sum, not to a mean's denominator (an all-padding
batch gives 0, not NaN). The formulas are written out in ``docs/objectives.md``.

Layer indices are 0-based: student layer ``i`` is the papers' layer ``m = i + 1``.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from common.config import require
from trainer.objective.capture import Captured, CaptureSpec


class LayerMethod(nn.Module, abc.ABC):
    """One method: built from its config section and the two models' configs, only when enabled.

    A subclass resolves its layer map and checks the config in ``__init__`` (raising a
    ``ConfigError`` that names the offending key), creates any learned projection there (so it is
    trained and checkpointed with the student and never exported), and implements the abstract
    methods below (a subclass that misses one cannot be instantiated).
    """

    @staticmethod
    @abc.abstractmethod
    def term_weights(config: Any) -> dict[str, float]:
        """Every term of the method, by the name it is logged under, with its weight (0 = off)."""

    @classmethod
    def active_weights(cls, config: Any) -> dict[str, float]:
        """The terms to compute: those with a positive weight (an empty dict: the method is off)."""
        return {term: weight for term, weight in cls.term_weights(config).items() if weight > 0}

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.weights = self.active_weights(config)

    @abc.abstractmethod
    def capture_specs(self) -> tuple[CaptureSpec, CaptureSpec]:
        """(student, teacher): just the layers and tensors the active terms read."""

    @abc.abstractmethod
    def layer_map(self) -> Any:
        """The resolved (student layer, teacher layer) pairs as ``plan`` reports them; None: no map."""

    @abc.abstractmethod
    def forward(self, student: Captured, teacher: Captured, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The unweighted active terms (float32 scalars), in ``term_weights`` order."""


def pair_specs(
    hidden: Sequence[tuple[int, int]] = (), qkv: Sequence[tuple[int, int]] = (), embeddings: bool = False
) -> tuple[CaptureSpec, CaptureSpec]:
    """(student, teacher) specs capturing the layer outputs of ``hidden`` pairs and Q/K/V of ``qkv`` pairs."""
    return tuple(
        CaptureSpec(
            embeddings=embeddings,
            hidden=tuple(sorted({pair[side] for pair in hidden})),
            qkv=tuple(sorted({pair[side] for pair in qkv})),
        )
        for side in (0, 1)
    )


# Layer maps --------------------------------------------------------------------------------------------


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


def explicit_layer_map(layers: list[int], expected: int, teacher_layers: int, key: str) -> list[int]:
    """A teacher layer list from the config, checked against the two models' depths."""
    require(len(layers) == expected, key, f"needs {expected} teacher layers (one per student layer), got {len(layers)}")
    require(max(layers) < teacher_layers, key, f"the teacher has only {teacher_layers} layers (0-based indices)")
    return list(layers)


# Projections and relations -----------------------------------------------------------------------------


def width_projection(student_config: Any, teacher_config: Any, wanted: bool) -> nn.Linear | None:
    """A learned d_S -> d_T linear (with bias) when ``wanted`` and the widths differ; a same-width
    student is compared directly, with no parameters at all."""
    if not wanted or student_config.hidden_size == teacher_config.hidden_size:
        return None
    return nn.Linear(student_config.hidden_size, teacher_config.hidden_size)


def project(projection: nn.Linear | None, x: torch.Tensor) -> torch.Tensor:
    return x if projection is None else projection(x)


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
