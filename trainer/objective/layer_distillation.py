"""Intermediate-layer distillation: the enabled methods of ``trainer/objective/layer_methods/``, summed.

Each method (TinyBERT, PKD, MiniLM) owns its layer map, what it captures, its learned projections
and its loss in its own module. The convention that connects a method to the config is its name:
``ObjectiveConfig.LAYER_METHODS`` in ``trainer/config.py`` lists the names, and each name ``<name>`` is
both the config section ``objective.<name>`` and the module ``trainer.objective.layer_methods.<name>``,
whose class ``Method`` (a ``LayerMethod``) is built when the section has a positive weight. Adding a
method is one new module plus its section in the config; nothing here lists the methods.

:class:`LayerDistillation` lives inside the Distiller, so the methods' projections are trained by
the DeepSpeed engine with the student and checkpointed with it, while the export (the student
alone) leaves them behind.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from trainer.config import ObjectiveConfig
from trainer.objective.capture import Captured, CaptureSpec
from trainer.objective.layer_methods.base import LayerMethod

METHODS_PACKAGE = "trainer.objective.layer_methods"


def method_class(name: str) -> type[LayerMethod]:
    """The ``Method`` class of ``trainer.objective.layer_methods.<name>``."""
    return importlib.import_module(f"{METHODS_PACKAGE}.{name}").Method


def layer_term_weights(objective: ObjectiveConfig) -> dict[str, float]:
    """The active layer terms (positive weight) by the name they are logged under, in method order."""
    weights: dict[str, float] = {}
    for name in objective.LAYER_METHODS:
        weights.update(method_class(name).active_weights(getattr(objective, name)))
    return weights


class LayerDistillation(nn.Module):
    """The layer-level terms of the objective; ``weights`` names each active term and its weight.

    ``methods`` holds the enabled methods by name, in ``LAYER_METHODS`` order, which is also the
    order their parameters are created and their terms are summed in.
    """

    def __init__(self, objective: ObjectiveConfig, teacher_config: Any, student_config: Any) -> None:
        super().__init__()
        self.methods = nn.ModuleDict()
        for name in objective.LAYER_METHODS:
            cls, config = method_class(name), getattr(objective, name)
            if cls.active_weights(config):  # a disabled method checks nothing and costs nothing
                self.methods[name] = cls(config, teacher_config, student_config)
        self.weights = layer_term_weights(objective)

    def capture_specs(self) -> tuple[CaptureSpec, CaptureSpec]:
        """(student, teacher) capture specs: the union of what the enabled methods read."""
        specs = [method.capture_specs() for method in self.methods.values()]
        return tuple(
            CaptureSpec(
                embeddings=any(pair[side].embeddings for pair in specs),
                hidden=tuple(sorted({i for pair in specs for i in pair[side].hidden})),
                qkv=tuple(sorted({i for pair in specs for i in pair[side].qkv})),
            )
            for side in (0, 1)
        )

    def layer_maps(self) -> dict[str, Any]:
        """The resolved (student layer, teacher layer) pairs per method, as ``plan`` reports them."""
        maps = {name: method.layer_map() for name, method in self.methods.items()}
        return {name: layer_map for name, layer_map in maps.items() if layer_map is not None}

    def forward(self, student: Captured, teacher: Captured, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The unweighted active terms (float32 scalars); the caller weights them with ``self.weights``."""
        terms: dict[str, torch.Tensor] = {}
        for method in self.methods.values():
            terms.update(method(student, teacher, mask))
        return terms
