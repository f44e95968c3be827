"""The two models: loading the teacher and deriving the student.

The teacher is any Hugging Face BERT-style encoder (BERT, RoBERTa, ...), with a masked-LM head
or without one (a sentence-transformers encoder such as all-MiniLM-L6-v2). The student is always
the masked-LM model of its family (``BertForMaskedLM`` for a BERT teacher, ``RobertaForMaskedLM``
for RoBERTa), so that the exported student is an ordinary Hugging Face model that
``AutoModelForMaskedLM.from_pretrained`` and ``pipeline("fill-mask")`` load as is, and that can
itself serve as a teacher with an MLM head.

A student is made in one of three ways (``student.init``):

* ``from_teacher`` (DistilBERT): the teacher's width, every other teacher layer. Student layer
  ``i`` is an exact copy of teacher layer ``map[i]``; the word and position embeddings, the
  embedding LayerNorm and the MLM head are copied. No segment ids are used, so the student keeps
  a single token-type row (Hugging Face's BERT always adds one): the teacher's type-0 row, the
  one it added to every token it saw in single-segment text. There is no pooler.
* ``random``: an explicit architecture, randomly initialised. Unset fields are those of the base
  config: ``student.model``'s when set (the only way without a teacher), else the teacher's.
* ``pretrained``: ``student.model``'s weights, trained further (pretraining on a new domain, with or
  without a teacher); a checkpoint without an MLM head gets a fresh one.

Everything here also works on the ``meta`` device, so ``plan`` sizes a run from the teacher's
``config.json`` alone, with no weights and no memory (the parameter and FLOP arithmetic lives in
``trainer.planning.plan``).
"""

from __future__ import annotations

import copy
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

from common.config import ConfigError, require
from trainer.config import StudentConfig

# Hugging Face architectures whose checkpoints carry the masked-LM prediction head.
MLM_HEAD_ARCHITECTURES = ("ForMaskedLM", "ForPreTraining")
# Where each family keeps that head: BERT's ``cls``, RoBERTa's (and its descendants') ``lm_head``.
MLM_HEAD_ATTRIBUTES = ("cls", "lm_head")

log = logging.getLogger(__name__)

PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def training_dtype(precision: str) -> torch.dtype:
    """``deepspeed.precision`` -> the dtype the teacher runs in (the student's masters stay float32)."""
    return PRECISION_DTYPES[precision]


def load_model_config(name_or_path: str, key: str) -> PretrainedConfig:
    """A model's ``config.json`` (a local directory or a hub id), with an error naming the config ``key``."""
    try:
        return AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}: cannot load the model config of {name_or_path!r}: {err}") from None


def load_teacher_config(name_or_path: str) -> PretrainedConfig:
    """The teacher's ``config.json`` (a local directory or a hub id), with a clear error."""
    return load_model_config(name_or_path, "teacher")


def has_mlm_head(config: PretrainedConfig) -> bool:
    """Whether the checkpoint has trained masked-LM head weights, as its ``architectures`` declare."""
    return any(name.endswith(MLM_HEAD_ARCHITECTURES) for name in config.architectures or [])


def load_teacher(name_or_path: str, dtype: torch.dtype) -> PreTrainedModel:
    """The frozen teacher: eval mode, no gradients, SDPA attention, in ``dtype``.

    A checkpoint with an MLM head loads as ``AutoModelForMaskedLM``; an encoder-only one (no
    head) as ``AutoModel``, and then only losses that need no teacher logits are possible (see
    :func:`trainer.objective.distiller.validate_against_teacher`). Any weight missing from the checkpoint
    (other than an unused pooler) is an error: a teacher must never be partly random.

    To derive a bf16 student without rounding its initial weights, load the teacher in float32,
    call :func:`build_student`, then cast the teacher (``teacher.to(dtype)``).
    """
    config = load_teacher_config(name_or_path)
    auto = AutoModelForMaskedLM if has_mlm_head(config) else AutoModel
    try:
        model, info = auto.from_pretrained(
            name_or_path, dtype=dtype, attn_implementation="sdpa", output_loading_info=True
        )
    except (OSError, ValueError) as err:
        raise ConfigError(f"teacher: cannot load {name_or_path!r} as {auto.__name__}: {err}") from None
    missing = sorted(key for key in info["missing_keys"] if ".pooler." not in f".{key}")
    if missing:
        raise ConfigError(f"teacher: {name_or_path!r} has no weights for {', '.join(missing[:5])} (and maybe more)")
    encoder_layers(model)  # fail now, not mid-training, on an unsupported family
    model.requires_grad_(False)
    return model.eval()


