"""The floor under the compiled step: the bytes the kernels ``torch.compile`` makes for it move, by Inductor's count.

    python benchmarks/compiled_floor.py CONFIG.yaml [key=value ...] [--seq-len 512] [--micro-batches 32,256]
        --matmul-tflops T --bandwidth-tbs B [--peak-tflops P] [--device cpu|cuda] [--json]

``benchmarks/step_floor.py`` counts the eager step op by op: its floor is what the step would take if every
kernel it launches ran at its roofline. Compile (``compile=true``, :meth:`Distiller.compile_models`) launches
other kernels: it fuses chains of memory-bound ops (a residual add, dropout and LayerNorm; the losses' upcast,
temperature, log-softmax and KL terms) into one kernel each, which reads its inputs and writes its outputs
once. Inductor knows every kernel it generates and every buffer each one reads and writes
(``GraphLowering.count_bytes``, what its ``inductor_metrics`` log reports). This compiles the real Distiller
as a training run does (the same pieces: each model's embeddings, layer stack and head, the layer methods,
the losses), runs one forward and backward, and reads that count kernel by kernel:

* matmuls (Inductor leaves them to the vendor's kernels: ``mm``, ``addmm``, ``bmm``): their FLOPs from their
  shapes and their bytes from Inductor, floored as in ``step_floor.py``;
* attention: one kernel each way, as on a GPU. On CUDA it is SDPA's own (flash, cuDNN or memory-efficient,
  whichever a packed batch takes). On a CPU, Inductor would take the math path for a training step's
  attention, with its ``[seq, seq]`` score matrices, so the count runs it as an opaque stand-in
  (:func:`opaque_attention`) that reads and writes what a fused GPU kernel does;
* every kernel Inductor generated, by its bytes alone, named after the ops it fuses (``fused_gelu_view``) and
  in ``trainer.runtime.profiling.op_category``'s category for that name (a residual add, dropout and LayerNorm
  fused are "norms and activations", the losses' kernels "softmax and losses"), so that each category stands
  beside the eager count's; other library calls Inductor keeps (the random seeds of dropout) as "other";
* the optimizer as ``step_floor.py`` counts it (``distill_step.py``'s fused AdamW is not compiled).

Not counted: the few eager ops between the compiled pieces (the gathers at the masked positions; autograd's
sum of the gradients that two compiled losses send to the same logits, 0.45 GB of ``add`` at 32 x 512 for
``distilbert-base`` in ``step_floor.py``'s count), and the masking. So the floor is a little low.

On a CPU it is an estimate for a GPU: Inductor's CPU backend generates C++ loops, not Triton kernels, and
its fusion differs in places (it has an outer-loop fusion of its own), so the bytes are what compile could
reach rather than what a GPU compile measures. On CUDA it is the compiled step's true floor, to set beside its
measured time. Either way each micro-batch asked for is compiled and counted as it is (the CPU estimate at
distilbert-base's sizes is answered: docs/log/benchmarks.md; its line through two small compiles is retired,
benchmarks/README.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.step_floor import (
    OpCost,
    floor_markdown,
    floor_parser,
    floor_report,
    model_configs,
    model_flops,
    optimizer_costs,
    parsed_floor_args,
    trainable_parameters,
)
from common.cli import run_cli
from common.config import ConfigError
from trainer.config import TrainConfig
from trainer.modeling import build_student, model_from_config, training_dtype
from trainer.objective.distiller import Distiller
from trainer.objective.masking import MaskedBatch, Positions, max_masked
from trainer.runtime.profiling import op_category

MATMUL_KERNELS = ("mm", "addmm", "bmm")  # Inductor's extern_kernels.<name>
NAME_LENGTH = 72  # a fused kernel's name, cut to fit a table


# ------------------------------------------------------------------------------- attention, opaque on a CPU
@torch.library.custom_op("compiled_floor::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention as a fused kernel's interface: the output and a float32 log-sum-exp per query."""
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    logsumexp = scores.logsumexp(-1)
    out = attention_output(q, v)
    return out.copy_((scores - logsumexp[..., None]).exp() @ v.float()), logsumexp


def attention_output(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, queries, head size]`` laid out as ``[batch, queries, heads, head size]``, as flash writes
    it: the layout the attention module's ``transpose(1, 2).contiguous()`` then finds contiguous, with no copy."""
    batch, heads, queries, _ = q.shape
    return q.new_empty(batch, queries, heads, v.shape[-1]).transpose(1, 2)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_output(q, v), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("compiled_floor::attention_backward", mutates_args=())
def attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q's, k's and v's gradients from what the forward kept, as flash's backward reads it: the probabilities
    recomputed from q, k and the log-sum-exp, and each query's ``rowsum(grad * out)`` from the output."""
    qf, kf, vf, gf = (t.float() for t in (q, k, v, grad))
    probs = ((qf @ kf.transpose(-2, -1)) * scale - logsumexp[..., None]).exp()
    grad_scores = probs * (gf @ vf.transpose(-2, -1) - (gf * out.float()).sum(-1, keepdim=True))
    grads = (grad_scores @ kf * scale, grad_scores.transpose(-2, -1) @ qf * scale, probs.transpose(-2, -1) @ gf)
    # each gradient laid out as its input (views of the projections' outputs), as the fused kernels write them
    return tuple(torch.empty_like(t).copy_(g) for g, t in zip(grads, (q, k, v), strict=True))  # type: ignore[return-value]


@attention_backward.register_fake
def _(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _keep_for_backward(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale = scale


def _attention_grads(ctx: Any, grad: torch.Tensor, _logsumexp_grad: Any) -> tuple[Any, ...]:
    return (*attention_backward(grad, *ctx.saved_tensors, ctx.scale), None)


attention.register_autograd(_attention_grads, setup_context=_keep_for_backward)


@contextlib.contextmanager
def opaque_attention() -> Iterator[None]:
    """Within: ``F.scaled_dot_product_attention`` (Hugging Face's SDPA attention) is :func:`attention`, which
    Inductor leaves as one call each way. Packed batches only (no mask); dropout on the attention weights is
    left out, as a fused kernel keeps it in registers and moves no bytes for it."""
    original = F.scaled_dot_product_attention

    def stand_in(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if attn_mask is not None:
            raise ConfigError("compiled_floor counts packed batches (no attention mask)")
        scale = kwargs.get("scale") or 1 / math.sqrt(q.shape[-1])
        return attention(q, k, v, scale)[0]

    F.scaled_dot_product_attention = stand_in
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


# ------------------------------------------------------------------------------- Inductor's count
@contextlib.contextmanager
def inductor_counts() -> Iterator[list[tuple[Any, int]]]:
    """Within: every graph Inductor compiles is compiled afresh (no cache hit, which would skip the count) and
    its kernels' bytes are recorded; yields the list of (scheduler node, bytes) it fills."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor import metrics

    # The count runs where this logger is enabled for INFO (compile_fx.py); quiet, as its records are long.
    log = logging.getLogger("torch._inductor.compile_fx.__inductor_metrics")
    level, propagate = log.level, log.propagate
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(quiet := logging.NullHandler())
    metrics.reset()
    nodes: list[tuple[Any, int]] = []
    try:
        with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
            yield nodes
        nodes += [(node, words * 4) for node, words in metrics.nodes_num_elem]  # count_bytes stores bytes // 4
    finally:
        log.removeHandler(quiet)
        log.setLevel(level)
        log.propagate = propagate
        metrics.reset()


def size_of(buffer: Any) -> list[int]:
    return [int(s) for s in buffer.get_size()]


def node_cost(node: Any, nbytes: int) -> OpCost:
    """One Inductor kernel (a generated one, or a library call) as an :class:`OpCost` in ``step_floor.py``'s
    categories."""
    from torch._inductor.scheduler import ExternKernelSchedulerNode
    from torch._inductor.utils import get_fused_kernel_name

    if not isinstance(node, ExternKernelSchedulerNode):
        name = get_fused_kernel_name(node.get_nodes(), "original_aten")  # fused_<the ops it was made from>
        name = name if len(name) <= NAME_LENGTH else name[: NAME_LENGTH - 3] + "..."
        return OpCost(name, op_category(name), 0, nbytes)
    kernel = str(getattr(node.node, "python_kernel_name", None) or type(node.node).__name__)
    short = kernel.rsplit(".", 1)[-1] if kernel.startswith("extern_kernels.") else kernel
    if short in MATMUL_KERNELS:
        left = node.node.inputs[-2]  # addmm(bias, a, b), mm(a, b), bmm(a, b): a is [..., M, K]
        return OpCost(f"aten::{short}", "matmul", 2 * math.prod(size_of(node.node)) * size_of(left)[-1], nbytes)
    if "compiled_floor.attention" in kernel or "scaled_dot_product" in kernel:
        backward = "backward" in kernel  # its inputs start with the output's gradient, then q, k, v
        q, k, v = (size_of(t) for t in node.node.inputs[int(backward) : int(backward) + 3])
        forward_flops = 2 * math.prod(q[:-2]) * q[-2] * k[-2] * (q[-1] + v[-1])
        return OpCost(kernel, "attention", forward_flops * (2 if backward else 1), nbytes)
    return OpCost(kernel, "other", 0, nbytes)


def kernel_costs(nodes: list[tuple[Any, int]]) -> list[OpCost]:
    """What :func:`inductor_counts` recorded, as :class:`OpCost` rows."""
    return [node_cost(node, nbytes) for node, nbytes in nodes]


def count_batch(cfg: TrainConfig, seq_len: int, micro_batch: int, device: torch.device) -> list[OpCost]:
    """Inductor's kernels for one compiled forward and backward of ``cfg``'s Distiller at ``micro_batch`` x
    ``seq_len`` (random weights, a packed batch with every masked-position slot used), in order."""
    teacher_config = model_configs(cfg)[0]
    torch._dynamo.reset()  # a fresh compile: the count is taken while compiling
    torch.manual_seed(cfg.seed)
    teacher = None if teacher_config is None else model_from_config(teacher_config).requires_grad_(False).eval()
    student = build_student(cfg.student, teacher)
    dtype = training_dtype(cfg.deepspeed.precision)
    distiller = Distiller(student, teacher, cfg.objective).to(device, dtype).train()
    if teacher is not None:
        teacher.to(device, dtype)
    distiller.compile_models()
    generator = torch.Generator().manual_seed(cfg.seed)
    vocab = student.config.vocab_size
    ids = torch.randint(vocab, (micro_batch, seq_len), generator=generator)
    budget = max_masked(cfg.masking.probability, seq_len)
    index = torch.stack([torch.randperm(seq_len, generator=generator)[:budget] for _ in range(micro_batch)])
    targets = torch.randint(vocab, (micro_batch, budget), generator=generator)
    batch = MaskedBatch(ids, ids, Positions(index, torch.ones_like(index, dtype=torch.bool)), targets).to(device)
    stand_in = opaque_attention() if device.type == "cpu" else contextlib.nullcontext()
    with stand_in, inductor_counts() as nodes:
        distiller(batch, None)["loss"].backward()
    return kernel_costs(nodes)


def compiled_report(
    kernels: list[OpCost],
    trainable: int,
    model_flops: float,
    matmul_flops: float,
    bandwidth: float,
    peak_flops: float,
    weight_bytes: int = 2,
) -> dict[str, Any]:
    """The compiled step's floor: its kernels, then the optimizer over ``trainable`` parameters (not compiled:
    ``step_floor.optimizer_costs``), against ``model_flops`` (``plan``'s, for the same micro-batch)."""
    ops = kernels + optimizer_costs(trainable, weight_bytes)
    return floor_report(ops, matmul_flops, bandwidth, model_flops, peak_flops, step="compiled")


def compiled_floor(
    cfg: TrainConfig,
    seq_len: int,
    micro_batches: list[int],
    matmul_flops: float,
    bandwidth: float,
    peak_flops: float,
    device: torch.device,
) -> dict[int, dict[str, Any]]:
    """Per micro-batch: :func:`count_batch`, then :func:`compiled_report` against ``plan``'s model FLOPs."""
    trainable, weight_bytes = trainable_parameters(cfg)
    reports = {}
    for micro in micro_batches:
        kernels = count_batch(cfg, seq_len, micro, device)
        flops = model_flops(cfg, seq_len, micro)
        report = compiled_report(kernels, trainable, flops, matmul_flops, bandwidth, peak_flops, weight_bytes)
        reports[micro] = {**report, "micro_batch_size": micro, "seq_len": seq_len, "counted_on": device.type}
    return reports


def main(argv: list[str]) -> int:
    parser = floor_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", default=None, help="comma-separated sizes (default: the config's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args, cfg = parsed_floor_args(parser, argv)
    try:
        micro_batches = [int(b) for b in args.micro_batches.split(",")] if args.micro_batches else []
    except ValueError:
        raise ConfigError(f"--micro-batches: {args.micro_batches!r} is not a comma-separated list of sizes") from None
    if any(b < 1 for b in micro_batches):
        raise ConfigError("--micro-batches: each size must be >= 1")
    device = torch.device(args.device)
    micro_batches = micro_batches or [cfg.micro_batch_size]
    reports = compiled_floor(
        cfg, args.seq_len, micro_batches, args.matmul_flops, args.bandwidth, args.peak_flops, device
    )
    if args.json:
        print(json.dumps(list(reports.values()), indent=2))
        return 0
    for micro, report in reports.items():
        print(f"\nThe compiled step at {micro} x {args.seq_len} (counted on {args.device}):\n")
        print(floor_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
