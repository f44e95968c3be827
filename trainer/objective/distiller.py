"""The module DeepSpeed trains: the student, the objective, and (held aside) the frozen teacher.

``deepspeed.initialize(model=Distiller(...))`` sees only the student (and any learned parameters
a loss adds): those are what ZeRO partitions, optimises and checkpoints. The teacher is kept in
a plain tuple, which ``nn.Module`` does not register, so it is in no optimizer, no checkpoint
and no ZeRO-3 partition; every rank holds a full replica in the training dtype and runs it
forward under ``no_grad``. The caller moves it to the device (``teacher.to(device)``) itself.

One step computes only what the weighted terms need (a zero weight means not computed):

* the teacher runs at all only if a term compares with it. Without a teacher (``teacher: null``,
  masked-LM pretraining) L_mlm is the only term, and evaluation reports the student alone;
* layer terms (TinyBERT, PKD, MiniLM; see ``trainer.objective.layer_distillation``) capture only the
  mapped layers' tensors, and their projections are the only parameters added besides the student;
* vocabulary logits are computed only where a loss reads them: at the masked positions (the
  masker's fixed ``[batch, budget]`` positions, see ``trainer.objective.masking``), or at every
  position for ``objective.ce_positions=all``. ``[batch, seq, vocab]`` logits are never built
  otherwise;
* nothing is read back to the host, so the step never waits for the device.

Pass ``attention_mask=None`` for a batch without padding (the packed common case; decide it on
the host before the batch is copied to the device): the model then takes SDPA's unmasked
(flash) path. A padded batch's ``[batch, seq]`` mask reaches the encoders as the 4-D mask of
:func:`trainer.modeling.attention_bias`, whose contents Hugging Face does not check on the host.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from common.config import require
from trainer.config import ObjectiveConfig, TrainConfig
from trainer.modeling import (
    attention_bias,
    base_config,
    check_student,
    has_mlm_head,
    mlm_head,
    pad_decoder_rows,
    student_config,
    with_attention_dropout,
)
from trainer.objective.capture import capture, encoder_parts
from trainer.objective.layer_distillation import LayerDistillation, method_class
from trainer.objective.losses import cosine_loss, kl_distillation_loss, logit_mse_loss, masked_lm_loss
from trainer.objective.masking import MaskedBatch, Positions

# The function of each output-level term; Distiller.compile_models swaps in compiled twins.
OUTPUT_LOSSES = {"ce": kl_distillation_loss, "mlm": masked_lm_loss, "cos": cosine_loss, "mse": logit_mse_loss}
OUTPUT_TERMS = tuple(OUTPUT_LOSSES)
LOGIT_TERMS = ("ce", "mse")  # need the teacher's vocabulary logits
TEACHER_TERMS = ("ce", "cos", "mse")


def active_weights(objective: ObjectiveConfig) -> dict[str, float]:
    """The output-level terms to compute, with their weights (zero-weight terms are left out)."""
    return {name: getattr(objective, name) for name in OUTPUT_TERMS if getattr(objective, name) > 0}


def validate_against_teacher(cfg: TrainConfig, teacher_config: PretrainedConfig | None) -> None:
    """The config checks that need the models' architectures; run before any weight is loaded.

    ``teacher_config`` is None without a teacher (``teacher: null``): the student is checked against
    ``student.model``'s config, and no layer-distillation method may be on (the output-level terms
    were checked by ``TrainConfig.validate``). A student from ``student.model`` distilled from a
    teacher must share the teacher's vocabulary: both read the same token ids.
    """
    base = base_config(cfg.student, teacher_config)
    check_student(cfg.student, base)
    with_attention_dropout(base, cfg.student.attention_dropout)  # the family must have the setting
    if cfg.student.trainable == "head":
        for name in cfg.objective.LAYER_METHODS:
            require(
                not method_class(name).active_weights(getattr(cfg.objective, name)),
                f"objective.{name}",
                "trains the student's layers, which student.trainable=head freezes; set its weights to 0",
            )
    if teacher_config is None:
        for name in cfg.objective.LAYER_METHODS:
            require(
                not method_class(name).active_weights(getattr(cfg.objective, name)),
                f"objective.{name}",
                "layer distillation compares with a teacher, but teacher is null; set its weights to 0",
            )
        student_config(cfg.student, base)  # the family must have a masked-LM class
        return
    require(
        base.vocab_size == teacher_config.vocab_size,
        "student.model",
        f"has {base.vocab_size} token embeddings but the teacher {cfg.teacher!r} {teacher_config.vocab_size}; "
        "a student must read the teacher's token ids",
    )
    for key in LOGIT_TERMS:
        if teacher_config.architectures:
            why = (
                f"{cfg.teacher} has no masked-LM head (architectures: {teacher_config.architectures}): use a "
                f"checkpoint saved as *ForMaskedLM, or set objective.{key}=0"
            )
        else:  # the likelier fix is the config: a hand-written or stripped config.json loses this field
            why = (
                f"{cfg.teacher}'s config.json declares no `architectures`, so no masked-LM head can be "
                'found: if its weights have one, add "architectures": ["BertForMaskedLM"] (or '
                "RobertaForMaskedLM, ...) to it, as configs/teachers/*/config.json do; otherwise set "
                f"objective.{key}=0"
            )
        require(
            getattr(cfg.objective, key) == 0 or has_mlm_head(teacher_config),
            f"objective.{key}",
            f"needs the teacher's logits, but {why}",
        )
    s_config = student_config(cfg.student, base)
    student_hidden = s_config.hidden_size
    require(
        cfg.objective.cos == 0 or student_hidden == teacher_config.hidden_size,
        "objective.cos",
        f"compares hidden states, but the student's width ({student_hidden}) differs from the teacher's "
        f"({teacher_config.hidden_size}); set objective.cos=0",
    )
    with torch.device("meta"):  # resolves the layer maps and head checks; no memory
        LayerDistillation(cfg.objective, teacher_config, s_config)


class Distiller(nn.Module):
    """Student + objective; ``forward`` returns ``{"loss": weighted sum, <term>: unweighted value, ...}``."""

    def __init__(
        self,
        student: PreTrainedModel,
        teacher: PreTrainedModel | None,
        objective: ObjectiveConfig,
    ) -> None:
        """``teacher`` None: masked-LM pretraining (the objective must then hold L_mlm alone)."""
        super().__init__()
        self.student = student
        self._teacher = (teacher,)  # a tuple: not registered, so never partitioned, optimised or saved
        self.objective = objective
        # Layer methods and their learned projections: a registered submodule, so trained and checkpointed.
        teacher_config = None if teacher is None else teacher.config
        self.layer_distillation = LayerDistillation(objective, teacher_config, student.config)
        self.capture_specs = self.layer_distillation.capture_specs()
        self.weights = {**active_weights(objective), **self.layer_distillation.weights}
        self.losses = dict(OUTPUT_LOSSES)
        if objective.vocab_multiple > 1:  # in place, as compile_models: before the engine and any compile
            for model in (student, teacher):
                if model is not None:
                    pad_decoder_rows(model, objective.vocab_multiple)

    @property
    def teacher(self) -> PreTrainedModel | None:
        return self._teacher[0]

    def compile_models(self) -> None:
        """``torch.compile``, in place, what a step calls: each model's embeddings, layer stack and MLM
        head, the layer methods, and the output-level loss functions.

        Not the top-level models: a step calls their encoder (``base_model``) and head directly, the
        head only at the positions a loss reads, so compiling a top-level ``forward`` would compile
        nothing that runs. In place (``nn.Module.compile``), so parameter names, state-dict keys,
        checkpoints and export are unchanged. The losses are compiled because eager mode spends most
        of their time moving ``[positions, vocab]`` float32 copies (the upcast, the temperature, each
        log-softmax, the KL terms: a pass over memory each); compiled, each loss is a few fused
        kernels (docs/log/benchmarks.md, "Compiled losses").
        """
        for model in (self.student, self.teacher):
            if model is None:
                continue
            # The embeddings and the layer stack, not base_model, whose forward decides the attention mask. Traced,
            # transformers 5.17 (the GPU machines') cannot tell "no mask" from a mask being traced: it builds a full
            # [batch, 1, seq, seq] one with a zero stride, and SDPA leaves its flash and memory-efficient kernels
            # for the unfused math path in every layer (the H200 measured the compiled step at 0.62x eager, with
            # twice the memory; the mask seen on CPU under 5.17, docs/log/benchmarks.md). Eager, it passes None on.
            # (Under 5.17 a model once asked for output_hidden_states keeps output hooks that read a ContextVar,
            # which would break these graphs at every layer; a run never asks.)
            embeddings, _ = encoder_parts(model)
            embeddings.compile()
            model.base_model.encoder.compile()
            head = mlm_head(model)
            if head is not None:
                head.compile()
        if self.layer_distillation.weights:
            # The capture hooks (objective/capture.py) differ between student and teacher, which run the
            # same code (BertLayer.forward, ...), and come and go every step. Dynamo skips guards on module
            # hooks by default; torch 2.11 then ran the teacher's layers without their hooks (nothing
            # captured: a KeyError in the layer losses), with the hooks of that time. With the guards, 2.11 and
            # 2.13 both capture right and neither recompiles after the first step (docs/log/gpu-machine.md,
            # 2026-11-25): a guard that costs nothing is kept rather than trusting each version's default.
            from torch._dynamo import config as dynamo_config

            dynamo_config.skip_nnmodule_hook_guards = False
            self.layer_distillation.compile()
        self.losses = {name: torch.compile(fn) for name, fn in self.losses.items()}

    def student_model(self) -> PreTrainedModel:
        """The student alone, as exported (no teacher, no loss-only parameters)."""
        return self.student

    def forward(self, batch: MaskedBatch, attention_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """One micro-batch, as the masker made it."""
        input_ids, masked = batch.input_ids, batch.positions
        real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        bias = attention_bias(attention_mask)  # what the encoders take, for both models
        logits_at = masked if self.objective.ce_positions == "masked" else Positions(index=None, valid=real)
        student_spec, teacher_spec = self.capture_specs
        with capture(self.student, student_spec) as student_layers:
            student_hidden = self.student.base_model(input_ids=input_ids, attention_mask=bias).last_hidden_state
        student_head = mlm_head(self.student)

        terms: dict[str, torch.Tensor] = {}
        student_logits = None  # at logits_at, when a logit loss needs them
        if self.layer_distillation.weights or any(name in self.weights for name in TEACHER_TERMS):
            with torch.no_grad(), capture(self.teacher, teacher_spec) as teacher_layers:
                teacher_hidden = self.teacher.base_model(input_ids=input_ids, attention_mask=bias).last_hidden_state
            terms.update(self.layer_distillation(student_layers, teacher_layers, real))
            if "cos" in self.weights:
                terms["cos"] = self.losses["cos"](student_hidden, teacher_hidden, real)
            if any(name in self.weights for name in LOGIT_TERMS):
                student_logits = student_head(logits_at.take(student_hidden))
                with torch.no_grad():
                    teacher_logits = mlm_head(self.teacher)(logits_at.take(teacher_hidden))
                if "ce" in self.weights:
                    terms["ce"] = self.losses["ce"](
                        student_logits, teacher_logits, self.objective.temperature, logits_at.valid
                    )
                if "mse" in self.weights:
                    terms["mse"] = self.losses["mse"](student_logits, teacher_logits, logits_at.valid)
        if "mlm" in self.weights:
            if student_logits is None:
                mlm_logits = student_head(masked.take(student_hidden))
            else:  # reuse the logits the distillation terms computed
                mlm_logits = student_logits if logits_at is masked else masked.take(student_logits)
            terms["mlm"] = self.losses["mlm"](mlm_logits, batch.targets, masked.valid)

        loss = sum(self.weights[name] * value for name, value in terms.items())
        return {"loss": loss, **terms}

    @torch.no_grad()
    def evaluate(
        self, batch: MaskedBatch, attention_mask: torch.Tensor | None, with_teacher: bool = True
    ) -> dict[str, torch.Tensor]:
        """Masked-LM sums on one fixed-mask batch, in eval mode: add them up over batches and ranks,
        then :func:`eval_metrics`.

        Keys: ``predicted`` (masked tokens), ``student_loss_sum``, ``student_correct``; when
        ``with_teacher`` and there is a teacher of the student's width, ``real_tokens``,
        ``hidden_cosine_sum`` (the cosine of the two last hidden states, summed over the real tokens:
        how close the student's representation is, with or without a teacher head) and
        ``centred_cosine_sum`` (the same once each model's mean hidden state is removed); and when that
        teacher has an MLM head, ``teacher_loss_sum``, ``teacher_correct`` and ``agreement`` (student
        and teacher top-1 predictions equal).
        """
        input_ids, masked, targets = batch.input_ids, batch.positions, batch.targets
        bias = attention_bias(attention_mask)
        valid = masked.valid.float()
        was_training = self.student.training
        self.student.eval()
        try:
            student_hidden = self.student.base_model(input_ids=input_ids, attention_mask=bias).last_hidden_state
            student_logits = mlm_head(self.student)(masked.take(student_hidden))
        finally:
            self.student.train(was_training)
        student_top1 = student_logits.argmax(-1)
        sums = {
            "predicted": valid.sum(),
            "student_loss_sum": masked_lm_loss(student_logits, targets, masked.valid) * valid.sum(),
            "student_correct": ((student_top1 == targets).float() * valid).sum(),
        }
        if not with_teacher or self.teacher is None:
            return sums
        teacher_head = mlm_head(self.teacher)
        same_width = self.teacher.config.hidden_size == self.student.config.hidden_size
        if teacher_head is None and not same_width:
            return sums  # nothing to compare with
        teacher_hidden = self.teacher.base_model(input_ids=input_ids, attention_mask=bias).last_hidden_state
        if same_width:
            real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
            n_real = real.float().sum()
            sums["real_tokens"] = n_real
            # L_cos's own definition (1 - mean cosine), so the figure is exactly what L_cos trains.
            sums["hidden_cosine_sum"] = (1.0 - cosine_loss(student_hidden, teacher_hidden, real)) * n_real
            # The same with each model's mean hidden state (over the batch's real tokens) taken out first.
            # Encoders' hidden states share a large common direction (docs/log/quality.md measures it for
            # all-MiniLM-L6-v2), which the plain figure rewards a student for matching even if it tells
            # no two tokens apart; the centred figure counts only what does.
            centred = [h.float() - masked_mean_vector(h.float(), real) for h in (student_hidden, teacher_hidden)]
            sums["centred_cosine_sum"] = (1.0 - cosine_loss(*centred, real)) * n_real
        if teacher_head is not None:
            teacher_logits = teacher_head(masked.take(teacher_hidden))
            teacher_top1 = teacher_logits.argmax(-1)
            sums["teacher_loss_sum"] = masked_lm_loss(teacher_logits, targets, masked.valid) * valid.sum()
            sums["teacher_correct"] = ((teacher_top1 == targets).float() * valid).sum()
            sums["agreement"] = ((student_top1 == teacher_top1).float() * valid).sum()
        return sums


def masked_mean_vector(hidden: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The mean of ``hidden`` ``[batch, seq, width]`` over the ``real`` ``[batch, seq]`` positions: ``[width]``."""
    weights = real.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum((0, 1)) / weights.sum().clamp(min=1.0)


def eval_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Totals from :meth:`Distiller.evaluate` -> losses, accuracies, top-1 agreement, hidden-state cosines."""
    n = max(sums["predicted"], 1.0)
    metrics = {"student_mlm_loss": sums["student_loss_sum"] / n, "student_mlm_accuracy": sums["student_correct"] / n}
    if "hidden_cosine_sum" in sums:
        real = max(sums["real_tokens"], 1.0)
        metrics["hidden_cosine"] = sums["hidden_cosine_sum"] / real
        metrics["centred_cosine"] = sums["centred_cosine_sum"] / real
    if "teacher_loss_sum" in sums:
        metrics["teacher_mlm_loss"] = sums["teacher_loss_sum"] / n
        metrics["teacher_mlm_accuracy"] = sums["teacher_correct"] / n
        metrics["top1_agreement"] = sums["agreement"] / n
    return metrics
