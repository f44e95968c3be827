"""The floor under one distillation step: the FLOPs it must do and the bytes its ops move, by op category.

    python benchmarks/step_floor.py CONFIG.yaml [key=value ...] [--seq-len 512] [--matmul-tflops T]
        [--bandwidth-tbs B] [--profile FILE] [--json]

No kernel finishes faster than the longer of two times: its FLOPs at the matrix units' rate, and the bytes
it reads and writes at the memory's bandwidth. This counts both for every op of the project's bare step
(``benchmarks/distill_step.py``: the Distiller's forward and backward, then the optimizer) through the real
Distiller on the meta device (shapes, no storage, no arithmetic: seconds on any machine, for any model),
and sums each op's longer time by category (``trainer.runtime.profiling``'s, as the profiler reports them).
That sum is the floor of the eager step: its time if every kernel it launches ran at its roofline. Beside
a profile of the same step on a GPU (``--profile``: ``distill_step.py --json`` output with
``--profile-steps``, or the GPU campaign's ``throughput.json``), each category's measured time over its
floor says where a change can pay. A memory-bound category near its floor is bounded by its bytes: only
moving fewer (fusing ops, which is compile's work) makes it faster. One far above its floor loses its time
elsewhere (launch and tail effects of short kernels, or kernels that do not reach the bandwidth).

What is counted:

* each op's bytes: every tensor it reads and every tensor it writes, once (a broadcast operand as its
  distinct elements); views, ``empty`` and ``detach`` move nothing; ``copy_`` reads its source and writes
  its destination;
* FLOPs: the matmuls (2 per multiply-add) and attention's two products, which ``plan`` counts as model FLOPs
  (``step_flops_per_token``); norms, activations and losses are counted by their bytes alone;
* dropout as a GPU runs it (:func:`dropout_as_on_a_gpu`), and attention as the fused kernels (flash, cuDNN,
  memory-efficient) run it, through ``plan``'s flash stand-in: forward reads q, k, v and writes the output
  and a float32 log-sum-exp per query; backward reads those and the output's gradient and writes q's, k's
  and v's. A fused kernel keeps its dropout mask in registers;
* the optimizer as ``distill_step.py``'s ``MasterWeights`` runs it with fused AdamW, from the trainable
  parameter count: each 16-bit gradient cast to float32, the fused update (gradient, master weight and two
  moments read, the last three written: 28 bytes a parameter) and the copy back to 16 bits;
* not the masking: the meta batch comes masked (``DynamicMasker`` took 0.23 of the step's 29.8 ms of
  kernels on an H200, docs/log/benchmarks.md).

The ceilings are ``--matmul-tflops`` and ``--bandwidth-tbs``: measured ones where known (a large bf16
matmul; a large device-to-device copy, bytes read plus bytes written). ``distill_step.py --floor``
measures both on its own device (:func:`measured_ceilings`) and reports its step against them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cli import run_cli, split_config_args
from common.config import ConfigError, load_config
from trainer.config import TrainConfig
from trainer.modeling import base_config, load_teacher_config, student_config
from trainer.objective.distiller import validate_against_teacher
from trainer.planning.plan import flash_attention_saves, meta_batch, meta_distiller, step_flops_per_token
from trainer.runtime.profiling import op_category, synchronize

# Ops that allocate or alias and move no bytes (views are found by their schema).
MOVES_NOTHING = {
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::detach",
    "aten::alias",
    "aten::lift_fresh",
    "aten::_unsafe_view",
}
WRITE_ONLY_FIRST_ARGUMENT = {"aten::copy_", "aten::fill_", "aten::zero_"}  # the first argument is written, not read
MATMULS = {"aten::mm": 0, "aten::bmm": 0, "aten::addmm": 1, "aten::baddbmm": 1}  # name -> index of the left operand
FLASH_FORWARD = "aten::_scaled_dot_product_flash_attention"


@dataclass(frozen=True)
class OpCost:
    name: str
    category: str
    flops: int
    bytes: int


def distinct_bytes(tensor: torch.Tensor) -> int:
    """The bytes a kernel must touch to read or write ``tensor``: a broadcast (stride-0) dimension counts once."""
    elements = math.prod(size for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if stride != 0)
    return (elements if tensor.numel() else 0) * tensor.element_size()


class StepTraffic(TorchDispatchMode):
    """Records each op dispatched under it as an :class:`OpCost`; :meth:`attention` is ``plan``'s flash stand-in's
    observer (:func:`trainer.planning.plan.flash_attention_saves`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[OpCost] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if func.is_view or name in MOVES_NOTHING:
            return out
        read = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if name in WRITE_ONLY_FIRST_ARGUMENT:
            read = read[1:]
        written = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        flops = 0
        if name in MATMULS:  # each output element is a dot product as long as the left operand's last dimension
            flops = 2 * written[0].numel() * args[MATMULS[name]].shape[-1]
        moved = sum(map(distinct_bytes, read)) + sum(map(distinct_bytes, written))
        self.ops.append(OpCost(name, op_category(name), flops, moved))
        return out

    def attention(self, which: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        products = math.prod(q.shape[:-2]) * q.shape[-2] * k.shape[-2]  # batch x heads x queries x keys
        forward_flops = 2 * products * (q.shape[-1] + v.shape[-1])  # Q Kᵀ and A V
        qkv = distinct_bytes(q) + distinct_bytes(k) + distinct_bytes(v)
        output = math.prod(q.shape[:-1]) * v.shape[-1] * v.element_size()
        logsumexp = math.prod(q.shape[:-1]) * 4
        if which == "forward":
            self.ops.append(OpCost(FLASH_FORWARD, "attention", forward_flops, qkv + output + logsumexp))
        else:  # reads q, k, v, the output, its gradient and the log-sum-exp; writes the gradients of q, k, v
            moved = qkv + 2 * output + logsumexp + qkv
            self.ops.append(OpCost(FLASH_FORWARD + "_backward", "attention", 2 * forward_flops, moved))


@contextlib.contextmanager
def dropout_as_on_a_gpu() -> Iterator[None]:
    """Within: ``F.dropout`` (``nn.Dropout``'s) in training is ``native_dropout``, as PyTorch runs it on a GPU: one
    kernel that writes the output and a one-byte mask, whose backward reads the mask. On the CPU and the meta
    device it is three ops instead (a Bernoulli draw, a division, a product) with a 16-bit mask."""
    original = F.dropout

    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        return torch.native_dropout(input, p, True)[0] if training and 0 < p < 1 else input

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original


def optimizer_costs(trainable: int, weight_bytes: int) -> list[OpCost]:
    """``MasterWeights.step`` with fused AdamW over ``trainable`` parameters held in ``weight_bytes``-byte weights."""
    update = OpCost("aten::_fused_adamw_", "optimizer", 0, 28 * trainable)  # grad, weight, m, v read; 3 written
    if weight_bytes == 4:  # float32 weights: the optimizer updates them in place
        return [update]
    cast = OpCost("aten::_to_copy", "copies and casts", 0, (weight_bytes + 4) * trainable)
    copy_back = OpCost("aten::_foreach_copy_", "optimizer", 0, (4 + weight_bytes) * trainable)
    return [cast, update, copy_back]


def model_configs(cfg: TrainConfig) -> tuple[Any, Any]:
    """(teacher config or None, student config) of ``cfg``, checked against each other as training checks them."""
    teacher_config = None if cfg.teacher is None else load_teacher_config(cfg.teacher)
    validate_against_teacher(cfg, teacher_config)
    return teacher_config, student_config(cfg.student, base_config(cfg.student, teacher_config))


def model_flops(cfg: TrainConfig, seq_len: int, micro_batch: int) -> float:
    """``plan``'s model FLOPs for one step of ``cfg`` at ``micro_batch`` x ``seq_len``: what MFU counts."""
    teacher_config, s_config = model_configs(cfg)
    per_token = step_flops_per_token(cfg.objective, teacher_config, s_config, cfg.masking.probability, seq_len)
    return per_token["total"] * micro_batch * seq_len


def trainable_parameters(cfg: TrainConfig) -> tuple[int, int]:
    """(how many parameters the step trains, the bytes of one in the training dtype), counted on the meta device."""
    distiller, _ = meta_distiller(cfg, *model_configs(cfg))
    params = [p for p in distiller.parameters() if p.requires_grad]
    return sum(p.numel() for p in params), params[0].element_size()


def count_step(cfg: TrainConfig, seq_len: int) -> list[OpCost]:
    """Every op of one bare step (forward, backward, optimizer) of ``cfg`` at ``micro_batch_size`` x ``seq_len``."""
    distiller, _ = meta_distiller(cfg, *model_configs(cfg))
    batch = meta_batch(cfg.micro_batch_size, cfg.masking.probability, seq_len)
    traffic = StepTraffic()
    with flash_attention_saves(traffic.attention), dropout_as_on_a_gpu(), traffic:
        distiller(batch, None)["loss"].backward()
    params = [p for p in distiller.parameters() if p.requires_grad]
    return traffic.ops + optimizer_costs(sum(p.numel() for p in params), params[0].element_size())


def measured_profile(path: Path) -> dict[str, float]:
    """A profile's milliseconds per category: a ``distill_step.py --json`` result, or the GPU campaign's
    ``throughput.json`` (its eager ``project`` step)."""
    report = json.loads(path.read_text(encoding="utf-8"))
    results = report.get("steps", [report])
    for result in results:
        if result.get("step", "project") == "project" and not result.get("compiled") and result.get("profile"):
            return result["profile"]["categories_ms_per_step"]
    raise ConfigError(f"--profile: {path} holds no profile of the project's eager step")


def floor_report(
    ops: list[OpCost],
    matmul_flops: float,
    bandwidth: float,
    model_flops: float,
    peak_flops: float,
    measured: dict[str, float] | None = None,
    step: str = "eager",
) -> dict[str, Any]:
    """Per category: ops, GFLOP, GB moved, the floor (each op at the longer of its two times) and, with
    ``measured`` (ms per category), the measured time, its ratio to the floor and the bandwidth reached
    where the category is memory-bound. ``model_flops`` (``plan``'s) over the floor at ``peak_flops`` is the
    MFU a ``step`` ("eager", "compiled") at its floor would reach."""
    categories: dict[str, dict[str, float]] = {}
    for op in ops:
        row = categories.setdefault(op.category, {"ops": 0, "gflop": 0.0, "gb": 0.0, "floor_ms": 0.0})
        row["ops"] += 1
        row["gflop"] += op.flops / 1e9
        row["gb"] += op.bytes / 1e9
        row["floor_ms"] += max(op.flops / matmul_flops, op.bytes / bandwidth) * 1e3
    for name, row in categories.items():
        row["memory_bound"] = row["gb"] / bandwidth >= row["gflop"] / matmul_flops  # its bytes take longer
        if measured is not None:
            row["measured_ms"] = measured.get(name, 0.0)
            row["measured_over_floor"] = row["measured_ms"] / row["floor_ms"] if row["floor_ms"] else None
            row["achieved_tbs"] = row["gb"] / row["measured_ms"] if row["measured_ms"] else None
    floor_ms = sum(row["floor_ms"] for row in categories.values())
    by_name: dict[str, list[Any]] = {}
    for op in ops:
        entry = by_name.setdefault(op.name, [op.category, 0, 0.0, 0.0])
        entry[1] += 1
        entry[2] += op.bytes / 1e9
        entry[3] += max(op.flops / matmul_flops, op.bytes / bandwidth) * 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1][3])[:12]
    report: dict[str, Any] = {
        "step": step,
        "matmul_tflops": matmul_flops / 1e12,
        "bandwidth_tbs": bandwidth / 1e12,
        "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1]["floor_ms"])),
        "top_ops": [{"op": name, "category": c, "calls": n, "gb": gb, "floor_ms": ms} for name, (c, n, gb, ms) in top],
        "counted_gflop": sum(op.flops for op in ops) / 1e9,
        "model_gflop": model_flops / 1e9,
        "gb": sum(op.bytes for op in ops) / 1e9,
        "floor_ms": floor_ms,
        "mfu_at_floor": model_flops / (floor_ms / 1e3) / peak_flops,
        "peak_tflops": peak_flops / 1e12,
    }
    if measured is not None:
        report["measured_ms"] = sum(measured.values())
        report["mfu_of_measured_kernels"] = model_flops / (report["measured_ms"] / 1e3) / peak_flops
    return report


