"""Capture, during one forward pass, the intermediate tensors the layer losses need.

Forward hooks record the outputs of the modules that already compute what a loss needs and
nothing else: the embedding output, the output of chosen encoder layers, and the query, key and
value projections of chosen self-attention blocks. The attention itself is never replaced, so
every layer, mapped or not, keeps the model's fast attention (SDPA / flash): score matrices are
recomputed from the captured Q and K by the losses, for the mapped layers only (TinyBERT's
scores are ``Q Kᵀ/√d`` before the softmax, MiniLM's relations are built from Q, K and V), which
is the same work an eager attention would do for those layers and none for the others.

Works for any Hugging Face BERT-style encoder (BERT, RoBERTa, and heads on them, with or without
an MLM head): ``model.base_model`` with ``embeddings`` and ``encoder.layer[i].attention.self``
holding ``query``/``key``/``value`` linears. Hooks exist only inside the ``with`` block, so an
exported or saved model carries no trace of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class CaptureSpec:
    """What to record: layer indices are 0-based encoder layers."""

    embeddings: bool = False
    hidden: tuple[int, ...] = ()  # outputs of these layers
    qkv: tuple[int, ...] = ()  # query/key/value projections of these layers' self-attention

    def __bool__(self) -> bool:
        return self.embeddings or bool(self.hidden) or bool(self.qkv)


@dataclasses.dataclass
class Captured:
    """The recorded tensors; projections are ``[batch, seq, heads * head_dim]`` as the linears return them."""

    embeddings: torch.Tensor | None = None
    hidden: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    query: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    key: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    value: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)


def encoder_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """The embeddings module and the list of transformer layers of a BERT-style model."""
    base = getattr(model, "base_model", model)
    embeddings = getattr(base, "embeddings", None)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if embeddings is None or not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__}: layer distillation needs a BERT-style encoder "
            "(base_model.embeddings and base_model.encoder.layer)"
        )
    return embeddings, layers


@contextmanager
def capture(model: nn.Module, spec: CaptureSpec) -> Iterator[Captured]:
    """Record ``spec``'s tensors during the forward passes run inside the block."""
    embeddings, layers = encoder_parts(model)
    for index in (*spec.hidden, *spec.qkv):
        if not 0 <= index < len(layers):
            raise IndexError(f"layer {index} does not exist: {type(model).__name__} has {len(layers)} layers")
    captured = Captured()
    handles = []

    def on_output(module: nn.Module, field: str, index: int | None = None) -> None:
        """Record ``module``'s output as ``captured.<field>`` (or ``captured.<field>[index]``)."""

        # Plain assignments, not functools.partial of setattr or dict.__setitem__: torch 2.11's Dynamo cannot
        # trace a partial of those builtins and broke the compiled encoder's graph at every hook.
        def hook(module: nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
            tensor = output[0] if isinstance(output, tuple) else output
            if index is None:
                setattr(captured, field, tensor)
            else:
                getattr(captured, field)[index] = tensor

        handles.append(module.register_forward_hook(hook))

    try:
        if spec.embeddings:
            on_output(embeddings, "embeddings")
        for index in spec.hidden:
            on_output(layers[index], "hidden", index)
        for index in spec.qkv:
            attention = layers[index].attention.self
            for name in ("query", "key", "value"):
                on_output(getattr(attention, name), name, index)
        yield captured
    finally:
        for handle in handles:
            handle.remove()
