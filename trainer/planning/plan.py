"""The planner behind ``python -m trainer plan`` (:mod:`trainer.commands.plan` is its command line).

Validates a config and sizes the run without training: the resolved config, the teacher and
student architectures and parameter counts, the layer map, the batch arithmetic and the FLOPs of
a distillation step. It reads only the teacher's ``config.json`` (``teacher=configs/teachers/
bert-base-uncased`` works offline): both models are instantiated on the meta device, which has
shapes but no storage, so a 1B-parameter teacher costs nothing. A config without a teacher
(masked-LM pretraining) plans the student alone, from ``student.model``'s ``config.json``; its
step is the student's forward and backward only.

The sequence length comes from the dataset manifest when ``data`` already exists, else from
``--seq-len``, else the teacher's (without one, the student's) maximum (at most 512).

``teacher_params`` and ``student_params`` count the encoder (embeddings + transformer layers; no
MLM head, no pooler), the convention of the published sizes (BERT-base 110M, DistilBERT 66M);
``teacher.params`` / ``student.params`` break them down and give the ``total`` with the heads.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
import yaml
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import PretrainedConfig, PreTrainedModel

from common.config import ConfigError, to_dict
from trainer.config import ObjectiveConfig, TrainConfig
from trainer.modeling import (
    base_config,
    build_on_meta,
    encoder_layers,
    freeze_all_but_head,
    load_teacher_config,
    mlm_head,
    student_config,
    student_layer_map,
    training_dtype,
)
from trainer.objective.distiller import (
    LOGIT_TERMS,
    TEACHER_TERMS,
    Distiller,
    active_weights,
    validate_against_teacher,
)
from trainer.objective.layer_distillation import layer_term_weights
from trainer.objective.masking import MaskedBatch, Positions, max_masked
from trainer.planning.cluster import Cluster, Sizing, checkpoint_bytes, cluster_plan
from trainer.runtime.data import read_manifest
from trainer.runtime.engine import deepspeed_config


# --------------------------------------------------------------------- parameter and FLOP arithmetic
def count_parameters(model: PreTrainedModel) -> dict[str, int]:
    """Parameter counts; ``encoder`` (embeddings + layers) follows the published-size convention.

    Published sizes (BERT-base 110M, DistilBERT 66M, DistilRoBERTa 82M) count the encoder: the
    MLM head is mostly tied to the word embeddings and the pooler is a fine-tuning add-on, so
    neither is in ``encoder``; ``total`` counts every distinct parameter of the model as built.
    """
    embeddings = sum(p.numel() for p in model.base_model.embeddings.parameters())
    layers = sum(p.numel() for p in encoder_layers(model).parameters())
    return {
        "encoder": embeddings + layers,
        "embeddings": embeddings,
        "layers": layers,
        "total": sum(p.numel() for p in model.parameters()),
    }


def encoder_flops_per_token(config: PretrainedConfig, seq_len: int) -> int:
    """Forward matmul FLOPs per token of the transformer layers (2 per multiply-add).

    Per layer: Q, K, V and output projections (4 H^2), the FFN (2 H F), and attention's
    ``Q K^T`` and ``A V`` (2 S H); embedding lookups, norms and softmax are not counted.
    """
    h, f = config.hidden_size, config.intermediate_size
    return config.num_hidden_layers * 2 * (4 * h * h + 2 * h * f + 2 * seq_len * h)


def head_flops_per_position(config: PretrainedConfig) -> int:
    """Forward FLOPs of the MLM head at one position: the H x H transform and the H x V decoder."""
    h = config.hidden_size
    return 2 * (h * h + h * config.vocab_size)


def distillation_flops_per_token(
    teacher_config: PretrainedConfig | None,
    student_config: PretrainedConfig,
    seq_len: int,
    teacher_forward: bool,
    teacher_head_fraction: float,
    student_head_fraction: float,
    encoder_trains: bool = True,
) -> dict[str, float]:
    """Model FLOPs per input token of one distillation step (what MFU is computed from).

    The teacher runs forward only (if any loss needs it; never without a teacher); the student forward and backward
    (backward = 2x forward), its encoder forward only when it is frozen (``student.trainable=head``: no
    gradient flows into it). Each MLM head runs at the given fraction of positions: the masked
    budget for masked-position losses, 1 for all-position logit losses, 0 when no loss needs it.
    """
    teacher = 0.0
    if teacher_forward:
        teacher = encoder_flops_per_token(teacher_config, seq_len) + teacher_head_fraction * head_flops_per_position(
            teacher_config
        )
    student_encoder = encoder_flops_per_token(student_config, seq_len) * (3 if encoder_trains else 1)
    student_head = 3 * student_head_fraction * head_flops_per_position(student_config)
    return {
        "teacher_forward": teacher,
        "student_forward_backward": student_encoder + student_head,
        "total": teacher + student_encoder + student_head,
    }


def describe(config: PretrainedConfig, model: PreTrainedModel) -> dict[str, Any]:
    """The architecture facts ``plan`` prints for a model."""
    return {
        "class": type(model).__name__,
        "model_type": config.model_type,
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "has_mlm_head": mlm_head(model) is not None,
        "params": count_parameters(model),
    }


def logit_fractions(objective: ObjectiveConfig, mask_probability: float, seq_len: int) -> dict[str, Any]:
    """Which passes a step runs and at what fraction of positions each MLM head runs (for FLOPs)."""
    weights = active_weights(objective)
    masked = max_masked(mask_probability, seq_len) / seq_len
    logits = any(name in weights for name in LOGIT_TERMS)
    at = 1.0 if objective.ce_positions == "all" else masked
    return {
        "teacher_forward": bool(layer_term_weights(objective)) or any(name in weights for name in TEACHER_TERMS),
        "teacher_head_fraction": at if logits else 0.0,
        "student_head_fraction": at if logits else masked if "mlm" in weights else 0.0,
    }


def step_flops_per_token(
    objective: ObjectiveConfig,
    teacher_config: PretrainedConfig | None,
    student_config: PretrainedConfig,
    mask_probability: float,
    seq_len: int,
    encoder_trains: bool = True,
) -> dict[str, float]:
    """Model FLOPs per token of one distillation step with this objective (what MFU is computed from);
    ``encoder_trains`` is false where ``student.trainable`` is ``head`` (no backward through the encoder)."""
    return distillation_flops_per_token(
        teacher_config,
        student_config,
        seq_len,
        **logit_fractions(objective, mask_probability, seq_len),
        encoder_trains=encoder_trains,
    )


# ------------------------------------------------------------------------------- activation memory
class _FlashAttentionSaves(torch.autograd.Function):
    """SDPA as the flash kernel keeps it for backward: q, k, v, the output and a float32 log-sum-exp per query.

    On the meta device SDPA takes its math path, which saves the ``[seq, seq]`` score matrices that no
    GPU run of a packed batch keeps (attention dropout included: flash keeps only its random state).
    ``observe``, when given, is told of each call and its backward, with q, k and v: what the kernel reads.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, observe: Any) -> torch.Tensor:
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        ctx.observe = observe
        if observe is not None:
            observe("forward", q, k, v)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, _, _ = ctx.saved_tensors
        if ctx.observe is not None:
            ctx.observe("backward", q, k, v)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