def figure(value: float) -> str:
    """A rate as a reader wants it: 989, 4.3, 0.0154."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def floor_markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table and a line of totals."""
    measured = "measured_ms" in report
    head = "| category | ops | GFLOP | GB moved | floor ms |" + (
        " measured ms | measured / floor | TB/s reached |" if measured else ""
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, row in report["categories"].items():
        line = f"| {name} | {row['ops']} | {row['gflop']:,.1f} | {row['gb']:.2f} | {row['floor_ms']:.2f} |"
        if measured:
            ratio = f"{row['measured_over_floor']:.1f}x" if row["measured_over_floor"] else "-"
            reached = f"{row['achieved_tbs']:.2f}" if row["achieved_tbs"] and row["memory_bound"] else "-"
            line += f" {row['measured_ms']:.2f} | {ratio} | {reached} |"
        lines.append(line)
    totals = (
        f"Floor {report['floor_ms']:.2f} ms a step at {figure(report['matmul_tflops'])} TFLOP/s and "
        f"{figure(report['bandwidth_tbs'])} TB/s ({report['gb']:.2f} GB moved, {report['counted_gflop']:,.0f} GFLOP "
        f"counted, plan's model FLOPs {report['model_gflop']:,.0f} GFLOP): the {report['step']} step at its floor "
        f"would reach {report['mfu_at_floor']:.1%} MFU of {figure(report['peak_tflops'])} TFLOP/s"
    )
    if measured:
        totals += (
            f"; the measured kernels, {report['measured_ms']:.2f} ms, "
            f"{report['mfu_of_measured_kernels']:.1%} ({report['measured_ms'] / report['floor_ms']:.2f}x the floor)"
        )
    if "measured_step_ms" in report:
        step_ms = report["measured_step_ms"]
        totals += f"; the measured step, {step_ms:.2f} ms, {step_ms / report['floor_ms']:.2f}x the floor"
    totals += ". Not counted: the masking (the counted batch comes masked), which the measured masking time holds"
    if report["step"] == "compiled":
        totals += ", and the few eager ops between the compiled pieces"
    lines += [
        "",
        totals + ".",
        "",
        "| top op (floor) | category | calls | GB moved | floor ms |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| `{o['op']}` | {o['category']} | {o['calls']} | {o['gb']:.2f} | {o['floor_ms']:.2f} |"
        for o in report["top_ops"]
    ]
    return "\n".join(lines)


def step_floor(
    cfg: TrainConfig,
    seq_len: int,
    matmul_flops: float,
    bandwidth: float,
    peak_flops: float,
    measured: dict[str, float] | None = None,
) -> dict[str, Any]:
    """:func:`count_step`, then :func:`floor_report` against ``plan``'s model FLOPs for the same step."""
    flops = model_flops(cfg, seq_len, cfg.micro_batch_size)
    return floor_report(count_step(cfg, seq_len), matmul_flops, bandwidth, flops, peak_flops, measured)


# ------------------------------------------------------------------------------- the device's ceilings
def measured_matmul_peak(
    device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...] = (512, 1024, 2048), seconds: float = 0.5
) -> float:
    """FLOP/s of square matmuls in ``dtype`` on random data, the best over ``sizes`` and over the two layouts a
    step's matmuls take (``x @ W.T``, ``nn.Linear``'s forward; ``x @ W``, its input gradient): the practical
    ceiling of this device. Each size runs for about ``seconds``; a size whose one call takes longer ends that
    layout's growth. Both matter on a CPU without bfloat16 units, where one layout's bf16 rate falls with
    the size and the other's does not (docs/log/benchmarks.md, "CPU ceilings")."""
    best = 0.0
    for transposed in (True, False):
        for size in sizes:
            a = torch.randn(size, size, device=device, dtype=dtype)
            b = torch.randn(size, size, device=device, dtype=dtype)
            b = b.t() if transposed else b
            a @ b  # warm-up: a GPU's first call also pays the library's set-up
            synchronize(device)
            start = time.perf_counter()
            a @ b  # one call's time, which sets the repeats
            synchronize(device)
            once = time.perf_counter() - start
            best = max(best, 2 * size**3 / once)
            if once > seconds:
                break
            repeats = max(1, min(1000, int(seconds / once)))
            start = time.perf_counter()
            for _ in range(repeats):
                a @ b
            synchronize(device)
            best = max(best, 2 * size**3 * repeats / (time.perf_counter() - start))
    return best


