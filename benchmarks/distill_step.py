"""Throughput and model-FLOPs utilisation (MFU) of one distillation step, for any trainer config.

    python benchmarks/distill_step.py CONFIG.yaml [key=value ...] [--seq-len 128] [--steps 20]
        [--warmup 3] [--device auto|cpu|cuda] [--peak-tflops T] [--random-weights] [--tokenizer DIR]
        [--step project|naive|peer] [--window N] [--compile] [--profile-steps N] [--floor] [--json]

A step is what one rank does per micro-batch, without DeepSpeed: dynamic masking on the device,
the Distiller's forward (teacher forward + student forward with the config's objective) and
backward, and a torch AdamW step. Batches are synthetic packed sequences ([CLS], random
non-special tokens, a [SEP] every ~100 tokens), since speed does not depend on the text. Precision
is DeepSpeed's bf16/fp16 mode (``deepspeed.precision``), without DeepSpeed: student and teacher hold
16-bit weights and run in 16 bits (no autocast), and AdamW updates float32 master copies of the
student's weights, copied back after each step (:class:`MasterWeights`; no loss scaling, so fp16 gives
timings, not a trained model). The gradients' global norm is clipped to ``optimizer.grad_clip`` before the
update, as the engine clips (DeepSpeed's ``gradient_clipping``), and as the two steps it is compared with
clip: ``--step naive`` (``benchmarks/naive_step.py``: the usual hand-written script) and ``--step peer``
(``benchmarks/peer_step.py``: the same objective through TextBrewer, a distillation library from PyPI,
installed), both with their teacher under autocast in the same 16-bit dtype as the project's.

MFU = tokens/s x model FLOPs per token (``trainer.planning.plan.step_flops_per_token``, the figure
``plan`` prints) / peak FLOP/s. The peak is ``--peak-tflops``, else the dense bf16 tensor-core
peak of a known GPU, else (CPU) a measured large-matmul rate in the same dtype, which makes the
CPU figure "fraction of what this machine's matmul achieves", not of a datasheet number.
On CUDA it also runs one masking + forward + backward under ``torch.cuda.set_sync_debug_mode
("error")`` and reports whether anything in it waited for the device.

``--profile-steps N`` then runs N more steps under ``torch.profiler`` and adds to the result where
a step's time goes: per op category (matmul, attention, softmax and losses, masking and gathers,
norms and activations, optimizer, copies, other), the top ops and, on CUDA, the top kernels and the
share of wall time the GPU was busy. Measured before anything is optimised (issue 15: "measure
first"); it runs after the timed steps, so it does not slow the figures above.

``--floor`` then measures the device's two ceilings (a large matmul's FLOP/s, a large copy's bytes/s) and
reports the step's floor against them (``benchmarks/step_floor.py``: every op at the longer of its FLOPs'
and its bytes' time, by category), beside the profile's measured time per category where there is one.
With ``--compile`` the floor is that of the kernels Inductor made for the step, counted as the first
warm-up step compiles them (``benchmarks/compiled_floor.py``; caches off for that compile, so that it
counts), beside the measured step.

``--random-weights`` builds the teacher from its ``config.json`` alone (e.g.
``teacher=configs/teachers/bert-base-uncased``); give ``--tokenizer`` a directory with the
matching tokenizer when the teacher directory has none.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.profiler import profile
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.compiled_floor import compiled_report, inductor_counts, kernel_costs
from benchmarks.naive_step import NaiveStep
from benchmarks.peer_step import PEER, PeerStep
from benchmarks.step_floor import floor_markdown, measured_ceilings, step_floor
from benchmarks.step_parts import clip_gradients
from common.cli import run_cli, split_config_args
from common.config import ConfigError, load_config
from common.tokenizer import load_tokenizer
from trainer.config import TrainConfig
from trainer.modeling import build_student, load_teacher, load_teacher_config, model_from_config, training_dtype
from trainer.objective.distiller import Distiller, validate_against_teacher
from trainer.objective.masking import DynamicMasker, seeded_generator
from trainer.planning.plan import step_flops_per_token
from trainer.runtime.profiling import profile_markdown, profiler_activities, summarize, synchronize

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' datasheets, matched against the device name.
GPU_PEAK_BF16 = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
    "V100": 125e12,  # fp16 (no bf16 tensor cores)
}


def profile_steps(step: Any, first: int, count: int, device: torch.device) -> dict[str, Any]:
    """Where ``count`` steps spend their time, per step, as ``trainer.runtime.profiling`` summarises a run's
    profiled steps: categories, top ops, (CUDA) top kernels and busy share."""
    synchronize(device)
    start = time.perf_counter()
    with profile(activities=profiler_activities(device)) as prof:
        for i in range(count):
            step(first + i)
        synchronize(device)
    wall_ms = (time.perf_counter() - start) * 1e3 / count
    return summarize(prof, count, wall_ms, device.type == "cuda")


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(step: Any, i: int) -> int:
    """The aten ops one step dispatches: each is host work, and on CUDA most are a kernel launch. Not counted for
    a compiled step, whose kernels bypass the dispatcher."""
    with OpCount() as counter:
        step(i)
    return counter.ops


def peer_version() -> dict[str, str]:
    import importlib.metadata

    return {"library": PEER, "version": importlib.metadata.version(PEER)}


def gpu_peak(name: str) -> float | None:
    return next((peak for key, peak in GPU_PEAK_BF16.items() if key in name), None)


def host_syncs(device: torch.device, forward_backward: Any) -> str:
    """Masking + forward + backward under CUDA's sync debug mode: "none", or the first op that waited."""
    if device.type != "cuda":
        return "not checked (CPU)"
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward_backward()
        return "none"
    except RuntimeError as err:
        return f"found: {str(err).splitlines()[0]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def secondary(measure: Any) -> Any:
    """``measure()``, or ``{"error": ...}`` (the traceback on stderr) where it fails."""
    try:
        return measure()
    except Exception as err:  # any failure of a diagnostic is reported, never fatal to the timing
        traceback.print_exc()
        return {"error": f"{type(err).__name__}: {err}".splitlines()[0][:300]}