@contextlib.contextmanager
def flash_attention_saves(observe: Callable[..., None] | None = None) -> Iterator[None]:
    """Within: ``F.scaled_dot_product_attention`` (what Hugging Face's SDPA attention calls) saves as flash does;
    ``observe(pass, q, k, v)`` is called on each ``"forward"`` and ``"backward"`` (``benchmarks/step_floor.py``)."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = lambda q, k, v, *args, **kwargs: _FlashAttentionSaves.apply(q, k, v, observe)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def saved_activation_bytes(distiller: Distiller, batch: MaskedBatch) -> int:
    """Bytes autograd keeps for the backward of one training forward (weights excluded), counted as it saves
    them: each tensor once, a view as its base. With meta tensors this costs no memory and no compute."""
    weights = {id(p) for p in distiller.parameters()}
    if distiller.teacher is not None:
        weights |= {id(p) for p in distiller.teacher.parameters()}
    saved: dict[int, torch.Tensor] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor if tensor._base is None else tensor._base
        if id(base) not in weights:
            saved[id(base)] = base  # held, so that no id is reused while counting
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        distiller(batch, None)
    return nbytes(saved.values())


def meta_distiller(
    cfg: TrainConfig, teacher_config: PretrainedConfig | None, s_config: PretrainedConfig
) -> tuple[Distiller, PreTrainedModel | None]:
    """The run's Distiller and teacher on the meta device, in ``deepspeed.precision`` as the engine holds them."""
    dtype = training_dtype(cfg.deepspeed.precision)
    teacher = None if teacher_config is None else build_on_meta(teacher_config).to(dtype).eval()
    student = build_on_meta(s_config).to(dtype).train()
    if cfg.student.trainable == "head":
        freeze_all_but_head(student)
    with torch.device("meta"):
        return Distiller(student, teacher, cfg.objective).to(dtype), teacher


