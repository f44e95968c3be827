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
step with ``--compile`` shows (docs/log/benchmarks.md).

Then the matmul that makes those logits, the MLM decoder's ``hidden @ Wᵀ + b`` at the same positions, as a
step runs it (the teacher's forward, the student's forward and backward), three ways: the vocabulary as
it is (BERT's 30,522), padded at each call to a multiple of 64 rows and the padding's logits sliced off
(``trainer.modeling.padded_linear``, what ``objective.vocab_multiple=64`` runs: the same values), and a
vocabulary that is a multiple of 64 already (the bound: no padding copies). Why: a bf16 row of 30,522
logits is 61,044 bytes, not a multiple of 16, and the H200's profile of the bare step ran a
2-element-aligned sm80 CUTLASS kernel (``..._align2``, 1.05 ms of a 29.8 ms step at 32 x 512) beside the
sm90 kernels of every other matmul. The report gives each variant's time and the padded one's largest
differences from the plain one: on one H200, 1.97x as they are, so the GPU presets set
``objective.vocab_multiple: 64`` (docs/log/benchmarks.md, "Measured a third time").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sdpa_backends import timed_ms
from trainer.config import MaskingConfig, ObjectiveConfig
from trainer.modeling import padded_linear
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
    last: dict[str, torch.Tensor] = {}

    def step() -> None:
        for tensor in student.values():
            tensor.grad = None
        last["loss"] = weighted_loss(losses, x, student)
        last["loss"].backward()

    ms = timed_ms(step, str(device), args.warmup, args.steps)
    return {
        "seconds": ms / 1e3,
        "loss": last["loss"].item(),
        "grads": {name: tensor.grad.float() for name, tensor in student.items()},
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }


VOCAB_MULTIPLE = 64  # what the padded decoder rounds its rows up to (16-byte rows need 8; tiles like 64)


def time_decoder(x: dict[str, torch.Tensor], multiple: int | None, args: argparse.Namespace) -> dict[str, Any]:
    """Mean seconds of a step's decoder matmuls (the teacher's forward, the student's forward and backward)
    over ``args.steps`` after ``args.warmup``; ``multiple``: pad the vocabulary to it per call (None: as is).
    Returns the student's logits and gradients too, for the comparison."""
    student = {name: x[name].clone().requires_grad_() for name in ("hidden", "weight", "bias")}
    last: dict[str, Any] = {}

    def logits_of(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, weight, bias) if multiple is None else padded_linear(hidden, weight, bias, multiple)

    def step() -> None:
        with torch.no_grad():
            logits_of(x["teacher_hidden"], x["teacher_weight"], x["bias"])
        last["logits"] = logits_of(student["hidden"], student["weight"], student["bias"])
        last["grads"] = torch.autograd.grad(last["logits"], list(student.values()), x["grad_logits"])

    ms = timed_ms(step, x["weight"].device.type, warmup=args.warmup, repeat=args.steps)
    return {
        "seconds": ms / 1e3,
        "logits": last["logits"].detach().float(),
        "grads": [g.float() for g in last["grads"]],
    }


def decoder_benchmark(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The decoder's matmuls at a step's masked positions: the vocabulary as is, padded per call, and native."""
    generator = torch.Generator().manual_seed(1)
    positions = args.batch * max_masked(MaskingConfig().probability, args.seq_len)
    dtype = DTYPES[args.dtype]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device, dtype)

    def of_vocab(vocab: int) -> dict[str, torch.Tensor]:
        return {
            "hidden": randn(positions, args.hidden),
            "teacher_hidden": randn(positions, args.hidden),
            "weight": randn(vocab, args.hidden) * 0.02,
            "teacher_weight": randn(vocab, args.hidden) * 0.02,
            "bias": randn(vocab) * 0.02,
            "grad_logits": randn(positions, vocab),
        }

    padded_vocab = args.vocab + -args.vocab % VOCAB_MULTIPLE
    x = of_vocab(args.vocab)
    as_is = time_decoder(x, None, args)
    padded = time_decoder(x, VOCAB_MULTIPLE, args)
    native = time_decoder(of_vocab(padded_vocab), None, args)
    flops = 4 * 2 * positions * args.hidden * args.vocab  # teacher forward, student forward, dX, dW

    def tflops(seconds: float) -> float:
        return flops / seconds / 1e12

    return {
        "positions": positions,
        "vocab": args.vocab,
        "padded_vocab": padded_vocab,
        "as_is_ms": as_is["seconds"] * 1e3,
        "padded_ms": padded["seconds"] * 1e3,
        "native_ms": native["seconds"] * 1e3,
        "as_is_over_padded": as_is["seconds"] / padded["seconds"],
        "as_is_tflops": tflops(as_is["seconds"]),
        "padded_tflops": tflops(padded["seconds"]),
        "max_logit_difference": (as_is["logits"] - padded["logits"]).abs().max().item(),
        "max_grad_difference": max(
            (a - b).abs().max().item() for a, b in zip(as_is["grads"], padded["grads"], strict=True)
        ),
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
        "decoder": decoder_benchmark(args, device),
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
        decoder = result["decoder"]
        print(
            f"decoder matmuls at {decoder['positions']} positions: vocabulary {decoder['vocab']} as is "
            f"{decoder['as_is_ms']:.2f} ms, padded to {decoder['padded_vocab']} per call {decoder['padded_ms']:.2f} ms "
            f"({decoder['as_is_over_padded']:.2f}x), native {decoder['padded_vocab']} {decoder['native_ms']:.2f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
