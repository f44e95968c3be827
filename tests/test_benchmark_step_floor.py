"""benchmarks/step_floor.py: the FLOPs and bytes of every op of a step, and the floor they put under it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.step_floor import (
    OpCost,
    StepTraffic,
    count_step,
    floor_markdown,
    floor_report,
    measured_matmul_peak,
    measured_profile,
    optimizer_costs,
)
from common.config import load_config
from trainer.config import TrainConfig
from trainer.modeling import base_config, load_teacher_config, student_config
from trainer.objective.masking import max_masked
from trainer.planning.plan import step_flops_per_token

REPO = Path(__file__).resolve().parents[1]
BF16 = 2  # bytes


class MatmulLayouts(torch.utils._python_dispatch.TorchDispatchMode):
    """Records each matmul's size and whether its second operand is a transposed view."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, bool]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.mm.default:
            self.calls.append((args[0].shape[0], not args[1].is_contiguous()))
        return func(*args, **(kwargs or {}))


def test_the_matmul_ceiling_tries_both_layouts_and_stops_growing_at_a_slow_call() -> None:
    # A slow call (any, at seconds=0) ends its layout's growth after its warm-up and one timed call: the cost
    # stays bounded where a CPU runs one layout's bf16 matmuls at 0.3 GFLOP/s (docs/log/benchmarks.md, "CPU ceilings").
    with MatmulLayouts() as layouts:
        rate = measured_matmul_peak(torch.device("cpu"), torch.float32, sizes=(64, 128), seconds=0.0)
    assert rate > 0 and layouts.calls == [(64, True), (64, True), (64, False), (64, False)]  # warm-up, timed
    # Within the time, every size in both layouts, each repeated: Linear's forward layout (x @ W.T) first.
    with MatmulLayouts() as layouts:
        measured_matmul_peak(torch.device("cpu"), torch.float32, sizes=(8, 16), seconds=60.0)
    for transposed in (True, False):
        sizes = [size for size, t in layouts.calls if t is transposed]
        assert sizes.count(8) > 1 and sizes.count(16) > 1 and sizes.index(16) > sizes.index(8)


def test_each_op_is_charged_what_it_reads_and_writes_and_a_matmul_its_flops() -> None:
    x, w, b = (torch.randn(*shape, dtype=torch.bfloat16) for shape in ((64, 32), (16, 32), (16,)))
    with StepTraffic() as traffic:
        y = torch.nn.functional.linear(x, w, b)  # addmm(b, x, wᵀ): wᵀ is a view, read as w
        y.view(16, 64)  # a view moves nothing
        torch.empty_like(y).copy_(y)  # copy_ writes its destination, reads only its source
        x + b.repeat(2)[None, :].expand(64, 32)  # a broadcast operand is read once: 32 elements, not 64 x 32
    assert [op.name for op in traffic.ops] == ["aten::addmm", "aten::copy_", "aten::repeat", "aten::add"]
    addmm, copy, _, add = traffic.ops
    assert addmm.flops == 2 * 64 * 16 * 32 and addmm.category == "matmul"
    assert addmm.bytes == (16 + 64 * 32 + 16 * 32 + 64 * 16) * BF16
    assert copy.bytes == 2 * 64 * 16 * BF16 and copy.flops == 0 and copy.category == "copies and casts"
    assert add.bytes == (64 * 32 + 32 + 64 * 32) * BF16 and add.category == "other"


def test_the_optimizer_is_a_cast_the_fused_update_and_the_copy_back() -> None:
    costs = optimizer_costs(1000, weight_bytes=2)
    assert [(c.name, c.bytes) for c in costs] == [
        ("aten::_to_copy", 6000),  # the 16-bit gradient read, its float32 copy written
        ("aten::_fused_adamw_", 28000),  # gradient, master, two moments read; master and moments written
        ("aten::_foreach_copy_", 6000),  # the master read, the 16-bit weight written
    ]
    assert [c.name for c in optimizer_costs(1000, weight_bytes=4)] == ["aten::_fused_adamw_"]