def output_bytes(cfg: TrainConfig, teacher_config: PretrainedConfig | None, ds: dict[str, Any]) -> tuple[int, int]:
    """(one checkpoint, the exported student): the bytes a run writes into ``output_dir``, from its models on the
    meta device, so that the start of a run can check for room before any weight is loaded. The checkpoint is
    :func:`~trainer.planning.cluster.checkpoint_bytes` (``plan``'s; within 2 % of a real save); the export is
    the student's float32 weights (``trainer export`` writes the consolidated fp32 master weights)."""
    distiller, _ = meta_distiller(
        cfg, teacher_config, student_config(cfg.student, base_config(cfg.student, teacher_config))
    )
    return checkpoint_bytes(distiller, ds), 4 * sum(p.numel() for p in distiller.student.parameters())


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensors made under it that are still alive, and their peak. Each storage counts once,
    from the op that makes it until its last tensor (or view) goes: torch keeps one Python object per storage
    while it lives, so a finalizer on it fires when the memory would be freed. Tensors made before (weights,
    the batch) are never counted."""

    def __init__(self, existing: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.alive = {id(t.untyped_storage()) for t in existing}
        self.bytes = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and id(storage := tensor.untyped_storage()) not in self.alive:
                self.alive.add(id(storage))
                self.bytes += storage.nbytes()
                weakref.finalize(storage, self.freed, id(storage), storage.nbytes())
                self.made(id(storage), storage.nbytes(), func)
                if self.bytes > self.peak:
                    self.peak = self.bytes
                    self.peaked()
        return out

    def freed(self, key: int, nbytes: int) -> None:
        self.alive.discard(key)
        self.bytes -= nbytes

    def made(self, key: int, nbytes: int, func: Any) -> None:
        """A storage counted, made by ``func``: for a subclass that notes who holds the memory."""

    def peaked(self) -> None:
        """A new peak, just reached: for a subclass that keeps what was alive then."""


def meta_batch(micro_batch_size: int, mask_probability: float, seq_len: int) -> MaskedBatch:
    """A micro-batch of packed sequences with the masker's largest masked-position budget, on the meta device."""
    budget = max_masked(mask_probability, seq_len)
    with torch.device("meta"):
        ids = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
        index = torch.zeros(micro_batch_size, budget, dtype=torch.long)
        positions = Positions(index=index, valid=torch.ones_like(index, dtype=torch.bool))
        return MaskedBatch(ids, ids, positions, index)


def activation_bytes(distiller: Distiller, micro_batch_size: int, mask_probability: float, seq_len: int) -> int:
    """Bytes saved for backward by one micro-batch of packed sequences, counted on the meta device through
    the real Distiller, with flash attention's saves (:func:`flash_attention_saves`).

    What the activations hold at the end of the forward; :func:`peak_activation_bytes` adds what the step
    makes and frees around them. A padded batch (which takes the memory-efficient kernel and an attention
    mask) keeps a little more.
    """
    with flash_attention_saves():
        return saved_activation_bytes(distiller, meta_batch(micro_batch_size, mask_probability, seq_len))


def peak_activation_bytes(distiller: Distiller, micro_batch_size: int, mask_probability: float, seq_len: int) -> int:
    """The most bytes one micro-batch's forward and backward hold at once beyond the weights, through the real
    Distiller on the meta device (:class:`LiveBytes`, flash attention's saves): the saved activations
    (:func:`activation_bytes`) plus what is alive beside them at the worst moment: for the presets here, the
    losses' float32 temporaries at the end of the forward. Gradients are dropped as they are made: ZeRO-1
    and -2 move them into their buckets, which :func:`memory_per_rank` counts. The saved activations alone
    fell short of the peaks measured on a GPU (docs/log/benchmarks.md, "Peak memory against the plan")."""
    batch = meta_batch(micro_batch_size, mask_probability, seq_len)
    weights = [*distiller.parameters(), *distiller.buffers()]
    if distiller.teacher is not None:
        weights += [*distiller.teacher.parameters(), *distiller.teacher.buffers()]
    batch_tensors = [batch.input_ids, batch.labels, batch.targets, batch.positions.index, batch.positions.valid]
    with dropping_gradients(distiller), flash_attention_saves(), LiveBytes([*weights, *batch_tensors]) as live:
        distiller(batch, None)["loss"].backward()
    return live.peak


