"""``python -m trainer evaluate-mlm MODEL [MODEL ...] data=DATASET_DIR [teacher=DIR] [key=value ...]``.

Held-out masked-LM quality of finished models, all scored on the same tokens: the first
``max_batches`` batches of the dataset's valid split, masked once (``masking``, by default BERT's
uniform 15 %) from ``seed``, exactly as a training run's periodic evaluation masks them
(:func:`trainer.runtime.evaluate.fixed_masked_batches`). For each model: masked-LM loss, perplexity
(exp of the loss) and accuracy; with a ``teacher`` that has a masked-LM head, also the teacher's
own figures and each model's top-1 agreement with it (the share of masked positions where both
predict the same token), the measure DistilBERT-style distillation optimises most directly. A
teacher without a head (an encoder such as all-MiniLM-L6-v2) has no predictions to agree with:
agreement is then null. With any teacher of the model's width, also the **hidden-state cosine**:
the cosine of the two models' last hidden states, averaged over the real tokens of the same masked
batches (1 - L_cos), which says how close a student's representation is to its teacher's whether
or not the teacher has a head, and the **centred cosine**, the same once each model's mean hidden
state (per batch) is removed: encoders' states share a large common direction, which the plain
cosine rewards matching, so the centred one is the truer measure of what a student kept. Both are
null for a model of another width. Models trained from different runs, with different masking, are compared
here on one mask, which a training run's own ``eval/`` metrics cannot do.

The models run on the GPU where there is one (``DS_ACCELERATOR=cpu`` keeps them on the CPU; the
report names the device). The mask is always drawn on the CPU and then moved, so a GPU scores the
same tokens as a CPU does, and the same as a training run's evaluation on the CPU. A run's
evaluation on a GPU draws its mask there, so its tokens differ.

**Intervals.** Every model is scored on the same masked tokens, so two models' figures are paired: each
model's masked-LM accuracy, and the difference of every two models' accuracy and loss (the teacher's
included, where it has a head), come with a 95 % paired bootstrap interval that resamples the *batches*
(``bootstrap`` times, the same batches for every model; seeded, so the same report again gives the same
intervals). Batches, not masked tokens: the tokens of one sequence, and the sequences a batch reads in order
from one document, are not independent, and resampling them alone would make the intervals too narrow. A
difference whose interval holds zero is "no measurable difference". The report keeps every model's
per-batch sums (``per_batch``), so a later script can pair any two models again.

Prints one line per model and every difference, and writes the figures as JSON to ``output`` (atomically).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
from dataclasses import field
from typing import Any

import numpy as np
import torch

from common.atomic import write_text_atomically
from common.config import require
from common.tokenizer import load_tokenizer, tokenizer_identity
from trainer.config import MaskingConfig, ObjectiveConfig
from trainer.evaluation.suite_statistics import SEED, interval, verdict
from trainer.modeling import has_mlm_head, load_model_config, load_teacher
from trainer.objective.distiller import Distiller, eval_metrics
from trainer.objective.masking import DynamicMasker
from trainer.runtime.data import check_tokenizer, open_dataset
from trainer.runtime.evaluate import fixed_masked_batches, masked_lm_batch_sums
from trainer.runtime.ranks import local_device

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EvaluateMlmConfig:
    data: str  # a dataset written by `python -m preprocessing`; its valid split is scored
    models: list[str] = field(default_factory=list)  # Hugging Face masked-LM directories
    teacher: str | None = None  # agreement is measured against it (when it has a masked-LM head)
    max_batches: int = 50
    batch_size: int = 32
    seed: int = 0
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    bootstrap: int = 1000  # paired bootstrap resamples of the batches for the intervals; 0: none
    output: str | None = None  # the JSON report; None: printed only

    def validate(self) -> None:
        require(len(self.models) >= 1, "models", "name at least one model to evaluate")
        require(self.max_batches >= 1, "max_batches", "must be >= 1")
        require(self.batch_size >= 1, "batch_size", "must be >= 1")
        require(self.bootstrap == 0 or self.bootstrap >= 100, "bootstrap", "must be 0 (none) or >= 100 resamples")
        require(
            self.masking.frequency_smoothing is None,
            "masking.frequency_smoothing",
            "held-out scores use a uniform mask, the one every model can be compared on; leave it null",
        )


def evaluate_mlm(cfg: EvaluateMlmConfig) -> dict[str, Any]:
    """Score every model (and the teacher) on one fixed-mask set of valid batches; the report, also
    written to ``cfg.output``."""
    dataset = open_dataset(cfg.data)
    for model in cfg.models:
        require(has_mlm_head(load_model_config(model, "models")), "models", f"{model} has no masked-LM head to score")
    if cfg.teacher is not None:  # a teacher of another vocabulary would read the ids as other words, or fail on them
        check_tokenizer(dataset, tokenizer_identity(load_tokenizer(cfg.teacher), cfg.teacher), cfg.teacher, "teacher")
    device = local_device()  # a GPU where there is one: a CPU took minutes a model on a GPU machine
    teacher = None if cfg.teacher is None else load_teacher(cfg.teacher, torch.float32).to(device)
    teacher_scored = teacher is not None and has_mlm_head(teacher.config)  # has predictions of its own
    batches: list = []
    results = []
    teacher_entry = None
    for model in cfg.models:
        tokenizer = load_tokenizer(model)
        check_tokenizer(dataset, tokenizer_identity(tokenizer, model), model, "models")
        if not batches:  # every model reads the dataset's tokenizer (checked above), so one mask serves all
            # masked on the CPU, then moved: the same tokens are scored on any machine
            masker = DynamicMasker.from_tokenizer(cfg.masking, tokenizer)
            host_batches = fixed_masked_batches(
                dataset,
                masker,
                micro_batch_size=cfg.batch_size,
                max_batches=cfg.max_batches,
                seed=cfg.seed,
                rank=0,
                world_size=1,
                device=torch.device("cpu"),
            )
            require(bool(host_batches), "data", f"{cfg.data} has no valid split to evaluate on")
            batches = [(masked.to(device), None if mask is None else mask.to(device)) for masked, mask in host_batches]
        student = load_teacher(model, torch.float32).to(device)  # frozen, eval mode: exactly how it is read here
        objective = ObjectiveConfig(ce=0.0, mlm=1.0, cos=0.0, mse=0.0)  # evaluate() reads no loss weight
        sums = masked_lm_batch_sums(Distiller(student, teacher, objective), batches)
        per_batch = {key: values.tolist() for key, values in sums.items()}  # kept for the intervals
        metrics = eval_metrics({k: math.fsum(v) for k, v in per_batch.items()})
        results.append(
            {
                "model": model,
                **describe(metrics["student_mlm_loss"], metrics["student_mlm_accuracy"]),
                "top1_agreement": metrics.get("top1_agreement"),  # None: no teacher, or one without a head
                "hidden_cosine": metrics.get("hidden_cosine"),  # None: no teacher, or one of another width
                "centred_cosine": metrics.get("centred_cosine"),
                "masked_tokens": int(math.fsum(per_batch["predicted"])),
                "per_batch": kept(per_batch, "student"),
            }
        )
        if teacher_scored and teacher_entry is None:  # the teacher's figures are the same for every model
            teacher_entry = {
                "model": cfg.teacher,
                **describe(metrics["teacher_mlm_loss"], metrics["teacher_mlm_accuracy"]),
                "per_batch": kept(per_batch, "teacher"),
            }
    scored = results + ([teacher_entry] if teacher_entry else [])
    report = {
        "models": results,
        "teacher": teacher_entry,
        "differences": paired_differences(scored, cfg.bootstrap),
        "data": cfg.data,
        "device": str(device),
        "intervals": f"paired bootstrap, {cfg.bootstrap} resamples of the {len(batches)} batches, 95 % percentile",
        "config": dataclasses.asdict(cfg),
    }
    if cfg.output:
        write_text_atomically(cfg.output, json.dumps(report, indent=2) + "\n")
    return report


def kept(per_batch: dict[str, list[float]], who: str) -> dict[str, list[float]]:
    """One model's per-batch sums from :meth:`Distiller.evaluate`'s: masked tokens, loss and correct guesses."""
    return {
        "masked": per_batch["predicted"],
        "loss_sum": per_batch[f"{who}_loss_sum"],
        "correct": per_batch[f"{who}_correct"],
    }


def paired_differences(entries: list[dict[str, Any]], resamples: int) -> list[dict[str, Any]]:
    """Each entry's ``mlm_accuracy_ci``, and for every two entries (in order) the difference of their accuracy
    and of their loss with 95 % intervals over ``resamples`` paired resamples of the batches (the module's
    docstring says why batches)."""
    if not resamples or not entries:
        return []
    masked = np.asarray(entries[0]["per_batch"]["masked"], dtype=np.float64)  # the same mask for every model
    draws = np.random.default_rng(SEED).integers(0, len(masked), (resamples, len(masked)))  # [b, batches]
    tokens = masked[draws].sum(axis=1)

    def resampled(entry: dict[str, Any], key: str) -> np.ndarray:
        return np.asarray(entry["per_batch"][key], dtype=np.float64)[draws].sum(axis=1) / tokens

    accuracy = [resampled(entry, "correct") for entry in entries]
    loss = [resampled(entry, "loss_sum") for entry in entries]
    for entry, samples in zip(entries, accuracy, strict=True):
        entry["mlm_accuracy_ci"] = interval(samples)
    differences = []
    for first, second in itertools.combinations(range(len(entries)), 2):
        accuracy_ci = interval(accuracy[first] - accuracy[second])
        loss_ci = interval(loss[first] - loss[second])
        differences.append(
            {
                "first": entries[first]["model"],
                "second": entries[second]["model"],
                "mlm_accuracy": {
                    "difference": entries[first]["mlm_accuracy"] - entries[second]["mlm_accuracy"],
                    "ci95": accuracy_ci,
                    "verdict": verdict(accuracy_ci, "first", "second"),
                },
                "mlm_loss": {  # lower is better: the verdict reads the interval the other way round
                    "difference": entries[first]["mlm_loss"] - entries[second]["mlm_loss"],
                    "ci95": loss_ci,
                    "verdict": verdict([-loss_ci[1], -loss_ci[0]], "first", "second"),
                },
            }
        )
    return differences


def describe(loss: float, accuracy: float) -> dict[str, float]:
    """Loss and accuracy over the masked tokens, and the perplexity the loss implies."""
    return {"mlm_loss": loss, "perplexity": math.exp(loss), "mlm_accuracy": accuracy}


def format_line(entry: dict[str, Any]) -> str:
    agreement, cosine, centred = entry["top1_agreement"], entry["hidden_cosine"], entry["centred_cosine"]
    return (
        f"{entry['model']}: masked-LM accuracy {entry['mlm_accuracy']:.4f} | perplexity {entry['perplexity']:.2f} "
        f"| loss {entry['mlm_loss']:.4f} | top-1 agreement with the teacher "
        f"{'n/a (no teacher head)' if agreement is None else f'{agreement:.4f}'} "
        f"| hidden-state cosine with the teacher {'n/a' if cosine is None else f'{cosine:.4f}'} "
        f"(centred {'n/a' if centred is None else f'{centred:.4f}'}) "
        f"| {entry['masked_tokens']} masked tokens"
    )


def format_difference(difference: dict[str, Any]) -> str:
    accuracy, loss = difference["mlm_accuracy"], difference["mlm_loss"]
    return (
        f"{difference['first']} - {difference['second']}: masked-LM accuracy {accuracy['difference']:+.4f} "
        f"[{accuracy['ci95'][0]:+.4f}, {accuracy['ci95'][1]:+.4f}] ({accuracy['verdict']}), loss "
        f"{loss['difference']:+.4f} [{loss['ci95'][0]:+.4f}, {loss['ci95'][1]:+.4f}] ({loss['verdict']})"
    )
