"""One method, one module: each method builds alone, and a new one is a new file plus its config section."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import ClassVar

import pytest
import torch
from test_layer_losses import MASK, NARROW, TEACHER, captured, objective
from transformers import BertForMaskedLM

import trainer.objective.layer_methods as layer_methods
from common.config import load_config
from trainer.config import ObjectiveConfig
from trainer.objective.capture import CaptureSpec
from trainer.objective.distiller import Distiller
from trainer.objective.layer_distillation import LayerDistillation, layer_term_weights
from trainer.objective.layer_methods.base import LayerMethod
from trainer.objective.masking import MaskedBatch

# Each method built from its own config section alone: (overrides, map, student spec, teacher spec, parameters).
ALONE = {
    "tinybert": (
        ["tinybert.embedding=1", "tinybert.hidden=1", "tinybert.attention=1"],
        [[0, 1], [1, 3]],
        CaptureSpec(embeddings=True, hidden=(0, 1), qkv=(0, 1)),
        CaptureSpec(embeddings=True, hidden=(1, 3), qkv=(1, 3)),
        2 * (12 * 24 + 24),  # W_e and W_h
    ),
    "pkd": (["pkd.weight=1"], [[0, 1]], CaptureSpec(hidden=(0,)), CaptureSpec(hidden=(1,)), 12 * 24 + 24),
    "minilm": (["minilm.attention=1", "minilm.value=1"], [1, 3], CaptureSpec(qkv=(1,)), CaptureSpec(qkv=(3,)), 0),
}


def test_every_configured_method_has_a_module():
    assert tuple(ALONE) == ObjectiveConfig.LAYER_METHODS
    for name in ObjectiveConfig.LAYER_METHODS:
        module = importlib.import_module(f"trainer.objective.layer_methods.{name}")
        assert issubclass(module.Method, LayerMethod)
        assert dataclasses.is_dataclass(getattr(ObjectiveConfig(), name))


@pytest.mark.parametrize("name", list(ALONE))
def test_each_method_owns_its_map_capture_projections_and_loss(name):
    overrides, layer_map, student_spec, teacher_spec, params = ALONE[name]
    config = getattr(objective(*overrides), name)
    method = importlib.import_module(f"trainer.objective.layer_methods.{name}").Method(config, TEACHER, NARROW)
    assert method.layer_map() == layer_map
    assert method.capture_specs() == (student_spec, teacher_spec)
    assert sum(p.numel() for p in method.parameters()) == params
    s, t = captured(NARROW, range(2), seed=700), captured(TEACHER, range(4), seed=800)
    terms = method(s, t, MASK)
    assert list(terms) == list(method.weights) == list(method.term_weights(config))
    assert all(value.dtype == torch.float32 and value.ndim == 0 for value in terms.values())

    # LayerDistillation with only this method enabled is exactly that method.
    layers = LayerDistillation(objective(*overrides), TEACHER, NARROW)
    assert list(layers.methods) == [name] and layers.layer_maps() == {name: layer_map}
    assert layers.capture_specs() == (student_spec, teacher_spec)
    layers.methods[name].load_state_dict(method.state_dict())
    assert all(torch.equal(value, terms[term]) for term, value in layers(s, t, MASK).items())


def test_disabled_methods_are_not_built():
    layers = LayerDistillation(objective("minilm.value=1", "tinybert.teacher_layers=[0,1,2,3,4,5]"), TEACHER, NARROW)
    assert list(layers.methods) == ["minilm"]  # TinyBERT's impossible map is not even resolved
    assert LayerDistillation(objective(), TEACHER, NARROW).capture_specs() == (CaptureSpec(), CaptureSpec())


# A method that is not in the repository: its module, and its section in a config that extends ObjectiveConfig.
TOY_MODULE = '''
"""Toy: the squared difference of the mean of student layer 0 and the mean of one teacher layer."""

import torch

from trainer.objective.capture import CaptureSpec
from trainer.objective.layer_methods.base import LayerMethod


class Method(LayerMethod):
    @staticmethod
    def term_weights(config):
        return {"toy": config.weight}

    def __init__(self, config, teacher_config, student_config):
        super().__init__(config)
        self.pair = (0, config.teacher_layer)
        self.scale = torch.nn.Parameter(torch.ones(()))

    def capture_specs(self):
        return CaptureSpec(hidden=(0,)), CaptureSpec(embeddings=True, hidden=(self.pair[1],))

    def layer_map(self):
        return list(self.pair)

    def forward(self, student, teacher, mask):
        s, t = self.pair
        return {"toy": (self.scale * student.hidden[s].float().mean() - teacher.hidden[t].float().mean()).square()}
'''


@dataclasses.dataclass
class ToyConfig:
    weight: float = 0.0
    teacher_layer: int = 2


@dataclasses.dataclass
class ToyObjectiveConfig(ObjectiveConfig):
    LAYER_METHODS: ClassVar[tuple[str, ...]] = (*ObjectiveConfig.LAYER_METHODS, "toy")
    toy: ToyConfig = dataclasses.field(default_factory=ToyConfig)


@pytest.fixture
def toy_module(tmp_path, monkeypatch):
    """``toy.py`` written to a directory that is added to the methods package's search path."""
    (tmp_path / "toy.py").write_text(TOY_MODULE)
    monkeypatch.setattr(layer_methods, "__path__", [*layer_methods.__path__, str(tmp_path)])
    importlib.invalidate_caches()
    yield
    sys.modules.pop("trainer.objective.layer_methods.toy", None)
    vars(layer_methods).pop("toy", None)