@contextlib.contextmanager
def dropping_gradients(module: torch.nn.Module) -> Iterator[None]:
    """Within the block, each trainable parameter's gradient is dropped as soon as it is accumulated: the
    step's peak without the gradients, which ZeRO-1 and -2 move into buckets counted apart."""
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        for p in module.parameters()
        if p.requires_grad
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


# ----------------------------------------------------------------------- what each rank holds, by part
def memory_per_rank(
    distiller: Distiller, teacher: PreTrainedModel | None, ds: dict[str, Any], world_size: int, activations: int
) -> dict[str, int]:
    """Bytes one rank's accelerator holds, by part, as DeepSpeed (0.19) lays out the engine for ``ds``.

    ``distiller`` and ``teacher`` in the training dtype (:func:`meta_distiller`); Ψ is the engine's trainable
    parameter count (student + learned projections), b the training dtype's bytes, N the world size:

    * ``teacher``: its full weights on every rank, never partitioned (``trainer.objective.distiller``);
    * ``student_weights``: b·Ψ; ZeRO-3 keeps b·Ψ/N, plus whole copies of the parameters under
      ``stage3_param_persistence_threshold`` elements (not worth gathering). Frozen parameters
      (``student.trainable=head``) are held the same way but have no optimizer states or gradients;
    * ``optimizer_states``: 12·Ψ/N, a float32 master copy and AdamW's two moments, partitioned by
      every ZeRO stage; 0 here with ``offload_optimizer`` (they live in CPU memory);
    * ``gradient_partition``: ZeRO-3's b·Ψ/N, held for the whole run; 0 for ZeRO-1 and -2, which reduce
      gradients as backward produces them (see below);
    * ``buckets``: with ``contiguous_gradients`` (DeepSpeed's default), the staging buffers of the
      gradient reduction, ``reduce_bucket_size`` elements of b bytes each: ZeRO-1 and -2 allocate one
      (two with ``overlap_comm``) for each backward (ZeRO-1 keeps it between the micro-steps of an
      accumulation), ZeRO-3 one for the whole run. Not the model's size: a bucket of 5e8 elements is a
      GB whatever the student;
    * ``activations``: the most one micro-batch's forward and backward hold at once
      (:func:`peak_activation_bytes`): what it saves for backward and the losses' temporaries beside it.

    ``total`` is their sum, what the peak reaches at the end of a forward. Not counted: the 16-bit
    gradients of ZeRO-1 and -2 outside the buckets (up to about b·Ψ between the micro-steps of an
    accumulation), their float32 partition during the optimizer step (4·Ψ/N, after the activations are
    freed), ZeRO-3's gathered layers, and the allocator's slack. ``tests/trainer/test_plan.py`` checks the
    held parts against the tensors a real engine on two CPU ranks keeps, stage by stage.
    """
    zero = DeepSpeedZeroConfig(**ds.get("zero_optimization", {}))
    params = [p for p in distiller.parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in params)
    frozen = sum(p.numel() for p in distiller.parameters() if not p.requires_grad)  # student.trainable=head
    b = params[0].element_size()
    per_rank = math.ceil(trainable / world_size)
    if zero.stage == 3:  # partitions every parameter, frozen or not
        persistent = sum(p.numel() for p in distiller.parameters() if p.numel() < zero.param_persistence_threshold)
        student_weights = b * (per_rank + math.ceil(frozen / world_size) + persistent)
        gradient_partition = b * per_rank
    else:
        student_weights, gradient_partition = b * (trainable + frozen), 0
    offloaded = zero.offload_optimizer is not None and zero.offload_optimizer.device != "none"
    buffers = 0
    if zero.contiguous_gradients:
        buffers = 2 if zero.overlap_comm and zero.stage < 3 else 1
    parts = {
        "teacher": 0 if teacher is None else nbytes([*teacher.parameters(), *teacher.buffers()]),
        "student_weights": student_weights + nbytes(distiller.buffers()),
        "optimizer_states": 0 if offloaded else 12 * per_rank,
        "gradient_partition": gradient_partition,
        "buckets": b * zero.reduce_bucket_size * buffers,
        "activations": activations,
    }
    return {**parts, "total": sum(parts.values())}


