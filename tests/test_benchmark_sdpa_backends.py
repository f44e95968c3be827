"""benchmarks/sdpa_backends.py: which attention kernels run for each preset's shapes, and how fast each is."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import BertConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gpu.train_throughput import sdpa_markdown
from benchmarks.sdpa_backends import attention_flops, probe, timed_ms
from trainer.planning.plan import encoder_flops_per_token


def test_the_rate_is_of_the_attention_flops_plan_counts() -> None:
    """attention_flops is the attention share of plan's per-token count (Q Kᵀ and A V), over a whole batch."""
    batch, heads, seq, head_size = 3, 4, 96, 16

    def per_token(seq_len: int) -> int:
        config = BertConfig(hidden_size=heads * head_size, num_hidden_layers=1, intermediate_size=32)
        return encoder_flops_per_token(config, seq_len)

    attention_per_token = per_token(seq) - per_token(0)  # plan's count less its projections and FFN
    assert attention_flops(batch, heads, seq, head_size) == batch * seq * attention_per_token


def test_timing_warms_up_then_averages_the_repeated_calls() -> None:
    calls = []
    ms = timed_ms(lambda: calls.append(1), "cpu", warmup=2, repeat=5)
    assert len(calls) == 7 and ms >= 0


def test_the_probe_times_each_kernel_that_runs_and_names_why_the_others_do_not() -> None:
    """On a CPU without dropout: flash and math run and are timed, with PyTorch's own choice (auto); the
    GPU-only kernels are refused, with the refusal's first line; the table shows the rates."""
    torch.manual_seed(0)
    row = probe(heads=2, head_size=16, dropout=0.0, batch=2, seq_len=32, device="cpu", repeat=2)
    assert row["flash"] == row["math"] == "runs"
    assert row["cudnn"] != "runs" and row["efficient"] != "runs" and row["cudnn"]  # the reason, not a blank
    assert set(row["timings"]) == {"flash", "math", "auto"}
    flops = attention_flops(2, 2, 32, 16)
    for rates in row["timings"].values():
        assert rates["forward_ms"] > 0 and rates["train_ms"] > 0
        # forward and backward: three times the forward's FLOPs (plan's convention), over the measured time
        assert rates["train_tflops"] == pytest.approx(3 * flops / rates["train_ms"] / 1e9, rel=0.01, abs=0.01)
    assert "flash_attention" in row["chosen"]  # what the CPU picks without dropout

    report = {"batch": 2, "seq_len": 32, "shapes": [{"encoders": ["a student"], **row}]}
    table = "\n".join(sdpa_markdown(report))
    rates = row["timings"]["math"]
    assert "Their rates, TFLOP/s" in table
    assert f"| a student | 2 x 16 | 0.0 | {row['timings']['flash']['forward_tflops']:.1f} / " in table
    assert f"| - | - | {rates['forward_tflops']:.1f} / {rates['train_tflops']:.1f} |" in table
