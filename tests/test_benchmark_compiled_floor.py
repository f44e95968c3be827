"""benchmarks/compiled_floor.py: the kernels torch.compile makes for a step, by Inductor's own count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.compiled_floor import (
    attention,
    compiled_report,
    count_batch,
    opaque_attention,
)
from benchmarks.step_floor import count_step, floor_markdown, model_flops
from common.config import load_config
from trainer.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
SEQ = 64


def test_the_attention_stand_in_is_attention_one_op_each_way() -> None:
    """The opaque op a CPU count compiles in SDPA's place computes what SDPA does, forward and backward."""
    q, k, v = (torch.randn(2, 3, 16, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 3, 16, 8, dtype=torch.float64)
    with opaque_attention():
        ours = F.scaled_dot_product_attention(q, k, v)  # as Hugging Face calls it
    ours.backward(grad)
    our_grads = [t.grad for t in (q, k, v)]
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    reference = F.scaled_dot_product_attention(q, k, v)
    reference.backward(grad)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)  # the stand-in works in float32
    for mine, theirs in zip(our_grads, (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    assert F.scaled_dot_product_attention is not attention  # restored on leaving
    with pytest.raises(Exception, match="packed batches"), opaque_attention():
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool))


@pytest.fixture(scope="module")
def tiny_distilbert(tmp_path_factory: pytest.TempPathFactory) -> TrainConfig:
    """DistilBERT's recipe from a 4-layer, 64-wide BERT teacher (config only: random weights)."""
    from transformers import BertConfig

    teacher = tmp_path_factory.mktemp("teacher")
    BertConfig(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        architectures=["BertForMaskedLM"],
    ).save_pretrained(teacher)
    # the decoder as the model has it: the counted FLOPs are then exactly the model's (the padded decoder's extra
    # rows are checked in tests/test_benchmark_step_floor.py)
    overrides = [f"teacher={teacher}", "student.teacher_layers=null", "data=unused", "objective.vocab_multiple=1"]
    cfg = load_config(TrainConfig, REPO / "configs" / "distilbert-base.yaml", overrides)
    cfg.masking.frequency_smoothing = None  # no dataset to read token counts from; the kernels are the same
    return cfg


@pytest.mark.full
def test_the_compiled_step_moves_fewer_bytes_than_the_eager_one(tiny_distilbert: TrainConfig) -> None:
    """A real compile on this CPU (about 55 s of CPU; neither fewer layers, whose kernels are the same source
    compiled once, nor C++ at -O0 makes it cheaper): the kernels Inductor made, their FLOPs exactly the model
    FLOPs ``plan`` counts, their bytes well under the eager step's."""
    six = count_batch(tiny_distilbert, SEQ, 6, torch.device("cpu"))
    categories = {op.category for op in six}
    assert {"matmul", "attention", "norms and activations", "softmax and losses"} <= categories
    names = [op.name for op in six]
    assert any(name.startswith("fused_") and "native_layer_norm" in name for name in names)
    # 4 teacher and 2 student layers forward, the student's 2 backward: one opaque call each, no score matrices
    assert names.count("torch.ops.compiled_floor.attention.default") == 6
    assert names.count("torch.ops.compiled_floor.attention_backward.default") == 2
    assert sum(op.flops for op in six) == pytest.approx(model_flops(tiny_distilbert, SEQ, 6), rel=1e-12)

    tiny_distilbert.micro_batch_size = 6
    eager = count_step(tiny_distilbert, SEQ)
    assert [op.name for op in eager[-3:]] == ["aten::_to_copy", "aten::_fused_adamw_", "aten::_foreach_copy_"]
    eager_bytes = sum(op.bytes for op in eager[:-3])  # the forward and backward, without the optimizer
    assert sum(op.bytes for op in six) < 0.8 * eager_bytes  # what fusing the memory-bound ops is for

    report = compiled_report(
        six,
        trainable=1000,
        model_flops=model_flops(tiny_distilbert, SEQ, 6),
        matmul_flops=1e14,
        bandwidth=1e12,
        peak_flops=1e15,
    )
    report["measured_step_ms"] = 2 * report["floor_ms"]
    assert report["step"] == "compiled" and report["categories"]["optimizer"]["gb"] == pytest.approx(34000 / 1e9)
    table = floor_markdown(report)
    assert "the compiled step at its floor would reach" in table and "2.00x the floor" in table
    assert "eager ops between the compiled pieces" in table
    json.dumps(report)  # what distill_step.py --json and the GPU campaign write