# ----------------------------------------------------------------------------------------- the plan
def build_plan(
    cfg: TrainConfig, world_size: int, seq_len: int | None = None, sizing: Sizing | None = None, preset: str = ""
) -> dict[str, Any]:
    """Everything ``plan`` reports, as plain data (the ``--json`` output); ``teacher`` and ``teacher_params``
    are None without a teacher. ``sizing``: the cluster to size the run for (by default ``world_size`` GPUs
    in one node, the assumed bandwidths); ``preset``: the config's name, which finds the measured
    single-GPU throughput in the committed GPU campaign."""
    teacher_config = None if cfg.teacher is None else load_teacher_config(cfg.teacher)
    validate_against_teacher(cfg, teacher_config)
    accumulation = cfg.gradient_accumulation_steps(world_size)
    manifest = read_manifest(cfg.data)
    s_config = student_config(cfg.student, base_config(cfg.student, teacher_config))
    # The model that reads the dataset's ids first: the teacher, else the student.
    reader, reader_config = ("teacher", teacher_config) if teacher_config is not None else ("student", s_config)

    if manifest is not None:
        seq_len, seq_source = manifest["max_seq_len"], f"{cfg.data}/manifest.json"
        vocab = manifest["tokenizer"]["vocab_size"]
        if vocab > reader_config.vocab_size:
            raise ConfigError(
                f"data: the dataset's tokenizer has {vocab} ids but the {reader} only {reader_config.vocab_size} "
                "embeddings: it was tokenized for another model"
            )
    elif seq_len is not None:
        seq_source = "--seq-len"
    else:
        seq_len = min(512, reader_config.max_position_embeddings)
        seq_source = f"{reader} maximum (no dataset yet)"

    # One set of meta models for everything below: the descriptions, the layer terms, the memory.
    distiller, meta_teacher = meta_distiller(cfg, teacher_config, s_config)
    teacher = None if meta_teacher is None else describe(teacher_config, meta_teacher)
    student = describe(s_config, distiller.student)
    layers = distiller.layer_distillation
    flops = step_flops_per_token(
        cfg.objective, teacher_config, s_config, cfg.masking.probability, seq_len, cfg.student.trainable == "all"
    )
    shape = (cfg.micro_batch_size, cfg.masking.probability, seq_len)
    saved, peak = activation_bytes(distiller, *shape), peak_activation_bytes(distiller, *shape)
    ds = deepspeed_config(cfg, world_size)
    memory = memory_per_rank(distiller, meta_teacher, ds, world_size, peak)
    tokens_per_step = cfg.global_batch_size * seq_len
    plan: dict[str, Any] = {
        "config": to_dict(cfg),
        "teacher": None if teacher is None else {"name_or_path": cfg.teacher, **teacher},
        "student": {
            "init": cfg.student.init,
            "model": cfg.student.model,
            "trainable": cfg.student.trainable,
            **student,
        },
        "teacher_params": None if teacher is None else teacher["params"]["encoder"],
        "student_params": student["params"]["encoder"],
        "layer_map": student_layer_map(cfg.student, teacher_config.num_hidden_layers)
        if cfg.student.init == "from_teacher"
        else None,
        "layer_distillation": {
            "weights": layers.weights,
            "maps": layers.layer_maps(),  # (student layer, teacher layer) pairs per family
            "projection_params": sum(p.numel() for p in layers.parameters()),  # trained, never exported
        },
        "batch": {
            "micro_batch_size": cfg.micro_batch_size,
            "gradient_accumulation_steps": accumulation,
            "world_size": world_size,
            "global_batch_size": cfg.global_batch_size,
            "seq_len": seq_len,
            "seq_len_source": seq_source,
            "tokens_per_step": tokens_per_step,
        },
        "flops_per_token": flops,
        # per rank and micro-batch; gradient accumulation adds none (one micro-batch is alive at a time)
        "activation_gib": saved / 2**30,
        "activation_peak_gib": peak / 2**30,  # memory_gib's activations
        "memory_gib": {part: n / 2**30 for part, n in memory.items()},
        "flops_per_step": flops["total"] * tokens_per_step,
        "flops_total": flops["total"] * tokens_per_step * cfg.max_steps,
        "data": {"path": cfg.data, "found": manifest is not None},
    }
    train_tokens = None
    if manifest is not None:
        train_samples = manifest["splits"]["train"]["samples"]
        plan["data"]["train_samples"] = train_samples
        plan["data"]["epochs"] = cfg.max_steps * cfg.global_batch_size / max(train_samples, 1)
        train_tokens = train_samples * seq_len
    plan["cluster"] = cluster_plan(
        sizing or Sizing(Cluster(gpus_per_node=world_size)),
        distiller,
        ds,
        (cfg.global_batch_size, cfg.micro_batch_size, seq_len),
        preset,
        cfg.max_steps,
        cfg.checkpoint.every_steps,
        train_tokens,
    )
    return plan


