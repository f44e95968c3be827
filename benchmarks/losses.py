"""The output-level losses of one micro-batch, eager and compiled, timed side by side.

    python benchmarks/losses.py [--batch 32] [--seq-len 512] [--vocab 30522] [--hidden 768]
        [--dtype bf16|fp32] [--device auto|cpu|cuda] [--steps 20] [--warmup 3] [--json]

What ``compile=true`` adds to compiling the models (``Distiller.compile_models``): DistilBERT's
5·L_ce (T=2) + 2·L_mlm + 1·L_cos, forward and backward, through the project's own loss functions
(``trainer.objective.distiller.OUTPUT_LOSSES``, the default ``ObjectiveConfig`` weights), on the
shapes a step gives them: student and teacher logits ``[batch, budget, vocab]`` at the masked
budget ``ceil(0.15 x seq)``, last hidden states ``[batch, seq, hidden]``, in the training dtype.

Eager, each loss upcasts its inputs to float32 and makes a pass over memory per operation
(temperature, log-softmax, KL, sums); compiled, those fuse. The script reports both times per
iteration, their ratio, the two losses' difference and the largest gradient difference (so the
compiled twin is checked to compute the same thing), and on CUDA each variant's peak memory.
The times are of the losses alone: their share of a whole step is what the GPU campaign's bare
step with ``--compile`` shows (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.distill_step import synchronize
from trainer.config import MaskingConfig, ObjectiveConfig
from trainer.objective.distiller import OUTPUT_LOSSES
from trainer.objective.masking import max_masked

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def make_inputs(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    """Random tensors of a step's shapes; about 90% of the budget's slots hold a masked token, as in packed text."""
    generator = torch.Generator().manual_seed(0)
    budget = max_masked(MaskingConfig().probability, args.seq_len)
    dtype = DTYPES[args.dtype]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device, dtype)

    return {
        "student_logits": randn(args.batch, budget, args.vocab),
        "teacher_logits": randn(args.batch, budget, args.vocab),
        "targets": torch.randint(0, args.vocab, (args.batch, budget), generator=generator).to(device),
        "valid": (torch.rand(args.batch, budget, generator=generator) < 0.9).to(device),
        "student_hidden": randn(args.batch, args.seq_len, args.hidden),
        "teacher_hidden": randn(args.batch, args.seq_len, args.hidden),
        "real": torch.ones(args.batch, args.seq_len, dtype=torch.bool, device=device),
    }


def weighted_loss(losses: dict[str, Any], x: dict[str, torch.Tensor], student: dict[str, torch.Tensor]) -> torch.Tensor:
    """The Distiller's sum of weighted output terms (default weights), the student's tensors given apart."""
    objective = ObjectiveConfig()
    logits, hidden = student["logits"], student["hidden"]
    ce = losses["ce"](logits, x["teacher_logits"], objective.temperature, x["valid"])
    mlm = losses["mlm"](logits, x["targets"], x["valid"])
    cos = losses["cos"](hidden, x["teacher_hidden"], x["real"])
    return objective.ce * ce + objective.mlm * mlm + objective.cos * cos


def time_variant(losses: dict[str, Any], x: dict[str, torch.Tensor], args: argparse.Namespace) -> dict[str, Any]:
    """Mean seconds per forward + backward over ``args.steps`` iterations after ``args.warmup``."""
    device = x["student_logits"].device
    student = {
        "logits": x["student_logits"].clone().requires_grad_(),
        "hidden": x["student_hidden"].clone().requires_grad_(),
    }
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            synchronize(device)
            start = time.perf_counter()
        for tensor in student.values():
            tensor.grad = None
        loss = weighted_loss(losses, x, student)
        loss.backward()
    synchronize(device)
    return {
        "seconds": (time.perf_counter() - start) / args.steps,
        "loss": loss.item(),
        "grads": {name: tensor.grad.float() for name, tensor in student.items()},
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)  # main resolved "auto"
    x = make_inputs(args, device)
    eager = time_variant(dict(OUTPUT_LOSSES), x, args)
    compiled = time_variant({name: torch.compile(fn) for name, fn in OUTPUT_LOSSES.items()}, x, args)
    grad_diff = max((eager["grads"][n] - compiled["grads"][n]).abs().max().item() for n in eager["grads"])
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shapes": {
            "logits": list(x["student_logits"].shape),
            "hidden": list(x["student_hidden"].shape),
            "dtype": args.dtype,
        },
        "eager_ms": eager["seconds"] * 1e3,
        "compiled_ms": compiled["seconds"] * 1e3,
        "eager_over_compiled": eager["seconds"] / compiled["seconds"],
        "loss_difference": abs(eager["loss"] - compiled["loss"]),
        "max_grad_difference": grad_diff,
        "eager_peak_gib": eager["peak_gib"],
        "compiled_peak_gib": compiled["peak_gib"],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    result = benchmark(args)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['device']}, logits {result['shapes']['logits']} hidden {result['shapes']['hidden']} "
            f"{args.dtype}: eager {result['eager_ms']:.2f} ms, compiled {result['compiled_ms']:.2f} ms per "
            f"forward + backward ({result['eager_over_compiled']:.2f}x); |loss difference| "
            f"{result['loss_difference']:.2e}, max |gradient difference| {result['max_grad_difference']:.2e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