def attention_bias(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """A ``[batch, seq]`` padding mask as the ``[batch, 1, 1, seq]`` boolean mask that SDPA broadcasts
    over heads and queries (True: attend); None (no padding) stays None.

    Hugging Face's encoders take a 4-D mask as it is. Given a 2-D one, they first ask whether it has
    any padding at all (``padding_mask.all()`` in ``transformers.masking_utils``), to drop a mask that
    masks nothing: the answer is read back to the host, so every padded step waited there for the GPU
    (``torch.cuda.set_sync_debug_mode("error")`` raised there on an H200, docs/gpu-campaign). A caller
    that decides "no padding" on the host already (passing None) loses nothing by skipping the check.
    The values are those Hugging Face builds, so the outputs are the same.
    """
    return None if attention_mask is None else attention_mask.bool()[:, None, None, :]


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, multiple: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed with ``weight``'s rows padded with zeros to a multiple of ``multiple``
    and the padding's outputs sliced off: the same values, from a matmul whose output rows are aligned.
    Autograd slices the gradients back (``F.pad``'s backward)."""
    pad = -weight.shape[0] % multiple
    if pad == 0:
        return F.linear(x, weight, bias)
    padded_bias = None if bias is None else F.pad(bias, (0, pad))
    return F.linear(x, F.pad(weight, (0, 0, 0, pad)), padded_bias)[..., : weight.shape[0]]


class RowPaddedLinear(nn.Linear):
    """An MLM decoder whose matmul runs with its vocabulary rows padded to a multiple of ``multiple``.

    Why: a bf16 row of BERT's 30,522 logits is 61,044 bytes, not a multiple of 16, and a GPU's tensor-core
    matmul kernels want 16-byte-aligned rows; the H200's profile ran a step's decoder matmuls in a
    2-element-aligned Ampere kernel beside the Hopper kernels of every other matmul (docs/log/benchmarks.md).
    Padding the model's vocabulary itself would make the exported student a 30,528-token BERT that its
    tokenizer does not match; padding at each call costs copies of the weight and the logits' gradient
    instead (timed both ways by the retired ``benchmarks/losses.py``: docs/log/benchmarks.md). It holds the
    decoder's own parameters, so tied weights stay tied and parameter names, checkpoints and export are unchanged.
    """

    def __init__(self, linear: nn.Linear, multiple: int) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate new parameters
        self.in_features, self.out_features, self.multiple = linear.in_features, linear.out_features, multiple
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return padded_linear(x, self.weight, self.bias, self.multiple)


def pad_decoder_rows(model: PreTrainedModel, multiple: int) -> None:
    """In place: ``model``'s MLM decoder (its output embeddings) becomes a :class:`RowPaddedLinear` over the
    same parameters. A model without one (a headless teacher) is left as it is."""
    decoder = model.get_output_embeddings()
    if isinstance(decoder, nn.Linear) and not isinstance(decoder, RowPaddedLinear):
        model.set_output_embeddings(RowPaddedLinear(decoder, multiple))


def encoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The transformer layers of a BERT-style model (``base_model.encoder.layer``)."""
    layers = getattr(getattr(model.base_model, "encoder", None), "layer", None)
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError(
            f"teacher: {type(model).__name__} is not a BERT-style encoder (no base_model.encoder.layer); "
            "supported: BERT, RoBERTa and their descendants"
        )
    return layers


def mlm_head(model: PreTrainedModel) -> nn.Module | None:
    """The module mapping final hidden states to vocabulary logits, or None for an encoder-only model.

    It is applied only to the hidden states gathered at the positions a loss needs, never to all
    ``[batch, seq]`` positions at once.
    """
    return next(
        (getattr(model, n) for n in MLM_HEAD_ATTRIBUTES if isinstance(getattr(model, n, None), nn.Module)), None
    )


def default_layer_map(teacher_layers: int, student_layers: int) -> list[int]:
    """Every k-th teacher layer, symmetric from both ends, keeping the first and the last.

    With k = teacher/student, the first half of the student takes layers 0, k, 2k, ... and the
    second half mirrors it from the top: DistilBERT's [0, 2, 4, 7, 9, 11] for 12 -> 6.
    """
    k = teacher_layers / student_layers
    half = math.ceil(student_layers / 2)
    bottom = [math.floor(i * k + 0.5) for i in range(half)]
    top = [teacher_layers - 1 - math.floor(j * k + 0.5) for j in reversed(range(student_layers - half))]
    return bottom + top


def student_num_layers(cfg: StudentConfig, teacher_layers: int) -> int:
    """Depth: the listed layers, else ``num_layers``, else half the teacher's (from_teacher) or all of the
    base config's (``teacher_layers`` is the base's depth: the teacher's or ``student.model``'s)."""
    if cfg.init == "from_teacher" and cfg.teacher_layers is not None:
        return len(cfg.teacher_layers)
    if cfg.num_layers is not None:
        return cfg.num_layers
    return max(1, teacher_layers // 2) if cfg.init == "from_teacher" else teacher_layers


def student_layer_map(cfg: StudentConfig, teacher_layers: int) -> list[int]:
    """The teacher layer each student layer is paired with (copied from, for ``init=from_teacher``)."""
    if cfg.init == "from_teacher" and cfg.teacher_layers is not None:
        return list(cfg.teacher_layers)
    return default_layer_map(teacher_layers, student_num_layers(cfg, teacher_layers))


def base_config(cfg: StudentConfig, teacher_config: PretrainedConfig | None) -> PretrainedConfig:
    """The config the student's is derived from: ``student.model``'s when set, else the teacher's.

    ``TrainConfig.validate`` guarantees one of them exists.
    """
    return teacher_config if cfg.model is None else load_model_config(cfg.model, "student.model")


def check_student(cfg: StudentConfig, teacher_config: PretrainedConfig) -> None:
    """The student section against its base architecture (what ``StudentConfig.validate`` cannot know).

    ``teacher_config`` is the base (see :func:`base_config`): the teacher's for ``from_teacher``.
    """
    n_teacher = teacher_config.num_hidden_layers
    if cfg.init == "from_teacher":
        if cfg.teacher_layers is not None:
            require(
                cfg.teacher_layers[-1] < n_teacher,
                "student.teacher_layers",
                f"the teacher has {n_teacher} layers (0-based indices), got {cfg.teacher_layers}",
            )
            require(
                cfg.num_layers is None or cfg.num_layers == len(cfg.teacher_layers),
                "student.num_layers",
                f"is {cfg.num_layers} but student.teacher_layers lists {len(cfg.teacher_layers)} layers",
            )
        require(
            student_num_layers(cfg, n_teacher) <= n_teacher,
            "student.num_layers",
            f"a student copied from the teacher cannot have more than its {n_teacher} layers",
        )
    elif cfg.init == "random":
        hidden = cfg.hidden_size or teacher_config.hidden_size
        heads = cfg.num_attention_heads or teacher_config.num_attention_heads
        require(
            hidden % heads == 0,
            "student.hidden_size" if cfg.hidden_size else "student.num_attention_heads",
            f"hidden size {hidden} is not divisible by {heads} attention heads",
        )


def student_config(cfg: StudentConfig, teacher_config: PretrainedConfig) -> PretrainedConfig:
    """The student's Hugging Face config: the base's (:func:`base_config`), with the student's depth
    (and width if random); a pretrained student's is its own."""
    check_student(cfg, teacher_config)
    source_key = "teacher" if cfg.model is None else "student.model"
    config = copy.deepcopy(teacher_config)
    if cfg.init != "pretrained":  # a pretrained model keeps its architecture and its token-type rows
        config.num_hidden_layers = student_num_layers(cfg, teacher_config.num_hidden_layers)
        if cfg.init == "random":
            for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
                if getattr(cfg, key) is not None:
                    setattr(config, key, getattr(cfg, key))
        if hasattr(config, "type_vocab_size"):
            config.type_vocab_size = 1  # no segment ids: one constant row (see the module docstring)
    config.architectures = [masked_lm_class_name(config, source_key)]
    return config


def masked_lm_class_name(config: PretrainedConfig, key: str = "teacher") -> str:
    """The masked-LM class of the config's family (``BertForMaskedLM`` for ``bert``)."""
    name = MODEL_FOR_MASKED_LM_MAPPING_NAMES.get(config.model_type)
    if name is None:
        raise ConfigError(f"{key}: model_type {config.model_type!r} has no masked-LM model class for the student")
    return name


def build_student(cfg: StudentConfig, teacher: PreTrainedModel | None) -> PreTrainedModel:
    """A float32 masked-LM student (random init, a fresh head included, follows torch's global seed).

    ``teacher`` is None without one (``teacher: null``); the student then comes from ``student.model``.
    With ``trainable=head`` all but the head's own parameters are frozen (:func:`freeze_all_but_head`).
    """
    if cfg.init == "pretrained":
        student = load_pretrained_student(cfg.model, cfg.attention_dropout)
    else:
        config = student_config(cfg, base_config(cfg, None if teacher is None else teacher.config))
        built = AutoModelForMaskedLM.from_config(
            with_attention_dropout(config, cfg.attention_dropout), attn_implementation="sdpa"
        )
        student = restore_base_attention_dropout(built, config, cfg.attention_dropout)
    if cfg.init == "from_teacher":
        copy_from_teacher(student, teacher, student_layer_map(cfg, teacher.config.num_hidden_layers))
    if cfg.trainable == "head":
        freeze_all_but_head(student)
    return student


def with_attention_dropout(config: PretrainedConfig, p: float | None) -> PretrainedConfig:
    """The config to build the student from, with ``student.attention_dropout`` (``p``; None: ``config`` as it is).

    Each attention module takes its dropout from the config once, when it is built, and reads it from its own
    ``nn.Dropout`` from then on; so the caller builds from this copy and puts the base's value back into the
    built model's config, which is the one saved and exported (:func:`restore_base_attention_dropout`).
    """
    if p is None:
        return config
    require(
        hasattr(config, "attention_probs_dropout_prob"),
        "student.attention_dropout",
        f"model_type {config.model_type!r} has no attention_probs_dropout_prob to set",
    )
    built = copy.deepcopy(config)
    built.attention_probs_dropout_prob = p
    return built


def restore_base_attention_dropout(model: PreTrainedModel, base: PretrainedConfig, p: float | None) -> PreTrainedModel:
    """``model``, built from ``with_attention_dropout(base, p)``, with ``base``'s attention dropout back in its config:
    its attention modules keep ``p``, while the config it saves and exports keeps the base's value (StudentConfig
    says why). With ``p`` None the model was built from ``base`` itself and is returned as it is."""
    if p is not None:
        model.config.attention_probs_dropout_prob = base.attention_probs_dropout_prob
    return model


def load_pretrained_student(name_or_path: str, attention_dropout: float | None = None) -> PreTrainedModel:
    """``student.model``'s weights as a float32 masked LM in train mode, to be trained further
    (``attention_dropout``: :func:`with_attention_dropout`).

    A checkpoint without an MLM head (an encoder such as all-MiniLM-L6-v2) gets a freshly
    initialised head, which the masked-LM loss then trains; any other missing weight is an error,
    since continuing to train a partly random encoder is never meant (a pooler is not loaded at all).
    """
    source = load_model_config(name_or_path, "student.model")
    config = student_config(StudentConfig(init="pretrained", model=name_or_path), source)
    try:
        model, info = AutoModelForMaskedLM.from_pretrained(
            name_or_path,
            config=with_attention_dropout(config, attention_dropout),
            dtype=torch.float32,
            attn_implementation="sdpa",
            output_loading_info=True,
        )
    except (OSError, ValueError) as err:
        raise ConfigError(f"student.model: cannot load {name_or_path!r} as a masked LM: {err}") from None
    restore_base_attention_dropout(model, config, attention_dropout)
    missing = sorted(key for key in info["missing_keys"] if key.split(".")[0] not in MLM_HEAD_ATTRIBUTES)
    if missing:
        raise ConfigError(
            f"student.model: {name_or_path!r} has no weights for {', '.join(missing[:5])} (and maybe more)"
        )
    if not has_mlm_head(source):
        log.info("student.model: %s has no masked-LM head; training a freshly initialised one", name_or_path)
    return model.train()


def freeze_all_but_head(model: PreTrainedModel) -> None:
    """``student.trainable=head``: only the masked-LM head's own parameters keep ``requires_grad``.

    The decoder matrix is the word-embedding matrix (tied), part of the encoder, so it stays frozen
    with it; what trains is the head's transform (dense + LayerNorm) and its output bias. The
    optimizer is given only parameters that require gradients (``trainer.runtime.optim.param_groups``),
    so the frozen ones are never updated, not even by weight decay.
    """
    tied = {id(p) for p in model.get_input_embeddings().parameters()}
    model.requires_grad_(False)
    for param in mlm_head(model).parameters():
        if id(param) not in tied:
            param.requires_grad_(True)


@torch.no_grad()
def copy_from_teacher(student: PreTrainedModel, teacher: PreTrainedModel, layer_map: list[int]) -> None:
    """DistilBERT's initialisation: embeddings, the mapped layers and (if any) the MLM head, copied exactly."""
    embeddings = teacher.base_model.embeddings.state_dict()
    if "token_type_embeddings.weight" in embeddings:
        embeddings["token_type_embeddings.weight"] = embeddings["token_type_embeddings.weight"][:1]
    student.base_model.embeddings.load_state_dict(embeddings)
    student_layers, teacher_layers = encoder_layers(student), encoder_layers(teacher)
    for i, t in enumerate(layer_map):
        student_layers[i].load_state_dict(teacher_layers[t].state_dict())
    teacher_head = mlm_head(teacher)
    if teacher_head is not None:
        # The decoder weight is tied to the word embeddings in both models: loading it rewrites the same values.
        mlm_head(student).load_state_dict(teacher_head.state_dict())


def model_from_config(config: PretrainedConfig) -> PreTrainedModel:
    """A randomly initialised model of the class the checkpoint loads as (masked LM if it has a head)."""
    auto = AutoModelForMaskedLM if has_mlm_head(config) else AutoModel
    return auto.from_config(config, attn_implementation="sdpa")


def build_on_meta(config: PretrainedConfig) -> PreTrainedModel:
    """The model a config describes, on the meta device: exact shapes, no memory, no weights."""
    with torch.device("meta"):
        return model_from_config(config)