def millions(n: float) -> str:
    return f"{n / 1e6:,.1f}M"


def render(plan: dict[str, Any]) -> str:
    """The human-readable report."""
    lines = ["# resolved config", yaml.safe_dump(plan["config"], sort_keys=False).rstrip(), ""]
    if plan["teacher"] is None:
        lines.append("teacher: none (masked-LM pretraining: L_mlm alone)")
    for role in ("teacher", "student"):
        m = plan[role]
        if m is None:
            continue
        params = m["params"]
        lines.append(
            f"{role}: {m['class']} {m['num_layers']} layers x {m['hidden_size']} hidden, "
            f"{m['num_attention_heads']} heads, FFN {m['intermediate_size']}, vocab {m['vocab_size']}, "
            f"MLM head: {'yes' if m['has_mlm_head'] else 'no'}"
        )
        lines.append(
            f"  params: {millions(params['encoder'])} encoder ({params['encoder']:,}: embeddings "
            f"{params['embeddings']:,} + layers {params['layers']:,}); {params['total']:,} in total with heads"
        )
    if plan["student"]["trainable"] == "head":
        lines.append("student.trainable=head: the encoder is frozen; only the MLM head's own weights train")
    if plan["layer_map"] is not None:
        lines.append(f"layer map (student layer i <- teacher layer): {plan['layer_map']}")
    layers = plan["layer_distillation"]
    if layers["weights"]:
        terms = ", ".join(f"{weight:g}·{name}" for name, weight in layers["weights"].items())
        lines.append(f"layer terms: {terms}; maps (student layer, teacher layer): {layers['maps']}")
        lines.append(f"  learned projections: {layers['projection_params']:,} params (trained, not exported)")
    b, memory = plan["batch"], plan["memory_gib"]
    lines += [
        f"batch: micro {b['micro_batch_size']} x accumulation {b['gradient_accumulation_steps']} x world size "
        f"{b['world_size']} = global {b['global_batch_size']} sequences of {b['seq_len']} tokens "
        f"({b['seq_len_source']}) = {b['tokens_per_step']:,} tokens per step",
        f"FLOPs per token: teacher forward {plan['flops_per_token']['teacher_forward']:.3e} + student forward/backward "
        f"{plan['flops_per_token']['student_forward_backward']:.3e} = {plan['flops_per_token']['total']:.3e}"
        + (" (no teacher: the student's forward and backward only)" if plan["teacher"] is None else ""),
        f"FLOPs per step: {plan['flops_per_step']:.3e}; whole run ({plan['config']['max_steps']} steps): "
        f"{plan['flops_total']:.3e}",
        f"activations: {plan['activation_peak_gib']:.2f} GiB per rank at the peak, {plan['activation_gib']:.2f} of "
        f"them saved for backward (one micro-batch of {b['micro_batch_size']} x {b['seq_len']}, flash attention)",
        f"memory per rank: {memory['total']:.2f} GiB = "
        + " + ".join(f"{part.replace('_', ' ')} {gib:.2f}" for part, gib in memory.items() if part != "total")
        + f" ({plan['config']['deepspeed']['config']}, {b['world_size']} rank(s); not counted: gradients outside "
        "the buckets, the allocator's slack)",
    ]
    data = plan["data"]
    if data["found"]:
        lines.append(f"data: {data['path']}: {data['train_samples']:,} train sequences, {data['epochs']:.2f} epochs")
    else:
        lines.append(f"data: {data['path']} has no manifest.json yet (not checked)")
    return "\n".join(lines + render_cluster(plan["cluster"], plan["config"]["deepspeed"], b))


