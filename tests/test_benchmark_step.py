"""benchmarks/distill_step.py: its optimizer step, which every bare-step figure of the GPU campaign goes through, and
its eager step's diagnostics at a tiny size on the CPU."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import distill_step
from benchmarks.distill_step import MasterWeights
from trainer.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]


def test_16_bit_step_updates_what_got_a_gradient_and_leaves_the_rest() -> None:
    """Under layer losses alone (TinyBERT's, MiniLM's presets) no loss reaches the student's MLM head, so its
    parameters have no gradient; the step used to stop there (``None.float()``)."""
    used, unused = torch.nn.Linear(4, 4).bfloat16(), torch.nn.Linear(4, 4).bfloat16()
    before = [p.detach().clone() for p in unused.parameters()]
    params = [*used.parameters(), *unused.parameters()]
    step = MasterWeights(params, TrainConfig(teacher=None, data="unused", output_dir="unused"), fused=False)
    weight = used.weight.detach().clone()
    used(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    step.step()
    assert not torch.equal(used.weight, weight)
    assert all(torch.equal(p, b) for p, b in zip(unused.parameters(), before, strict=True))
    assert all(p.grad is None for p in params)


def test_a_cpu_step_reports_its_windows_and_ops(tiny_teacher_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The project's eager step, as the `next` item fair-steps runs it, at a tiny size on the CPU: its figures timed
    in windows and its op census (the profile's summary is tests/test_benchmark_profile.py's)."""
    argv = [str(REPO / "configs" / "distilbert-base.yaml"), f"teacher={tiny_teacher_dir}", "data=unused"]
    argv += ["student.teacher_layers=null", "micro_batch_size=2", "masking.frequency_smoothing=null"]
    argv += ["output_dir=unused", "--seq-len=32", "--steps=3", "--warmup=1", "--window=2"]
    argv += ["--device=cpu", "--peak-tflops=1", "--json"]  # no ceilings measured
    assert distill_step.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == "project" and result["tokens_per_s"] > 0 and math.isfinite(result["final_loss"])
    # timed in windows of 2 steps (the `next` item fair-steps' median and range): 2 + 1 steps, their rates
    # adding up to the whole run's (each window's seconds are its tokens over its rate)
    windows = result["window_tokens_per_s"]
    tokens = [2 * 2 * 32, 1 * 2 * 32]
    assert len(windows) == 2 and sum(t / w for t, w in zip(tokens, windows, strict=True)) == pytest.approx(
        sum(tokens) / result["tokens_per_s"]
    )
    assert result["ops_per_step"] > 100 and result["grad_clip"] == 5.0
