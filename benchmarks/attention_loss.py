"""TinyBERT's attention loss two ways, timed side by side: from the score matrices, and as the trainer computes it.

    python benchmarks/attention_loss.py [--batch 64] [--seq-len 512] [--heads 12] [--student-width 312]
        [--teacher-width 768] [--pairs 4] [--device auto|cpu|cuda] [--steps 5] [--warmup 1] [--json]

The loss is the MSE of the student's and the teacher's pre-softmax attention scores, head by head, over real
(query, key) pairs, summed over the mapped layer pairs (``tinybert-4l-312``: 4 pairs, 12 heads, 312 -> 768).
:func:`score_matrix_mse` writes it as its definition does (and TinyBERT's reference code computes it): both
``[batch, heads, seq, seq]`` score matrices in float32, their squared difference. The trainer's
``trainer.objective.layer_methods.tinybert.attention_score_mse`` computes the same sum from ``d x d`` Gram
matrices and never makes a ``seq x seq`` tensor. Each variant runs forward and backward from 16-bit q and k
(the training dtype's captures); the script reports the time per iteration of each, their ratio, the losses'
relative difference and the largest relative gradient difference, the bytes each moves
(``benchmarks/step_floor.py``'s count) and, on CUDA, each one's peak memory.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.step_floor import StepTraffic
from common.cli import run_cli
from trainer.objective.layer_methods.base import split_heads
from trainer.objective.layer_methods.tinybert import attention_score_mse
from trainer.runtime.profiling import synchronize


def score_matrix_mse(
    student_query: torch.Tensor,
    student_key: torch.Tensor,
    teacher_query: torch.Tensor,
    teacher_key: torch.Tensor,
    num_heads: int,
    mask: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The attention loss as its definition writes it: both score matrices, their squared difference averaged
    over real (query, key) pairs and heads. ``dtype`` float64 makes it the precise reference the tests use."""

    def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        q, k = split_heads(q.to(dtype), num_heads), split_heads(k.to(dtype), num_heads)
        return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])

    real = mask.to(dtype)
    pairs = (real.unsqueeze(-1) * real.unsqueeze(-2)).unsqueeze(1)
    squared = (scores(student_query, student_key) - scores(teacher_query, teacher_key)).square() * pairs
    return squared.sum() / (pairs.sum() * num_heads)


SHAPES = ("batch", "seq_len", "heads", "student_width", "teacher_width", "pairs")
VARIANTS = {"score matrices": score_matrix_mse, "gram (trainer)": attention_score_mse}


def time_variant(loss_fn: Any, inputs: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    student = [[t.clone().requires_grad_() for t in pair] for pair in inputs["student"]]

    def step() -> torch.Tensor:
        loss = sum(
            loss_fn(sq, sk, tq, tk, args.heads, inputs["mask"])
            for (sq, sk), (tq, tk) in zip(student, inputs["teacher"], strict=True)
        )
        loss.backward()
        return loss.detach()

    for _ in range(args.warmup):
        step()
    device = inputs["mask"].device
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    synchronize(device)
    seconds = (time.perf_counter() - start) / args.steps
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    for pair in student:
        for t in pair:
            t.grad = None
    with StepTraffic() as traffic:
        step()
    return {
        "ms": seconds * 1e3,
        "loss": loss.item(),
        "gradients": [t.grad.float() for pair in student for t in pair],
        "gb_moved": sum(op.bytes for op in traffic.ops) / 1e9,
        "peak_gib": peak,
    }


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    generator = torch.Generator(device=device).manual_seed(0)

    def captures(width: int) -> list[torch.Tensor]:  # a layer's q and k, as the 16-bit model captures them
        shape = (args.batch, args.seq_len, width)
        return [torch.randn(shape, generator=generator, device=device).to(torch.bfloat16) for _ in range(2)]

    inputs = {
        "student": [captures(args.student_width) for _ in range(args.pairs)],
        "teacher": [captures(args.teacher_width) for _ in range(args.pairs)],
        "mask": torch.ones(args.batch, args.seq_len, dtype=torch.long, device=device),
    }
    results = {name: time_variant(fn, inputs, args) for name, fn in VARIANTS.items()}
    reference, fast = results["score matrices"], results["gram (trainer)"]
    gradient_difference = max(
        ((g - r).norm() / r.norm()).item() for g, r in zip(fast["gradients"], reference["gradients"], strict=True)
    )
    for result in results.values():
        del result["gradients"]
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()})",
        "shapes": {
            k: getattr(args, k) for k in ("batch", "seq_len", "heads", "student_width", "teacher_width", "pairs")
        },
        "variants": results,
        "score_matrices_over_gram": reference["ms"] / fast["ms"],
        "relative_loss_difference": abs(fast["loss"] - reference["loss"]) / abs(reference["loss"]),
        "relative_gradient_difference": gradient_difference,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("batch", 64), ("seq-len", 512), ("heads", 12), ("student-width", 312)):
        parser.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("teacher-width", 768), ("pairs", 4), ("steps", 5), ("warmup", 1)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = benchmark(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name, r in result["variants"].items():
            peak = f", peak {r['peak_gib']:.2f} GiB" if r["peak_gib"] is not None else ""
            print(f"{name}: {r['ms']:.1f} ms forward + backward, {r['gb_moved']:.2f} GB moved{peak}")
        print(
            f"{result['device']}, {result['shapes']}: the score matrices take "
            f"{result['score_matrices_over_gram']:.2f}x the Gram form's time; loss differs by "
            f"{result['relative_loss_difference']:.1e}, gradients by {result['relative_gradient_difference']:.1e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
