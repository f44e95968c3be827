"""benchmarks/distill_step.py's optimizer step, which every bare-step figure of the GPU campaign goes through."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.distill_step import MasterWeights
from trainer.config import TrainConfig


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