def synthetic_batch(tokenizer: Any, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """Packed sequences of random non-special tokens: [CLS] first, a [SEP] every ~100 tokens."""
    special = torch.tensor(tokenizer.all_special_ids)
    ordinary = torch.arange(len(tokenizer))[~torch.isin(torch.arange(len(tokenizer)), special)]
    ids = ordinary[torch.randint(len(ordinary), (batch, seq_len), generator=generator)]
    ids[:, 0] = tokenizer.cls_token_id
    ids[:, 100::100] = tokenizer.sep_token_id
    return ids


class MasterWeights:
    """DeepSpeed's 16-bit training mode, without DeepSpeed: the model holds 16-bit weights and gradients,
    AdamW holds float32 master copies (``fused`` on CUDA, as the trainer's). A step copies the gradients into
    the masters, clips them as the engine does (:func:`clip_gradients`: DeepSpeed's ``gradient_clipping``, on the
    float32 gradients), updates them and copies them back: the per-step traffic of ZeRO's bf16 optimizer on one
    rank. With float32 weights it is the plain optimizer, clipped the same way."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: TrainConfig, fused: bool) -> None:
        self.params, self.cfg = params, cfg
        self.masters = params
        if params[0].dtype != torch.float32:
            self.masters = [torch.nn.Parameter(p.detach().float()) for p in params]
        optimizer = cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            self.masters, lr=optimizer.lr, betas=tuple(optimizer.betas), eps=optimizer.eps, fused=fused
        )

    @torch.no_grad()
    def step(self) -> None:
        if self.masters is not self.params:
            for master, param in zip(self.masters, self.params, strict=True):
                # None where no loss reached the parameter (the student's MLM head under TinyBERT's or
                # MiniLM's layer losses alone): AdamW then leaves it untouched
                master.grad = None if param.grad is None else param.grad.float()
        clip_gradients(self.masters, self.cfg)
        self.optimizer.step()
        if self.masters is not self.params:
            torch._foreach_copy_(self.params, self.masters)
            for master in self.masters:
                master.grad = None
        for param in self.params:
            param.grad = None


def build_models(cfg: TrainConfig, random_weights: bool) -> tuple[Any, Any]:
    """(teacher in the training dtype, float32 student), the student derived before the teacher is cast."""
    if random_weights:
        teacher = model_from_config(load_teacher_config(cfg.teacher)).requires_grad_(False).eval()
    else:
        teacher = load_teacher(cfg.teacher, torch.float32)
    student = build_student(cfg.student, teacher)
    return teacher.to(training_dtype(cfg.deepspeed.precision)), student


def benchmark(cfg: TrainConfig, args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    torch.manual_seed(cfg.seed)
    teacher_config = load_teacher_config(cfg.teacher)
    validate_against_teacher(cfg, teacher_config)
    tokenizer = load_tokenizer(args.tokenizer or cfg.teacher)
    teacher, student = build_models(cfg, args.random_weights)
    dtype = training_dtype(cfg.deepspeed.precision)
    # The same batches for both steps: made on the host from the seed, copied to the device for ours.
    host_batches = [
        synthetic_batch(tokenizer, cfg.micro_batch_size, args.seq_len, seeded_generator(cfg.seed, i)) for i in range(4)
    ]
    if args.step == "naive":
        naive = NaiveStep(cfg, teacher, student, tokenizer, device)

        def forward_backward(i: int) -> torch.Tensor:
            return torch.tensor(naive.forward_backward(host_batches[i % 4], seeded_generator(cfg.seed, i))["loss"])

        def step(i: int) -> torch.Tensor:
            return torch.tensor(naive(host_batches[i % 4], seeded_generator(cfg.seed, i))["loss"])

    elif args.step == "peer":
        peer = PeerStep(cfg, teacher, student, tokenizer, device, host_batches)
        forward_backward, step = peer.forward_backward, peer

    else:
        # Both models in the training dtype, as DeepSpeed's bf16/fp16 mode converts the module it trains.
        distiller = Distiller(student, teacher.to(device), cfg.objective).to(device, dtype).train()
        if args.compile:
            distiller.compile_models()
        # As in training: frequency-smoothed masking (the DistilBERT preset) reads the dataset's token counts.
        counts = None
        if cfg.masking.frequency_smoothing is not None:
            from trainer.runtime.data import load_token_counts  # the dataset's reader: only when a config needs it

            counts = load_token_counts(cfg.data)
        masker = DynamicMasker.from_tokenizer(cfg.masking, tokenizer, token_counts=counts, device=device)
        trainable = [p for p in distiller.parameters() if p.requires_grad]
        optimizer = MasterWeights(trainable, cfg, fused=device.type == "cuda")
        batches = [b.to(device) for b in host_batches]

        def forward_backward(i: int) -> torch.Tensor:
            masked = masker(batches[i % len(batches)], None, seeded_generator(cfg.seed, i, 0, device=device))
            loss = distiller(masked, None)["loss"]
            loss.backward()
            return loss.detach()

        def step(i: int) -> torch.Tensor:
            loss = forward_backward(i)
            optimizer.step()
            return loss

    compiled_kernels: list[tuple[Any, int]] = []
    for i in range(args.warmup):
        # With --compile --floor, the first step (which compiles) also records the kernels Inductor makes.
        counting = inductor_counts() if i == 0 and args.compile and args.floor else contextlib.nullcontext([])
        with counting as kernels:
            step(i)
        compiled_kernels += kernels
    # timed in windows of --window steps (default: one window of them all), each ended by a device sync: their
    # rates give a median and a range, one window's stall from steady noise
    window = args.window or args.steps
    losses, window_seconds = [], []
    for first in range(0, args.steps, window):
        synchronize(device)
        start = time.perf_counter()
        losses += [step(args.warmup + i) for i in range(first, min(first + window, args.steps))]
        synchronize(device)
        window_seconds.append(time.perf_counter() - start)
    seconds = sum(window_seconds)
    host_sync = host_syncs(device, lambda: forward_backward(0))
    max_memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    ceilings = functools.cache(lambda: measured_ceilings(device, dtype))  # measured once, where first needed
    if args.peak_tflops is not None:
        peak, peak_source = args.peak_tflops * 1e12, "--peak-tflops"
    elif device.type == "cuda" and gpu_peak(torch.cuda.get_device_name(device)) is not None:
        peak, peak_source = gpu_peak(torch.cuda.get_device_name(device)), "datasheet dense bf16"
    else:
        peak, peak_source = ceilings()[0], f"measured {dtype} matmul"
    flops = step_flops_per_token(cfg.objective, teacher.config, student.config, cfg.masking.probability, args.seq_len)[
        "total"
    ]
    # What follows the timing explains it. A failure there is recorded in its place, and the figures above are
    # kept: the first GPU run of the op census failed where a CPU never goes, and took the timings with it.
    ops = None if args.compile else secondary(lambda: ops_per_step(step, args.warmup + args.steps))
    profiled = None
    if args.profile_steps:
        profiled = secondary(lambda: profile_steps(step, args.warmup + args.steps, args.profile_steps, device))
    floor = None
    if args.floor and args.compile:  # the kernels the compile made, beside the step's measured time
        trainable = [p for p in distiller.parameters() if p.requires_grad]
        step_flops = flops * cfg.micro_batch_size * args.seq_len

        def counted() -> dict[str, Any]:
            kernels = kernel_costs(compiled_kernels)
            parameters, weight_bytes = sum(p.numel() for p in trainable), trainable[0].element_size()
            report = compiled_report(kernels, parameters, step_flops, *ceilings(), peak, weight_bytes)
            return {**report, "measured_step_ms": seconds / args.steps * 1e3}

        floor = secondary(counted)
    elif args.floor:  # the profile's time per category beside its floor, where this run profiled
        measured = profiled["categories_ms_per_step"] if profiled and "error" not in profiled else None
        floor = secondary(lambda: step_floor(cfg, args.seq_len, *ceilings(), peak, measured))
    tokens_per_s = args.steps * cfg.micro_batch_size * args.seq_len / seconds
    return {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)",
        "step": args.step,
        "fused_adamw": args.step == "project" and device.type == "cuda",
        "compiled": args.compile and args.step == "project",
        "precision": cfg.deepspeed.precision,
        # how the teacher runs: the naive and peer steps under the same 16-bit dtype as the project's (issue 52)
        "teacher_weights": str(dtype if args.step == "project" else torch.float32).removeprefix("torch."),
        "autocast": None
        if args.step == "project"
        else {"bf16": "bfloat16", "fp16": "float16"}.get(cfg.deepspeed.precision),
        "grad_clip": cfg.optimizer.grad_clip,  # every step clips the global norm to it, as the engine does
        "peer": peer_version() if args.step == "peer" else None,
        "teacher": cfg.teacher,
        "student_layers": student.config.num_hidden_layers,
        "micro_batch_size": cfg.micro_batch_size,
        "seq_len": args.seq_len,
        "objective": {k: getattr(cfg.objective, k) for k in ("ce", "mlm", "cos", "mse", "ce_positions")},
        "steps": args.steps,
        "seconds_per_step": seconds / args.steps,
        "tokens_per_s": tokens_per_s,
        "window_tokens_per_s": [
            min(window, args.steps - i * window) * cfg.micro_batch_size * args.seq_len / s
            for i, s in enumerate(window_seconds)
        ],
        "flops_per_token": flops,
        "achieved_tflops": tokens_per_s * flops / 1e12,
        "peak_tflops": peak / 1e12,
        "peak_source": peak_source,
        "mfu": tokens_per_s * flops / peak,
        "final_loss": float(losses[-1]),
        "host_sync_in_forward_backward": host_sync,
        "ops_per_step": ops,
        "max_memory_gib": max_memory,
        "profile": profiled,
        "floor": floor,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--window", type=int, default=None, help="time in windows of this many steps (default: one)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak FLOP/s of the device, in TFLOP/s")
    parser.add_argument("--random-weights", action="store_true", help="teacher from its config.json, random init")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the teacher's)")
    parser.add_argument(
        "--step",
        default="project",
        choices=["project", "naive", "peer"],
        help="this project's step, the naive reference or the real peer (TextBrewer, installed)",
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile student and teacher (project step)")
    parser.add_argument(
        "--profile-steps", type=int, default=0, help="then profile this many steps: where the time goes"
    )
    parser.add_argument(
        "--floor", action="store_true", help="then the step's floor at this device's measured ceilings, by category"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_intermixed_args(argv)
    if args.steps < 1 or args.seq_len < 2 or args.profile_steps < 0:
        raise ConfigError("--steps must be >= 1, --seq-len >= 2 and --profile-steps >= 0")
    if args.floor and args.step != "project":
        raise ConfigError("--floor: the project's step only (the naive and peer steps' ops are not counted)")
    if args.compile and args.step != "project":
        raise ConfigError("--compile: the project's step only (the naive and peer steps run as their users run them)")
    if args.compile and args.floor and args.warmup < 1:
        raise ConfigError("--compile --floor: the first warm-up step's compile is what is counted (--warmup >= 1)")
    path, overrides = split_config_args(args.args)
    cfg = load_config(TrainConfig, path, overrides)
    if cfg.teacher is None:
        raise ConfigError("teacher: this benchmark times a distillation step; it needs a teacher")
    result = benchmark(cfg, args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{result['device']}, {result['step']} step, {result['precision']}, "
            f"micro-batch {result['micro_batch_size']} x {result['seq_len']}: "
            f"{result['seconds_per_step'] * 1e3:.1f} ms/step, {result['tokens_per_s']:,.0f} tokens/s, "
            f"{result['flops_per_token']:.3e} FLOPs/token -> {result['achieved_tflops']:.3f} TFLOP/s, "
            f"MFU {result['mfu']:.1%} of {result['peak_tflops']:.2f} TFLOP/s ({result['peak_source']})"
        )
        if result["profile"] and "error" not in result["profile"]:
            print(profile_markdown(result["profile"]))
        if result["floor"] and "error" not in result["floor"]:
            print(floor_markdown(result["floor"]))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
