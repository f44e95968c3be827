"""The trainer's typed config: one YAML preset in ``configs/`` plus ``key=value`` overrides.

The top-level keys users override most (``teacher``, ``data``, ``output_dir``, ``max_steps``,
``global_batch_size``, ``micro_batch_size``, ``seed``) sit at the root; everything else is
grouped by the component that reads it. Each section is validated on load, before any model
or data is touched.

``teacher: null`` turns distillation into masked-LM pretraining with the same machinery: the
student comes from ``student.model`` (an architecture or a pretrained model) and is trained with
L_mlm alone (:meth:`TrainConfig.validate_without_teacher`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import ClassVar, Literal

from common.config import require
from trainer.tracking.config import MlflowConfig


@dataclasses.dataclass
class StudentConfig:
    """How the model being trained (the student) is made.

    ``from_teacher``: same width as the teacher, layers copied from ``teacher_layers``
    (default: every other teacher layer, DistilBERT's [0,2,4,7,9,11] for 12 layers).
    ``random``: an explicit architecture, random init. Its base is ``model``'s config when set
    (a Hugging Face model directory or hub id; only ``config.json`` is read), else the teacher's;
    any field left unset is the base's.
    ``pretrained``: the weights of ``model``, trained further (a checkpoint without a masked-LM
    head gets a fresh one). This is how an existing model is pretrained on a new domain.

    ``trainable``: ``all`` trains the whole student; ``head`` only its masked-LM head's own weights
    (the transform and the output bias; the decoder matrix is tied to the word embeddings and stays),
    with the encoder frozen exactly as loaded. With ``init=pretrained`` and L_mlm alone this fits a
    head to a headless encoder (all-MiniLM-L6-v2, any sentence-embedding model) without changing what
    it computes: the result is a teacher with logits, so L_ce and L_mse become possible.

    ``attention_dropout``: the dropout on the student's attention probabilities while it is distilled; null
    keeps its base config's (``attention_probs_dropout_prob``, 0.1 for BERT and RoBERTa). 0 lets the
    attention kernels skip drawing a random mask per score. It is a setting of this training alone: the
    student's saved and exported ``config.json`` keeps the base's value, so that a fine-tune of it
    regularises as one of its base would.
    """

    init: Literal["from_teacher", "random", "pretrained"] = "from_teacher"
    model: str | None = None
    teacher_layers: list[int] | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    intermediate_size: int | None = None
    trainable: Literal["all", "head"] = "all"
    attention_dropout: float | None = None

    ARCHITECTURE_KEYS: ClassVar[tuple[str, ...]] = (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "intermediate_size",
    )

    def validate(self) -> None:
        if self.init == "from_teacher":
            require(self.model is None, "student.model", "does not apply to student.init=from_teacher")
            for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
                require(getattr(self, key) is None, f"student.{key}", "only applies to student.init=random")
            if self.teacher_layers is not None:
                require(len(self.teacher_layers) > 0, "student.teacher_layers", "must not be empty")
                require(
                    self.teacher_layers == sorted(set(self.teacher_layers)),
                    "student.teacher_layers",
                    "must be strictly increasing",
                )
        else:
            require(self.teacher_layers is None, "student.teacher_layers", "only applies to init=from_teacher")
        if self.init == "pretrained":
            require(self.model is not None, "student.model", "student.init=pretrained needs the model to train")
            for key in self.ARCHITECTURE_KEYS:
                require(getattr(self, key) is None, f"student.{key}", "a pretrained model keeps its own architecture")
        for key in self.ARCHITECTURE_KEYS:
            value = getattr(self, key)
            require(value is None or value > 0, f"student.{key}", "must be positive")
        require(
            self.trainable == "all" or self.init != "random",
            "student.trainable",
            "head freezes the encoder, which student.init=random leaves random; fit a head to a pretrained "
            "(init=pretrained) or copied (init=from_teacher) encoder",
        )
        require(
            self.attention_dropout is None or 0.0 <= self.attention_dropout < 1.0,
            "student.attention_dropout",
            "must be in [0, 1), or null for the base config's",
        )
        if self.hidden_size is not None and self.num_attention_heads is not None:
            require(
                self.hidden_size % self.num_attention_heads == 0,
                "student.hidden_size",
                f"must be divisible by num_attention_heads ({self.num_attention_heads})",
            )


@dataclasses.dataclass
class TinyBertConfig:
    """TinyBERT transformer-layer distillation (Jiao et al., 2020); each weight 0 = off."""

    embedding: float = 0.0  # MSE(E_s W_e, E_t) of the embedding outputs
    hidden: float = 0.0  # sum over mapped layers of MSE(H_s W_h, H_t)
    attention: float = 0.0  # sum over mapped layers of the attention-score MSE, per head, real tokens only
    teacher_layers: list[int] | None = None  # teacher layer (0-based) per student layer; None: uniform g(m) = m*k

    def validate(self) -> None:
        for key in ("embedding", "hidden", "attention"):
            require(getattr(self, key) >= 0, f"objective.tinybert.{key}", "loss weights must be >= 0")
        check_layer_list(self.teacher_layers, "objective.tinybert.teacher_layers")


@dataclasses.dataclass
class PkdConfig:
    """Patient knowledge distillation (Sun et al., 2019): normalised [CLS] states of intermediate layers."""

    weight: float = 0.0  # beta
    strategy: Literal["skip", "last"] = "skip"  # PKD-Skip: every k-th teacher layer; PKD-Last: the last ones
    teacher_layers: list[int] | None = None  # explicit teacher layer per student intermediate layer

    def validate(self) -> None:
        require(self.weight >= 0, "objective.pkd.weight", "loss weights must be >= 0")
        check_layer_list(self.teacher_layers, "objective.pkd.teacher_layers")


@dataclasses.dataclass
class MiniLmConfig:
    """MiniLM deep self-attention distillation (Wang et al., 2020) on the student's last layer."""

    attention: float = 0.0  # KL of the self-attention distributions softmax(Q Kᵀ/√d)
    value: float = 0.0  # KL of the value relations softmax(V Vᵀ/√d)
    teacher_layer: int = -1  # the teacher layer to mimic (negative counts from the end; -1 = last)
    relation_heads: int | None = None  # None: each model's own heads (must be equal); else MiniLMv2 relation heads

    def validate(self) -> None:
        for key in ("attention", "value"):
            require(getattr(self, key) >= 0, f"objective.minilm.{key}", "loss weights must be >= 0")
        require(
            self.relation_heads is None or self.relation_heads > 0, "objective.minilm.relation_heads", "must be > 0"
        )


def check_layer_list(layers: list[int] | None, key: str) -> None:
    if layers is not None:
        require(len(layers) > 0, key, "must not be empty (leave it unset for the default map)")
        require(all(i >= 0 for i in layers), key, "layer indices are 0-based and must be >= 0")


@dataclasses.dataclass
class ObjectiveConfig:
    """Loss weights; a zero weight means the term is not computed at all."""

    ce: float = 5.0  # KL(teacher || student) at `temperature`, times T^2
    mlm: float = 2.0  # cross-entropy against the masked tokens
    cos: float = 1.0  # 1 - cos(student, teacher) last hidden states
    mse: float = 0.0  # MSE between student and teacher logits
    temperature: float = 2.0
    ce_positions: Literal["masked", "all"] = "masked"
    # The MLM decoders' matmuls computed with the vocabulary padded to a multiple of this (1: as the models have
    # it); the same logits, from aligned rows (trainer.modeling.RowPaddedLinear). A speed setting, not a loss one.
    vocab_multiple: int = 1
    # Intermediate-layer distillation (trainer/objective/layer_distillation.py), combinable with the terms above.
    # Each name in LAYER_METHODS is both a section below and the module trainer/objective/layer_methods/<name>.py
    # that implements it, so a new method is that module plus its section here; terms are summed in this order.
    LAYER_METHODS: ClassVar[tuple[str, ...]] = ("tinybert", "pkd", "minilm")
    tinybert: TinyBertConfig = field(default_factory=TinyBertConfig)
    pkd: PkdConfig = field(default_factory=PkdConfig)
    minilm: MiniLmConfig = field(default_factory=MiniLmConfig)

    def validate(self) -> None:
        for key in ("ce", "mlm", "cos", "mse"):
            require(getattr(self, key) >= 0, f"objective.{key}", "loss weights must be >= 0")
        require(self.temperature > 0, "objective.temperature", "must be > 0")
        require(self.vocab_multiple >= 1, "objective.vocab_multiple", "must be >= 1 (1: the vocabulary as it is)")


@dataclasses.dataclass
class MaskingConfig:
    """Dynamic masking, drawn afresh each step on the device (RoBERTa/DistilBERT style)."""

    probability: float = 0.15
    replace_mask: float = 0.8  # of the chosen tokens: share replaced by [MASK]
    replace_random: float = 0.1  # ... by a random token (the rest stay unchanged)
    frequency_smoothing: float | None = None  # e.g. 0.7: choose token t with p ∝ count(t)^-0.7
    whole_word: bool = False

    def validate(self) -> None:
        require(0 < self.probability < 1, "masking.probability", "must be in (0, 1)")
        require(
            self.replace_mask >= 0 and self.replace_random >= 0 and self.replace_mask + self.replace_random <= 1,
            "masking.replace_mask",
            "replace_mask and replace_random must be >= 0 and sum to at most 1",
        )
        require(
            self.frequency_smoothing is None or self.frequency_smoothing > 0,
            "masking.frequency_smoothing",
            "must be a positive exponent (0.7 in DistilBERT)",
        )


@dataclasses.dataclass
class LoaderConfig:
    shuffle_buffer: int = 10_000
    num_workers: int = 2
    # The independent sample streams the data order is made of (runtime/data.py); None: world size x
    # num_workers of the run's first launch. A run resumes on at most this many ranks.
    streams: int | None = None
    # Reading shards (runtime/data.py ShardReader, runtime/storage.py): a failed read is retried read_attempts
    # times with backoff up to read_retry_max_s; cache_dir keeps remote shards locally, at most cache_max_gb.
    read_attempts: int = 5
    read_retry_max_s: float = 30.0
    cache_dir: str | None = None
    cache_max_gb: float = 100.0
    # A shard whose bytes do not hash to the manifest's sha256: "stop" the run naming it (the default), or "skip"
    # its samples, each counted in train/damaged_samples_skipped (runtime/data.py, "Damaged shards").
    damaged_shards: Literal["stop", "skip"] = "stop"

    def validate(self) -> None:
        require(self.shuffle_buffer >= 1, "loader.shuffle_buffer", "must be >= 1")
        require(self.read_attempts >= 1, "loader.read_attempts", "must be >= 1")
        require(self.read_retry_max_s > 0, "loader.read_retry_max_s", "must be > 0")
        require(self.cache_max_gb > 0, "loader.cache_max_gb", "must be > 0")
        require(self.num_workers >= 0, "loader.num_workers", "must be >= 0")
        require(self.streams is None or self.streams >= 1, "loader.streams", "must be >= 1 (or null)")


@dataclasses.dataclass
class OptimizerConfig:
    lr: float = 5e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-6
    weight_decay: float = 0.01
    warmup_fraction: float = 0.05  # linear warmup, then linear decay to zero at max_steps
    grad_clip: float = 5.0

    def validate(self) -> None:
        require(math.isfinite(self.lr) and self.lr > 0, "optimizer.lr", "must be a finite number > 0")
        require(math.isfinite(self.eps) and self.eps > 0, "optimizer.eps", "must be a finite number > 0")
        # AdamW checks only its constructor's decay, not the per-group value the groups carry: a negative one trained.
        require(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optimizer.betas", "two in [0,1)")
        require(0 <= self.warmup_fraction < 1, "optimizer.warmup_fraction", "must be in [0, 1)")
        require(self.grad_clip >= 0, "optimizer.grad_clip", "must be >= 0 (0 disables clipping)")


@dataclasses.dataclass
class DeepSpeedConfig:
    config: str = "configs/deepspeed/zero2.json"  # the ZeRO stage and offload live in this JSON
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    # fp16 only: dynamic loss scaling starts at 2**initial_scale_power and halves after overflowing steps,
    # which are skipped (not errors). A very large value forces overflows: how the GPU tests exercise it.
    initial_scale_power: int = 16
    # bf16 only. false: the trainer's FiniteGuard stops the run at the first non-finite loss or gradient norm,
    # before anything is saved. true: such a step is skipped, and training goes on. ZeRO-1/2 then check every
    # gradient for inf/NaN before each optimizer step (DeepSpeed's bf16.check_grad_overflow), at about 13 device
    # ops per parameter and 2 host reads a step (docs/log/benchmarks.md, "Host work per step"); ZeRO-3 skips a step
    # whose gradient norm is not finite in either case.
    bf16_skip_nonfinite: bool = False
    # A rank that has not been heard from for this long (its node died or froze) stops every other rank, with
    # one line naming it (trainer/runtime/peers.py); a relaunch resumes from the last complete checkpoint.
    peer_timeout_s: float = 120.0

    @property
    def skips_nonfinite_steps(self) -> bool:
        """Whether a step with non-finite gradients is skipped, as fp16's loss scaler does and bf16 does when asked,
        rather than stopping the run (the trainer's FiniteGuard)."""
        return self.precision == "fp16" or self.bf16_skip_nonfinite

    def validate(self) -> None:
        require(0 <= self.initial_scale_power <= 64, "deepspeed.initial_scale_power", "must be in [0, 64]")
        require(self.peer_timeout_s >= 5, "deepspeed.peer_timeout_s", "must be >= 5 (seconds)")
        require(
            self.precision == "bf16" or not self.bf16_skip_nonfinite,
            "deepspeed.bf16_skip_nonfinite",
            f"applies to deepspeed.precision bf16 only, not {self.precision} "
            "(fp16's loss scaler always skips overflowing steps; an fp32 run always stops at a non-finite one)",
        )


@dataclasses.dataclass
class CheckpointConfig:
    every_steps: int = 1000
    keep_last: int = 3

    def validate(self) -> None:
        require(self.every_steps >= 1, "checkpoint.every_steps", "must be >= 1")
        require(self.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")


@dataclasses.dataclass
class EvalConfig:
    every_steps: int = 1000
    max_batches: int = 50

    def validate(self) -> None:
        require(self.every_steps >= 1, "eval.every_steps", "must be >= 1")
        require(self.max_batches >= 1, "eval.max_batches", "must be >= 1")


@dataclasses.dataclass
class LoggingConfig:
    every_steps: int = 10

    def validate(self) -> None:
        require(self.every_steps >= 1, "logging.every_steps", "must be >= 1")


@dataclasses.dataclass
class ProfileConfig:
    steps: int = 0  # 0: off; else torch.profiler over this many steps (trainer/runtime/profiling.py)
    start_step: int = 10  # the first profiled step: after the first steps' compilation, autotuning and caches
    trace: bool = False  # also each rank's timeline, for Perfetto (tens of MB a step at full size)

    def validate(self) -> None:
        require(self.steps >= 0, "profile.steps", "must be >= 0")
        require(self.start_step >= 1, "profile.start_step", "must be >= 1")


@dataclasses.dataclass
class TrainConfig:
    teacher: str | None  # Hugging Face masked-LM: local directory or hub id; null: pretraining, L_mlm alone
    data: str  # dataset written by `python -m preprocessing`: a directory or an object store URL (s3://...)
    output_dir: str
    tokenizer: str | None = None  # without a teacher: the dataset's tokenizer (default: student.model's)
    max_steps: int = 1000  # 0: no training, the student as a run starts it (train.py, export_untrained)
    global_batch_size: int = 4096  # = micro_batch_size x gradient accumulation x world size
    micro_batch_size: int = 16
    seed: int = 0
    compile: bool = False  # torch.compile the encoders and heads a step runs, in place (Distiller.compile_models)
    student: StudentConfig = field(default_factory=StudentConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)  # defined in trainer/tracking/config.py

    def validate(self) -> None:
        if self.teacher is None:
            self.validate_without_teacher()
        else:
            require(self.tokenizer is None, "tokenizer", "the teacher's tokenizer is used; leave it unset (null)")
        require(
            self.objective.cos == 0 or self.student.trainable == "all",
            "objective.cos",
            "trains the student's hidden states, which student.trainable=head freezes; set it to 0",
        )
        require(self.max_steps >= 0, "max_steps", "must be >= 0")
        # numpy's SeedSequence, which seeds the data order and the masks, refuses a negative seed after the work
        require(self.seed >= 0, "seed", "must be >= 0")
        last_profiled = self.profile.start_step + self.profile.steps - 1
        require(
            self.profile.steps == 0 or last_profiled <= self.max_steps,
            "profile.start_step",
            f"profiles steps {self.profile.start_step}-{last_profiled}, past max_steps ({self.max_steps})",
        )
        require(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
        require(
            self.global_batch_size >= self.micro_batch_size and self.global_batch_size % self.micro_batch_size == 0,
            "global_batch_size",
            f"must be a multiple of micro_batch_size ({self.micro_batch_size})",
        )

    def validate_without_teacher(self) -> None:
        """``teacher: null`` is masked-LM pretraining: a student from ``student.model``, trained with L_mlm alone.

        The layer-distillation sections also need a teacher; they are checked with the models'
        architectures (``trainer.objective.distiller.validate_against_teacher``).
        """
        require(
            self.student.init != "from_teacher",
            "student.init",
            "from_teacher needs a teacher; without one use random (an architecture from student.model) or "
            "pretrained (the weights of student.model)",
        )
        require(
            self.student.model is not None,
            "student.model",
            "without a teacher, name the model whose architecture (init=random) or weights (init=pretrained) "
            "the student takes, e.g. configs/teachers/bert-base-uncased",
        )
        for key in ("ce", "cos", "mse"):
            require(
                getattr(self.objective, key) == 0,
                f"objective.{key}",
                f"compares with a teacher, but teacher is null; set objective.{key}=0",
            )
        require(self.objective.mlm > 0, "objective.mlm", "is the only loss without a teacher; it must be > 0")

    def tokenizer_source(self) -> tuple[str, str]:
        """(where the run's tokenizer comes from, the key that names it): the teacher's, else ``tokenizer``,
        else ``student.model``'s."""
        for key, value in (("teacher", self.teacher), ("tokenizer", self.tokenizer)):
            if value is not None:
                return value, key
        return self.student.model, "student.model"

    def gradient_accumulation_steps(self, world_size: int) -> int:
        """Accumulation such that micro x accumulation x world == global, exactly."""
        per_step = self.micro_batch_size * world_size
        require(
            self.global_batch_size % per_step == 0,
            "global_batch_size",
            f"{self.global_batch_size} is not micro_batch_size ({self.micro_batch_size}) x world size "
            f"({world_size}) x an integer gradient accumulation",
        )
        return self.global_batch_size // per_step
