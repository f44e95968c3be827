"""Which attention kernel each preset's encoders get, and what it keeps: a probe for the GPU campaign.

    python benchmarks/sdpa_backends.py [--batch 64] [--seq-len 512] [--device auto|cpu|cuda] [--json]

Hugging Face's BERT calls ``F.scaled_dot_product_attention`` and PyTorch picks the kernel: flash, cuDNN,
memory-efficient or the math path, by the head size, the dtype, dropout and the GPU. ``plan`` counts the
activations as if every encoder took a fused kernel, which keeps no ``[seq, seq]`` matrix
(``trainer.planning.plan.flash_attention_saves``). Both GPU campaigns measured 16.8 GiB at the peak of
``tinybert-4l-312`` at 64 x 512 where ``plan`` counts 9.8: its student's heads are 312 / 12 = 26 wide, not a
multiple of 8, which the fused kernels may refuse, and the math path keeps a score matrix per layer.

For every distinct (heads, head size) of the presets' students and their bert-base teacher, in bf16
with the dropout each passes to SDPA (the students' in training, none for the teacher in eval mode),
the probe runs one forward and backward of ``[batch, heads, seq, head size]`` per backend forced
(``torch.nn.attention.sdpa_kernel``): whether it runs, or the first line of why not; then the kernel
PyTorch chooses by itself (the aten op the profiler sees), and on CUDA the peak memory of that forward
and backward above its inputs (their gradients included).

Then it times each kernel that runs, and PyTorch's own choice (``auto``): the forward alone, under
``no_grad`` (what the teacher runs), and the forward and backward (what the student runs), in ms and in
TFLOP/s of the model FLOPs ``plan`` counts for attention (``Q Kᵀ`` and ``A V``: ``4 b h s² d`` forward,
twice that backward). The step's floor puts attention at the matmul ceiling (788 TFLOP/s on an H200) and
the H200 measured it at 3.6x that (docs/log/benchmarks.md, "The step's floor"): these rates say whether any
kernel PyTorch offers for these shapes comes nearer (forcing it in a run is then the change to measure),
or whether attention's kernels bound the step. On CPU (the dry run) the same runs, on the CPU's kernels:
nothing from it means anything for a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import load_config
from trainer.config import TrainConfig
from trainer.modeling import base_config, load_teacher_config, student_config
from trainer.runtime.profiling import synchronize

REPO = Path(__file__).resolve().parents[1]
PRESETS = ("distilbert-base", "tinybert-4l-312", "minilm-6l-384", "tinybert-6l-768", "pkd-skip-6l")
TEACHER = REPO / "configs" / "teachers" / "bert-base-uncased"
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def attention_shapes() -> dict[tuple[int, int, float], list[str]]:
    """(heads, head size, attention dropout) -> the encoders that have it, over the presets' students and teacher."""
    teacher = load_teacher_config(str(TEACHER))
    shapes: dict[tuple[int, int, float], list[str]] = {}
    encoders = [("bert-base teacher", teacher, 0.0)]  # in eval mode: Hugging Face passes no dropout to SDPA
    for preset in PRESETS:
        cfg = load_config(TrainConfig, str(REPO / "configs" / f"{preset}.yaml"), [f"teacher={TEACHER}"])
        config = student_config(cfg.student, base_config(cfg.student, teacher))
        encoders.append((f"{preset} student", config, config.attention_probs_dropout_prob))
    for name, config, dropout in encoders:
        heads = config.num_attention_heads
        shapes.setdefault((heads, config.hidden_size // heads, dropout), []).append(name)
    return shapes


def forward_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> None:
    F.scaled_dot_product_attention(q, k, v, dropout_p=dropout).sum().backward()


def chosen_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> str:
    """The scaled-dot-product aten op that PyTorch dispatches to by itself (its name says the kernel)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward_backward(q, k, v, dropout)
    names = {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")}
    names |= {e.key for e in prof.key_averages() if e.key.startswith("aten::_efficient_attention")}
    return ", ".join(sorted(names)) or "none found"


def attention_flops(batch: int, heads: int, seq_len: int, head_size: int) -> int:
    """The forward's model FLOPs as ``plan`` counts them (``encoder_flops_per_token``'s ``2 S H`` a matmul):
    ``Q Kᵀ`` and ``A V``, two multiply-adds per element."""
    return 2 * 2 * batch * heads * seq_len * seq_len * head_size


def timed_ms(run: Callable[[], None], device: str, warmup: int, repeat: int) -> float:
    """Milliseconds per call of ``run``, after ``warmup`` calls, the device drained around the timed ones."""
    for _ in range(warmup):
        run()
    synchronize(torch.device(device))
    start = time.perf_counter()
    for _ in range(repeat):
        run()
    synchronize(torch.device(device))
    return (time.perf_counter() - start) * 1e3 / repeat


def timings(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, backend: SDPBackend | None, repeat: int
) -> dict[str, float]:
    """The forward alone (``no_grad``, as the teacher runs it) and forward with backward, with ``backend``
    forced (``None``: PyTorch's choice), in ms and TFLOP/s; backward counted as twice the forward."""
    grad_out = torch.randn_like(q)  # given, not made by a .sum(): only attention's own kernels are timed

    def forward() -> None:
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)

    def train() -> None:  # autograd.grad: the gradients returned, not added into .grad (no accumulation kernels)
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout), (q, k, v), grad_out)

    forced = contextlib.nullcontext() if backend is None else sdpa_kernel(backend)
    with forced:
        forward_ms = timed_ms(forward, q.device.type, warmup=2, repeat=repeat)
        train_ms = timed_ms(train, q.device.type, warmup=2, repeat=repeat)
    flops = attention_flops(q.shape[0], q.shape[1], q.shape[2], q.shape[3])
    return {
        "forward_ms": round(forward_ms, 4),
        "forward_tflops": round(flops / forward_ms / 1e9, 2),
        "train_ms": round(train_ms, 4),
        "train_tflops": round(3 * flops / train_ms / 1e9, 2),
    }


def probe(
    heads: int, head_size: int, dropout: float, batch: int, seq_len: int, device: str, repeat: int
) -> dict[str, Any]:
    def inputs() -> list[torch.Tensor]:
        shape = (batch, heads, seq_len, head_size)
        return [torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]

    result: dict[str, Any] = {"heads": heads, "head_size": head_size, "dropout": dropout}
    rates = {}
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel(backend):
                forward_backward(*inputs(), dropout)
            result[name] = "runs"
        except RuntimeError as err:  # the kernel's own refusal, e.g. an unsupported head size
            result[name] = str(err).strip().splitlines()[0][:200]
            continue
        rates[name] = timings(*inputs(), dropout, backend, repeat)
    rates["auto"] = timings(*inputs(), dropout, None, repeat)
    result["timings"] = rates
    q, k, v = inputs()
    result["chosen"] = chosen_kernel(q, k, v, dropout)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        forward_backward(q, k, v, dropout)
        torch.cuda.synchronize()
        result["peak_gib_above_inputs"] = (torch.cuda.max_memory_allocated() - held) / 2**30
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--repeat", type=int, default=10, help="timed calls per kernel, after 2 warm-up calls")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    rows = []
    for (heads, head_size, dropout), encoders in attention_shapes().items():
        torch.manual_seed(0)
        found = probe(heads, head_size, dropout, args.batch, args.seq_len, device, args.repeat)
        rows.append({"encoders": encoders, **found})
        if not args.json:
            print(rows[-1], flush=True)
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "batch": args.batch}
    report |= {"seq_len": args.seq_len, "shapes": rows}
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