def measured_bandwidth(device: torch.device, nbytes: int = 2**30, repeats: int = 10) -> float:
    """Bytes/s of a large device-to-device copy, counting the bytes read and the bytes written."""
    source = torch.randn(nbytes // 4, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    synchronize(device)
    return 2 * source.numel() * 4 * repeats / (time.perf_counter() - start)


def measured_ceilings(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(matmul FLOP/s, bandwidth bytes/s) measured here: an 8192-wide matmul and a 1 GiB copy on a GPU, smaller
    on a CPU."""
    if device.type == "cuda":
        return measured_matmul_peak(device, dtype, sizes=(8192,)), measured_bandwidth(device)
    return measured_matmul_peak(device, dtype), measured_bandwidth(device, nbytes=2**28, repeats=3)


# ------------------------------------------------------------------------------- the command line
def floor_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every floor takes (this script's, ``compiled_floor.py``'s): a config, the sequence length and
    the rates it is counted against."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--matmul-tflops", type=float, required=True, help="the matrix units' rate, TFLOP/s")
    parser.add_argument("--bandwidth-tbs", type=float, required=True, help="memory bandwidth, TB/s read + written")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the peak MFU is counted against")
    parser.add_argument("--json", action="store_true")
    return parser


def parsed_floor_args(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, TrainConfig]:
    """The arguments, checked, and the config they name; the rates are then in FLOP/s and bytes/s."""
    args = parser.parse_intermixed_args(argv)
    if min(args.matmul_tflops, args.bandwidth_tbs, args.peak_tflops) <= 0 or args.seq_len < 2:
        raise ConfigError("--matmul-tflops, --bandwidth-tbs and --peak-tflops must be > 0, --seq-len >= 2")
    args.matmul_flops, args.bandwidth, args.peak_flops = (
        args.matmul_tflops * 1e12,
        args.bandwidth_tbs * 1e12,
        args.peak_tflops * 1e12,
    )
    path, overrides = split_config_args(args.args)
    return args, load_config(TrainConfig, path, overrides)


def main(argv: list[str]) -> int:
    parser = floor_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, default=None, help="a profile of the same step (JSON), to compare")
    args, cfg = parsed_floor_args(parser, argv)
    measured = None if args.profile is None else measured_profile(args.profile)
    report = step_floor(cfg, args.seq_len, args.matmul_flops, args.bandwidth, args.peak_flops, measured)
    print(json.dumps(report, indent=2) if args.json else floor_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