def gb(n: float) -> str:
    return f"{n / 1e9:,.3g} GB"


def span(pair: list[float] | tuple[float, float], fmt: str, scale: float = 1.0) -> str:
    """A (best, worst) pair as one figure when they agree to the shown precision, else as a range."""
    low, high = sorted(x * scale for x in pair)
    return format(low, fmt) if format(low, fmt) == format(high, fmt) else f"{format(low, fmt)}-{format(high, fmt)}"


def render_cluster(section: dict[str, Any], deepspeed: dict[str, Any], batch: dict[str, Any]) -> list[str]:
    """The cluster lines of the report: each figure with what it rests on (measured, given or assumed)."""
    layout, inputs = section["layout"], section["inputs"]
    where = f"{layout['world_size']} rank(s) on {layout['nodes']} node(s) x {layout['gpus_per_node']}"
    lines = [f"communication per optimizer step, per rank ({deepspeed['config']}, {deepspeed['precision']}, {where}):"]
    if not section["communication"]:
        lines[-1] += " none (one rank)"
    for c in section["communication"]:
        lines.append(
            f"  {c['op']:<23} {c['carries']:<48} {gb(c['message_bytes'])} handed to DeepSpeed, "
            f"{gb(c['link_bytes'])} through each link"
        )

    def said(key: str, text: str) -> str:
        return f"{text} ({inputs[key]['source']})"

    if "missing" in section:
        return [*lines, f"step time: {section['missing']}"]
    step, gpu = section["step"], inputs["gpu_tokens_per_s"]
    link = "intra_node_gbs" if layout["nodes"] == 1 else "inter_node_gbs"
    low, high = inputs["overlap"]["value"]
    lines += [
        f"single GPU: {gpu['value']:,.0f} tokens/s ({gpu['source']})",
        f"step: compute {step['compute_s'] * 1e3:,.1f} ms + communication {step['comm_s'] * 1e3:,.1f} ms at "
        + said(link, f"{inputs[link]['value']:g} GB/s")
        + ", "
        + said("overlap", f"{low:.0%}-{high:.0%} of the overlappable part hidden")
        + f" = {span(step['seconds'], ',.1f', 1e3)} ms: {span(step['tokens_per_s'], ',.0f')} tokens/s, "
        f"{span(step['efficiency'], '.0%')} of linear",
        f"scaling ({layout['gpus_per_node']} GPU(s) per node, global batch {batch['global_batch_size']} x "
        f"{batch['seq_len']}; efficiency against the single GPU times the GPUs):",
        "  nodes   GPUs  accumulation   step ms        tokens/s               efficiency",
    ]
    scaling = section["scaling"]
    for row in scaling["rows"]:
        lines.append(
            f"  {row['nodes']:>5} {row['gpus']:>6} {row['accumulation']:>13}   {span(row['step_s'], ',.1f', 1e3):<14} "
            f"{span(row['tokens_per_s'], ',.0f'):<22} {span(row['efficiency'], '.0%')}"
        )
    knees = scaling["knee_nodes"]
    last = scaling["rows"][-1]["nodes"] if scaling["rows"] else 0
    knee = [f"{k} node(s)" if k is not None else f"none up to {last} node(s) (the batch allows no more)" for k in knees]
    lines.append(
        f"knee (doubling the nodes adds less than half their linear share): {knee[0]} with the most overlap, "
        f"{knee[1]} with the least"
    )
    run, ckpt = section["run"], section["run"]["checkpoint"]
    cost = (
        ""
        if run["cost"] is None
        else f", cost {span(run['cost'], ',.0f')} at "
        + said("gpu_hour_price", f"{inputs['gpu_hour_price']['value']:g} per GPU-hour")
    )
    lines.append(
        f"run: {run['steps']:,} steps ({run['budget']}): wall-clock {span(run['wall_s'], ',.2f', 1 / 3600)} h, "
        f"{span(run['gpu_hours'], ',.1f')} GPU-hours{cost}; checkpoints: {gb(ckpt['bytes'])} each, "
        f"{ckpt['save_s']:,.1f} s per save at "
        + said("storage_gbs", f"{inputs['storage_gbs']['value']:g} GB/s")
        + f", {ckpt['saves']} saves = {span(ckpt['share'], '.1%')} of the run"
    )
    return lines