def test_the_counted_step_does_the_model_flops_plan_counts_with_dropout_and_attention_as_on_a_gpu() -> None:
    """DistilBERT's step at bert-base size, counted on the meta device in seconds: its matmuls and attention are
    exactly ``plan``'s model FLOPs (the figure MFU is computed from), and its dropout and attention are the
    GPU's single kernels, not the CPU's decompositions. With the preset's padded decoder
    (``objective.vocab_multiple: 64``) the count is the kernels' work: the model's FLOPs and the padding rows'."""
    overrides = ["teacher=configs/teachers/bert-base-uncased", "micro_batch_size=2", "data=unused"]
    preset = REPO / "configs" / "distilbert-base.yaml"
    cfg = load_config(TrainConfig, preset, [*overrides, "objective.vocab_multiple=1"])
    cfg.masking.frequency_smoothing = None  # no dataset to read token counts from; the ops are the same
    ops = count_step(cfg, seq_len=64)
    teacher = load_teacher_config(cfg.teacher)
    student = student_config(cfg.student, base_config(cfg.student, teacher))
    model = step_flops_per_token(cfg.objective, teacher, student, cfg.masking.probability, 64)["total"] * 2 * 64
    assert sum(op.flops for op in ops) == pytest.approx(model, rel=1e-12)
    padded = load_config(TrainConfig, preset, overrides)
    padded.masking.frequency_smoothing = None
    assert padded.objective.vocab_multiple == 64
    # 6 rows more (30,528 for 30,522) in the decoder's 4 matmuls (teacher forward, student forward, dX, dW)
    # at the micro-batch's masked positions
    extra = 4 * 2 * (2 * max_masked(cfg.masking.probability, 64)) * teacher.hidden_size * 6
    assert sum(op.flops for op in count_step(padded, seq_len=64)) - model == pytest.approx(extra, rel=1e-9)
    names = [op.name for op in ops]
    # 12 teacher layers and 6 student layers forward, the student's 6 backward
    assert names.count("aten::_scaled_dot_product_flash_attention") == 18
    assert names.count("aten::_scaled_dot_product_flash_attention_backward") == 6
    assert "aten::native_dropout" in names and "aten::bernoulli_" not in names
    assert names.count("aten::addmm") == 112  # as the H200's profile counted them in the same step
    assert all(op.bytes >= 0 for op in ops) and names[-1] == "aten::_foreach_copy_"


def test_the_floor_sets_each_category_beside_its_measured_time(tmp_path: Path) -> None:
    ops = [
        OpCost("aten::mm", "matmul", int(2e12), int(1e9)),  # 2 ms of FLOPs at 1 PFLOP/s, 0.5 ms of bytes
        OpCost("aten::add", "other", 0, int(4e9)),  # 2 ms of bytes at 2 TB/s
        OpCost("aten::add", "other", 0, int(2e9)),
    ]
    report = floor_report(ops, 1e15, 2e12, model_flops=2e12, peak_flops=1e15, measured={"matmul": 4.0, "other": 6.0})
    matmul, other = report["categories"]["matmul"], report["categories"]["other"]
    assert matmul["floor_ms"] == pytest.approx(2.0) and not matmul["memory_bound"]
    assert other["floor_ms"] == pytest.approx(3.0) and other["memory_bound"] and other["ops"] == 2
    assert matmul["measured_over_floor"] == pytest.approx(2.0) and other["measured_over_floor"] == pytest.approx(2.0)
    assert other["achieved_tbs"] == pytest.approx(1.0)  # 6 GB in 6 ms
    assert report["floor_ms"] == pytest.approx(5.0) and report["mfu_at_floor"] == pytest.approx(0.4)
    assert report["mfu_of_measured_kernels"] == pytest.approx(0.2)
    assert report["top_ops"][0] == {"op": "aten::add", "category": "other", "calls": 2, "gb": 6.0, "floor_ms": 3.0}
    table = floor_markdown(report)
    assert "| other | 2 | 0.0 | 6.00 | 3.00 | 6.00 | 2.0x | 1.00 |" in table
    assert "| matmul | 1 | 2,000.0 | 1.00 | 2.00 | 4.00 | 2.0x | - |" in table
    assert "at 1,000 TFLOP/s and 2 TB/s" in table and "would reach 40.0% MFU of 1,000 TFLOP/s" in table
    assert "20.0% (2.00x the floor)" in table

    # The profile a campaign returned: its eager project step's categories, not the naive or compiled step's.
    profile = {"categories_ms_per_step": {"matmul": 12.3}}
    steps = [{"step": "naive"}, {"step": "project", "compiled": True, "profile": {"x": 1}}]
    steps += [{"step": "project", "compiled": False, "profile": profile}]
    (tmp_path / "throughput.json").write_text(json.dumps({"steps": steps}))
    assert measured_profile(tmp_path / "throughput.json") == {"matmul": 12.3}