def test_a_new_method_is_one_new_file_plus_its_config_section(toy_module):
    settings = ["ce=0", "mlm=0", "cos=0", "pkd.weight=1", "toy.weight=3"]
    config = load_config(ToyObjectiveConfig, None, settings)
    assert layer_term_weights(config) == {"pkd": 1.0, "toy": 3.0}
    layers = LayerDistillation(config, TEACHER, NARROW)
    assert list(layers.methods) == ["pkd", "toy"] and layers.weights == {"pkd": 1.0, "toy": 3.0}
    assert layers.layer_maps() == {"pkd": [[0, 1]], "toy": [0, 2]}
    # Merged: student layer 0 is read by both and captured once; the toy adds the teacher's embeddings.
    assert layers.capture_specs() == (CaptureSpec(hidden=(0,)), CaptureSpec(embeddings=True, hidden=(1, 2)))
    s, t = captured(NARROW, range(2), seed=900), captured(TEACHER, range(4), seed=1000)
    terms = layers(s, t, MASK)
    assert list(terms) == ["pkd", "toy"]
    assert torch.equal(terms["toy"], (s.hidden[0].mean() - t.hidden[2].mean()).square())
    assert "methods.toy.scale" in dict(layers.named_parameters())

    # Through the Distiller: the toy's term is captured from real models, weighted and summed into the loss.
    torch.manual_seed(0)
    teacher, student = BertForMaskedLM(TEACHER).eval(), BertForMaskedLM(NARROW)
    distiller = Distiller(student, teacher, load_config(ToyObjectiveConfig, None, [*settings, "mlm=1"]))
    ids = torch.randint(5, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    labels = torch.where(torch.arange(5) == 2, ids, -100)
    out = distiller(MaskedBatch.from_labels(ids, labels, budget=1), MASK)
    assert set(out) == {"loss", "mlm", "pkd", "toy"} and distiller.weights["toy"] == 3.0
    torch.testing.assert_close(out["loss"], out["mlm"] + out["pkd"] + 3.0 * out["toy"])
    out["loss"].backward()
    assert distiller.layer_distillation.methods["toy"].scale.grad is not None


def test_a_new_method_off_in_the_config_is_not_built(toy_module):
    layers = LayerDistillation(load_config(ToyObjectiveConfig, None, ["pkd.weight=1"]), TEACHER, NARROW)
    assert list(layers.methods) == ["pkd"] and "toy" not in layers.weights
