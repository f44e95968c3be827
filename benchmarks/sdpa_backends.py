"""Which attention kernel each preset's encoders get, and what it keeps: a probe for the GPU campaign.

    python benchmarks/sdpa_backends.py [--batch 64] [--seq-len 512] [--device auto|cpu|cuda] [--json]

Hugging Face's BERT calls ``F.scaled_dot_product_attention`` and PyTorch picks the kernel: flash, cuDNN,
memory-efficient or the math path, by the head size, the dtype, dropout and the GPU. ``plan`` counts the
activations as if every encoder took a fused kernel, which keeps no ``[seq, seq]`` matrix
(``trainer.commands.plan.flash_attention_saves``). Both GPU campaigns measured 16.8 GiB at the peak of
``tinybert-4l-312`` at 64 x 512 where ``plan`` counts 9.8: its student's heads are 312 / 12 = 26 wide, not a
multiple of 8, which the fused kernels may refuse, and the math path keeps a score matrix per layer.

For every distinct (heads, head size) of the presets' students and their bert-base teacher, in bf16
with the dropout each passes to SDPA (the students' in training, none for the teacher in eval mode),
the probe runs one forward and backward of ``[batch, heads, seq, head size]`` per backend forced
(``torch.nn.attention.sdpa_kernel``): whether it runs, or the first line of why not; then the kernel
PyTorch chooses by itself (the aten op the profiler sees), and on CUDA the peak memory of that forward
and backward above its inputs (their gradients included). On CPU (the dry run) only the CPU's own
choice is reported: nothing from it means anything for a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
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


def probe(heads: int, head_size: int, dropout: float, batch: int, seq_len: int, device: str) -> dict[str, Any]:
    def inputs() -> list[torch.Tensor]:
        shape = (batch, heads, seq_len, head_size)
        return [torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]

    result: dict[str, Any] = {"heads": heads, "head_size": head_size, "dropout": dropout}
    if device == "cuda":
        for name, backend in BACKENDS.items():
            try:
                with sdpa_kernel(backend):
                    forward_backward(*inputs(), dropout)
                result[name] = "runs"
            except RuntimeError as err:  # the kernel's own refusal, e.g. an unsupported head size
                result[name] = str(err).strip().splitlines()[0][:200]
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
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    rows = []
    for (heads, head_size, dropout), encoders in attention_shapes().items():
        torch.manual_seed(0)
        rows.append({"encoders": encoders, **probe(heads, head_size, dropout, args.batch, args.seq_len, device)})
        if not args.json:
            print(rows[-1], flush=True)
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "batch": args.batch}
    report |= {"seq_len": args.seq_len, "shapes": rows}
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
