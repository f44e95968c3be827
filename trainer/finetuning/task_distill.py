"""``python -m trainer task-distill [CONFIG.yaml] teacher=... student=... data=... output_dir=... [key=value ...]``.

Task-specific distillation, the second stage of TinyBERT (Jiao et al., 2020) and of the Korean
RoBERTa recipe: a teacher already fine-tuned on the task (``trainer finetune``) teaches a general
student (a pre-training distillation's output) on the task's labelled data, in two stages:

1. ``layers``: the intermediate layers, with the layer methods of pre-training distillation
   (``trainer/objective/layer_methods/``: TinyBERT embedding/hidden/attention, PKD, MiniLM);
2. ``predictions``: the outputs, with soft cross-entropy at temperature T (``soft``, TinyBERT's
   ``kl_distillation_loss``) and/or logit MSE (``mse``, the Korean paper's ``logit_mse_loss``),
   optionally plus the hard-label loss (``hard``). Regression distils its one output by MSE.

A stage with ``epochs: 0`` is skipped. The data is what ``finetune`` reads (single sentences,
sentence pairs with ``text_pair_column``, ``task=regression``), typically the output of
``python -m preprocessing.augment`` (TinyBERT's data augmentation) for training and the task's
own validation split. Every ``eval_every_steps`` of the predictions stage the student is scored on
the validation split and the best one is kept in ``OUTPUT/best/``; a checkpoint every
``checkpoint_every_steps`` lets a killed run resume on exactly the batches it would have seen.
The result, ``OUTPUT/model/``, is a Hugging Face ``AutoModelForSequenceClassification`` directory
(the best validated student), recorded in MLflow as one parent run with a child run per stage and
registered like any student (``mlflow.register_as``). Since that choice is made on the validation
split, its score there flatters the student: ``test=`` names a held-out split that the exported
student is scored on once, after every choice (``metrics.json``'s ``test``; with ``save_predictions``
each test example's prediction, for paired comparisons).

Before any weight moves, a teacher without a classification head, dataset labels the teacher does
not know, and a student with another vocabulary are errors naming the key.

Several processes (``deepspeed launch/run.sh task-distill CONFIG ...``, or any launcher that sets
RANK/WORLD_SIZE): each rank takes its share of every batch and the gradients are averaged;
rank 0 validates, checkpoints and records.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import tempfile
import time
from dataclasses import field
from pathlib import Path
from typing import Any, ClassVar

import torch
import yaml
from torch import nn

from common.atomic import atomic_directory, write_text_atomically
from common.config import ConfigError, flatten, require, to_dict
from trainer.config import MiniLmConfig, MlflowConfig, PkdConfig, TinyBertConfig
from trainer.finetuning.finetune import (
    PRIMARY_METRIC,
    TASKS,
    Split,
    encode,
    evaluate,
    load_classifier,
    load_splits,
    load_test,
    on_device,
    resolve_model,
    save_model,
)
from trainer.objective.capture import capture
from trainer.objective.layer_distillation import LayerDistillation, layer_term_weights
from trainer.objective.losses import kl_distillation_loss, logit_mse_loss
from trainer.runtime.metrics import duration
from trainer.runtime.optim import build_scheduler, follow_schedule, param_groups
from trainer.runtime.ranks import Ranks, average_gradients, init_ranks
from trainer.tracking.registry import register_or_explain
from trainer.tracking.tracker import NullTracker, RunSpec, Tracker

log = logging.getLogger(__name__)

STAGES = ("layers", "predictions")
CHECKPOINT = "checkpoint"


@dataclasses.dataclass
class LayerStageConfig:
    """Stage 1: the layer methods, each section as in pre-training distillation (docs/objectives.md)."""

    LAYER_METHODS: ClassVar[tuple[str, ...]] = ("tinybert", "pkd", "minilm")
    epochs: int = 0  # 0: no layer stage
    lr: float = 5e-5
    tinybert: TinyBertConfig = field(default_factory=TinyBertConfig)
    pkd: PkdConfig = field(default_factory=PkdConfig)
    minilm: MiniLmConfig = field(default_factory=MiniLmConfig)


@dataclasses.dataclass
class PredictionStageConfig:
    """Stage 2: the student's outputs against the teacher's."""

    epochs: int = 3  # 0: no prediction stage
    lr: float = 5e-5
    soft: float = 1.0  # T^2 KL(softmax(t/T) || softmax(s/T)) (classification only)
    mse: float = 0.0  # MSE of the raw logits (the Korean recipe; regression's distillation loss)
    hard: float = 0.0  # the student's own loss against the dataset's labels
    temperature: float = 1.0


@dataclasses.dataclass
class TaskDistillMlflowConfig(MlflowConfig):
    experiment: str = "task-distill"


@dataclasses.dataclass
class TaskDistillConfig:
    teacher: str  # a fine-tuned classifier: models:/NAME@ALIAS or a local Hugging Face directory
    student: str  # the general student, the same
    data: str  # CSV, JSONL (optionally .gz) or a `datasets` directory, as `finetune` reads
    output_dir: str
    validation: str | None = None  # where the best student is chosen (held out from `data` when unset)
    test: str | None = None  # scored once, by the exported student: no choice is made on it
    save_predictions: bool = False  # predictions.json: each test example's prediction and label
    valid_fraction: float = 0.2
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    task: str = "classification"  # or "regression"
    max_seq_len: int = 128
    batch_size: int = 32  # the global batch: split over the ranks
    weight_decay: float = 0.01
    warmup_fraction: float = 0.1
    grad_clip: float = 1.0
    eval_every_steps: int = 100  # in the predictions stage, and at its end
    checkpoint_every_steps: int = 100
    log_every_steps: int = 10
    seed: int = 0
    layers: LayerStageConfig = field(default_factory=LayerStageConfig)
    predictions: PredictionStageConfig = field(default_factory=PredictionStageConfig)
    mlflow: TaskDistillMlflowConfig = field(default_factory=TaskDistillMlflowConfig)

    def validate(self) -> None:
        require(self.task in TASKS, "task", f"must be one of {', '.join(TASKS)}, got {self.task!r}")
        require(0 < self.valid_fraction < 1, "valid_fraction", "must be in (0, 1)")
        for key in ("max_seq_len", "batch_size", "eval_every_steps", "checkpoint_every_steps", "log_every_steps"):
            require(getattr(self, key) >= 1, key, "must be >= 1")
        require(0 <= self.warmup_fraction < 1, "warmup_fraction", "must be in [0, 1)")
        for stage in STAGES:
            section = getattr(self, stage)
            require(section.epochs >= 0, f"{stage}.epochs", "must be >= 0")
            require(section.lr > 0, f"{stage}.lr", "must be > 0")
        require(self.layers.epochs + self.predictions.epochs > 0, "predictions.epochs", "both stages have 0 epochs")
        if self.layers.epochs:
            require(
                bool(layer_term_names(self.layers)),
                "layers",
                "layers.epochs > 0 needs a positive weight in layers.tinybert, layers.pkd or layers.minilm",
            )
        p = self.predictions
        require(min(p.soft, p.mse, p.hard) >= 0, "predictions", "soft, mse and hard must be >= 0")
        require(p.temperature > 0, "predictions.temperature", "must be > 0")
        if p.epochs:
            require(p.soft + p.mse + p.hard > 0, "predictions", "needs a positive soft, mse or hard weight")
        if self.task == "regression" and p.epochs:
            require(p.soft == 0, "predictions.soft", "a regression head has no distribution: use predictions.mse")


def layer_term_names(stage: LayerStageConfig) -> list[str]:
    return list(layer_term_weights(stage))


# ----------------------------------------------------------------------------------------------- models
@dataclasses.dataclass
class Models:
    teacher: nn.Module
    student: nn.Module
    tokenizer: Any
    label_ids: dict[str, int]  # the teacher's label2id (classification) or {} (regression)
    sources: dict[str, dict[str, str]]  # where each model came from (for the run's tags)


def load_models(cfg: TaskDistillConfig, splits: list[Split], scratch: Path) -> Models:
    """Both models, after the checks that must pass before any weight is read: the teacher has a
    classification (or regression) head for this task and knows every label of the data, the
    student shares the teacher's vocabulary, and the layer stage's methods fit the two architectures."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    teacher_dir, teacher_source = resolve_model(cfg.teacher, cfg.mlflow, scratch / "teacher", key="teacher")
    student_dir, student_source = resolve_model(cfg.student, cfg.mlflow, scratch / "student", key="student")
    teacher_config = AutoConfig.from_pretrained(teacher_dir)
    label_ids = check_teacher_head(cfg, teacher_config, splits)
    check_same_vocabulary(teacher_dir, student_dir)
    if cfg.layers.epochs:  # the layer methods' own checks (head counts, layer maps), from the configs alone
        LayerDistillation(cfg.layers, teacher_config, AutoConfig.from_pretrained(student_dir))

    teacher = AutoModelForSequenceClassification.from_pretrained(teacher_dir).eval().requires_grad_(False)
    torch.manual_seed(cfg.seed)  # the student's new head
    head = {key: getattr(teacher_config, key) for key in ("num_labels", "id2label", "label2id", "problem_type")}
    student = load_classifier(student_dir, head)
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    return Models(teacher, student, tokenizer, label_ids, {"teacher": teacher_source, "student": student_source})


def check_teacher_head(cfg: TaskDistillConfig, teacher_config: Any, splits: list[Split]) -> dict[str, int]:
    """The teacher's label2id, checked against the task and the labels of every split."""
    architectures = teacher_config.architectures or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise ConfigError(
            f"teacher: {cfg.teacher} has no classification head (architectures {architectures}); "
            "task distillation needs a fine-tuned teacher: make one with `python -m trainer finetune`"
        )
    if cfg.task == "regression":
        require(
            teacher_config.num_labels == 1,
            "teacher",
            f"{cfg.teacher} has {teacher_config.num_labels} outputs, a regression teacher has 1",
        )
        return {}
    require(
        teacher_config.problem_type != "regression" and teacher_config.num_labels >= 2,
        "task",
        f"the teacher {cfg.teacher} is a regression model: set task=regression",
    )
    label_ids = {str(name): int(i) for name, i in teacher_config.label2id.items()}
    data_labels = {str(label) for split in splits for label in split.labels}
    unknown = sorted(data_labels - set(label_ids))
    if unknown:
        raise ConfigError(
            f"{cfg.label_column}: labels {unknown} of {cfg.data} are not in the teacher's label set "
            f"{sorted(label_ids, key=label_ids.get)} (its config's id2label)"
        )
    return label_ids


def check_same_vocabulary(teacher_dir: Path, student_dir: Path) -> None:
    """The student reads the teacher's token ids: their tokenizers must map text to the same ids."""
    from transformers import AutoTokenizer

    teacher_vocab = AutoTokenizer.from_pretrained(teacher_dir).get_vocab()
    student_vocab = AutoTokenizer.from_pretrained(student_dir).get_vocab()
    if teacher_vocab != student_vocab:
        differ = sum(student_vocab.get(token) != i for token, i in teacher_vocab.items())
        raise ConfigError(
            f"student: its tokenizer ({len(student_vocab)} tokens) is not the teacher's ({len(teacher_vocab)} "
            f"tokens, {differ} of them with another id or missing): distil a student with the teacher's tokenizer"
        )


# ----------------------------------------------------------------------------------------------- the loop
class Trainable(nn.Module):
    """What trains: the student, and the layer methods' learned projections (never exported)."""

    def __init__(self, student: nn.Module, layers: LayerDistillation | None) -> None:
        super().__init__()
        self.student = student
        self.layers = layers


def task_distill(cfg: TaskDistillConfig, config_path: str | None = None) -> dict[str, Any]:
    """Both stages (resuming from ``OUTPUT/checkpoint`` if there is one); returns the best validation
    metrics (also in ``OUTPUT/metrics.json``) on rank 0, ``{}`` elsewhere."""
    from transformers import DataCollatorWithPadding

    ranks = init_ranks()
    train, valid = load_splits(cfg)  # bad data fails here, before a model is read
    test = load_test(cfg, [])  # its labels are checked against the teacher's, with the other splits'
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output_dir, prefix=".models.") as tmp:
        models = load_models(cfg, [train, valid] + ([test] if test else []), Path(tmp))
    layers = LayerDistillation(cfg.layers, models.teacher.config, models.student.config) if cfg.layers.epochs else None
    trainable = Trainable(models.student, layers).to(ranks.device)
    teacher = models.teacher.to(ranks.device)
    # Both models read the same ids; a pair's token types only where both have a row for the second text.
    token_types = min(getattr(m.config, "type_vocab_size", 2) for m in (models.teacher, models.student))
    train_set = encode(models.tokenizer, train, models.label_ids, cfg.max_seq_len, token_types)
    valid_set = encode(models.tokenizer, valid, models.label_ids, cfg.max_seq_len, token_types)
    collate = on_device(DataCollatorWithPadding(models.tokenizer), ranks.device)

    state = resume(output_dir / CHECKPOINT, trainable)
    tracking = StageRuns(cfg, config_path, models.sources, state.setdefault("runs", {}), ranks)
    steps_per_epoch = math.ceil(len(train_set) / cfg.batch_size)
    log.info(
        "task distillation of %s from %s: %d training examples, %d validation, rank %d of %d",
        cfg.student,
        cfg.teacher,
        len(train_set),
        len(valid_set),
        ranks.rank,
        ranks.world_size,
    )
    for stage_index, stage in enumerate(STAGES):
        section = getattr(cfg, stage)
        if section.epochs == 0 or stage_index < state["stage"]:
            continue
        loop = StageLoop(cfg, stage, trainable, teacher, collate, train_set, valid_set, ranks, tracking)
        loop.run(section.epochs * steps_per_epoch, state, output_dir)
        state = {**state, "stage": stage_index + 1, "step": 0, "optimizer": None}
    result: dict[str, Any] = {}
    if ranks.leader:
        test_set = (
            None if test is None else encode(models.tokenizer, test, models.label_ids, cfg.max_seq_len, token_types)
        )
        result = finish(cfg, trainable.student, models, collate, test_set, state, output_dir, tracking)
    ranks.close()
    return result


class StageLoop:
    """One stage: its optimizer and schedule, its loss, validation, checkpoints."""

    def __init__(
        self,
        cfg: TaskDistillConfig,
        stage: str,
        trainable: Trainable,
        teacher: nn.Module,
        collate: Any,
        train_set: list[dict[str, Any]],
        valid_set: list[dict[str, Any]],
        ranks: Ranks,
        tracking: StageRuns,
    ) -> None:
        self.cfg, self.stage, self.section = cfg, stage, getattr(cfg, stage)
        self.trainable, self.teacher, self.collate = trainable, teacher, collate
        self.train_set, self.valid_set, self.ranks, self.tracking = train_set, valid_set, ranks, tracking
        # Stage 1 trains the encoder and the projections; stage 2 the student alone (the head included).
        module = trainable if stage == "layers" else trainable.student
        self.parameters = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(param_groups(module, cfg.weight_decay), lr=self.section.lr)

    def batches(self, epoch: int) -> list[torch.Tensor]:
        """The index batches of ``epoch``: a permutation that depends only on (seed, stage, epoch),
        so a resumed run sees the same batches."""
        generator = torch.Generator().manual_seed(self.cfg.seed * 1000 + STAGES.index(self.stage) * 100 + epoch)
        return list(torch.randperm(len(self.train_set), generator=generator).split(self.cfg.batch_size))

    def run(self, total_steps: int, state: dict[str, Any], output_dir: Path) -> None:
        cfg, ranks = self.cfg, self.ranks
        scheduler = build_scheduler(self.optimizer, total_steps, cfg.warmup_fraction)
        step = state["step"]
        if step:
            self.optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            follow_schedule(scheduler, self.section.lr)  # this launch's epochs and lr, not the checkpoint's
            log.info("%s stage: resuming at step %d of %d", self.stage, step, total_steps)
        tracker = self.tracking.stage(self.stage)
        steps_per_epoch = math.ceil(len(self.train_set) / cfg.batch_size)
        started = time.perf_counter()
        first = step
        while step < total_steps:
            epoch, position = divmod(step, steps_per_epoch)
            indices = self.batches(epoch)[position]
            # Dropout draws from a generator seeded by (seed, stage, step): a resumed step draws what it would have.
            torch.manual_seed(self.cfg.seed * 1_000_003 + STAGES.index(self.stage) * 100_003 + step)
            terms = self.train_step(indices)
            scheduler.step()
            step += 1
            if step % cfg.log_every_steps == 0 or step == total_steps:
                metrics = {f"train/{k}": float(v) for k, v in terms.items()} | {"train/lr": scheduler.get_last_lr()[0]}
                tracker.log_metrics(metrics, step)
                elapsed = time.perf_counter() - started
                eta = (total_steps - step) * elapsed / (step - first)
                log.info(
                    "%s step %d/%d | loss %.4f | eta %s",
                    self.stage,
                    step,
                    total_steps,
                    metrics["train/loss"],
                    duration(eta),
                )
            if self.stage == "predictions" and (step % cfg.eval_every_steps == 0 or step == total_steps):
                self.validate(step, state, output_dir, tracker)
            if step % cfg.checkpoint_every_steps == 0 and step < total_steps:
                state.update(step=step, optimizer=self.optimizer.state_dict(), scheduler=scheduler.state_dict())
                self.tracking.record_ids()
                save_checkpoint(output_dir / CHECKPOINT, self.trainable, state, ranks)
        state.update(step=step)
        tracker.finish({})
        self.tracking.record_ids()
        # The stage is complete: the next one starts from here, whatever happens later.
        save_checkpoint(
            output_dir / CHECKPOINT,
            self.trainable,
            {**state, "stage": STAGES.index(self.stage) + 1, "step": 0, "optimizer": None},
            ranks,
        )

    def train_step(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """One optimizer step on this rank's share of the batch; returns the weighted terms and their sum."""
        ranks = self.ranks
        rows, weight = ranks.share(indices)
        batch = self.collate([self.train_set[i] for i in rows.tolist()])
        self.trainable.train()
        terms = self.layer_terms(batch) if self.stage == "layers" else self.prediction_terms(batch)
        loss = sum(terms.values())
        (loss * weight).backward()
        average_gradients(self.parameters, ranks)
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.parameters, self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss.detach(), **{k: v.detach() for k, v in terms.items()}}

    def layer_terms(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stage 1: the layer methods' terms, weighted, on the tensors they capture from both encoders."""
        layers = self.trainable.layers
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        student_spec, teacher_spec = layers.capture_specs()
        with torch.no_grad(), capture(self.teacher, teacher_spec) as teacher_captured:
            self.teacher.base_model(**inputs)
        with capture(self.trainable.student, student_spec) as student_captured:
            self.trainable.student.base_model(**inputs)
        raw = layers(student_captured, teacher_captured, batch["attention_mask"])
        return {name: layers.weights[name] * value for name, value in raw.items()}

    def prediction_terms(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stage 2: the student's logits against the teacher's (and the labels, with ``hard``)."""
        p = self.section
        with torch.no_grad():
            teacher_logits = self.teacher(**{k: v for k, v in batch.items() if k != "labels"}).logits
        out = self.trainable.student(**batch)
        every = torch.ones(teacher_logits.shape[0], dtype=torch.bool, device=teacher_logits.device)
        terms: dict[str, torch.Tensor] = {}
        if p.soft:
            terms["soft"] = p.soft * kl_distillation_loss(out.logits, teacher_logits, p.temperature, every)
        if p.mse:
            terms["mse"] = p.mse * logit_mse_loss(out.logits, teacher_logits, every)
        if p.hard:
            terms["hard"] = p.hard * out.loss
        return terms

    def validate(self, step: int, state: dict[str, Any], output_dir: Path, tracker: Tracker | NullTracker) -> None:
        """Rank 0 scores the student; a new best is written to ``OUTPUT/best`` (atomically)."""
        if self.ranks.leader:
            metric = PRIMARY_METRIC[self.cfg.task]
            result = evaluate(self.trainable.student, self.collate, self.valid_set, self.cfg.batch_size)
            tracker.log_metrics({f"eval/{metric}": result[metric], "eval/loss": result["loss"]}, step)
            best = state.get("best")
            improved = best is None or result[metric] > best[metric]
            log.info("validation at step %d: %s %.4f%s", step, metric, result[metric], " (best)" if improved else "")
            if improved:
                state["best"] = {**{k: v for k, v in result.items() if k != "labels"}, "best_step": step}
                with atomic_directory(output_dir / "best") as tmp:
                    self.trainable.student.save_pretrained(tmp)
                    write_text_atomically(tmp / "metrics.json", json.dumps(state["best"], indent=2) + "\n")
        self.ranks.barrier()
        if self.ranks.world_size > 1:  # every rank keeps the same record of the best
            box = [state.get("best")]
            torch.distributed.broadcast_object_list(box, src=0)
            state["best"] = box[0]


# ----------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(path: Path, trainable: Trainable, state: dict[str, Any], ranks: Ranks) -> None:
    """The trainable weights (safetensors), the optimizer and schedule (tensors only), and the position,
    best result and MLflow run ids (JSON); the whole directory appears at once. Rank 0 writes it."""
    from safetensors.torch import save_model

    if ranks.leader:
        with atomic_directory(path) as tmp:
            save_model(trainable, str(tmp / "trainable.safetensors"))
            if state.get("optimizer") is not None:
                torch.save({"optimizer": state["optimizer"], "scheduler": state["scheduler"]}, tmp / "optimizer.pt")
            position = {k: v for k, v in state.items() if k not in ("optimizer", "scheduler")}
            (tmp / "state.json").write_text(json.dumps(position, indent=2) + "\n", encoding="utf-8")
    ranks.barrier()


def resume(path: Path, trainable: Trainable) -> dict[str, Any]:
    """The saved state (weights loaded into ``trainable``), or the start: stage 0, step 0."""
    from safetensors.torch import load_model

    if not (path / "state.json").is_file():
        return {"stage": 0, "step": 0, "optimizer": None, "best": None, "runs": {}}
    state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    load_model(trainable, str(path / "trainable.safetensors"))
    if (path / "optimizer.pt").is_file():
        state.update(torch.load(path / "optimizer.pt", weights_only=True))
    else:
        state["optimizer"] = None
    log.info("resuming from %s: stage %s, step %d", path, STAGES[min(state["stage"], 1)], state["step"])
    return state


def finish(
    cfg: TaskDistillConfig,
    student: nn.Module,
    models: Models,
    collate: Any,
    test_set: list[dict[str, Any]] | None,
    state: dict[str, Any],
    output_dir: Path,
    tracking: StageRuns,
) -> dict[str, Any]:
    """``OUTPUT/model``: the best validated student (the last one without a predictions stage), with the
    tokenizer, scored once on the test split if there is one; metrics.json (and predictions.json); the
    parent run finished and the model registered."""
    best_dir = output_dir / "best"
    if state.get("best") and best_dir.is_dir():
        from transformers import AutoModelForSequenceClassification

        student = AutoModelForSequenceClassification.from_pretrained(best_dir).to(next(student.parameters()).device)
    model_dir = save_model(student, models.tokenizer, output_dir / "model")
    result = {**(state.get("best") or {}), "model": str(model_dir)}
    metric = PRIMARY_METRIC[cfg.task]
    if test_set is not None:
        names = sorted(models.label_ids, key=models.label_ids.get) if cfg.save_predictions else None
        result["test"] = evaluate(student, collate, test_set, cfg.batch_size, names)
        log.info("test %s %.4f (%d examples)", metric, result["test"][metric], len(test_set))
        if cfg.save_predictions:  # per example, for paired comparisons (the suite's bootstrap)
            kept = {"test": result["test"].pop("predictions")}
            write_text_atomically(output_dir / "predictions.json", json.dumps(kept) + "\n")
    write_text_atomically(output_dir / "metrics.json", json.dumps(result, indent=2) + "\n")
    parent = tracking.parent
    ended = {f"eval/{metric}": result[metric]} if metric in result else {}
    if "test" in result:
        ended[f"test/{metric}"] = result["test"][metric]
    parent.finish(ended)
    register_or_explain(model_dir, cfg.mlflow, parent, task="text-classification")
    return result


# ---------------------------------------------------------------------------------------------- MLflow
class StageRuns:
    """One parent run for the task distillation, a child run per stage (MLflow's ``mlflow.parentRunId``
    tag nests them in the UI). Their ids live in the checkpoint, so a resumed run continues them: a run
    the server created only after ``mlflow.start_timeout_s`` (in the background) too, from the next
    checkpoint on (:meth:`record_ids`). A stage opened before its parent run existed is nested once it does
    (:meth:`Tracker.nest`)."""

    def __init__(
        self,
        cfg: TaskDistillConfig,
        config_path: str | None,
        sources: dict[str, dict[str, str]],
        run_ids: dict[str, str],
        ranks: Ranks,
    ) -> None:
        self.cfg, self.run_ids, self.ranks = cfg, run_ids, ranks
        self.opened: dict[str, Tracker] = {}
        params = {key: str(value) for key, value in flatten(to_dict(cfg)).items()}
        tags = {f"{role}_{key}": value for role, source in sources.items() for key, value in source.items()}
        tags.update(teacher=cfg.teacher, student=cfg.student, data=cfg.data)
        self.tags = tags
        spec = RunSpec(
            experiment=cfg.mlflow.experiment,
            run_name=cfg.mlflow.run_name,
            params=params,
            tags=tags,
            files=[("config", Path(config_path))] if config_path else [],
            texts={"config/resolved.yaml": yaml.safe_dump(to_dict(cfg), sort_keys=False)},
        )
        self.parent = self.open("parent", spec)

    def open(self, name: str, spec: RunSpec, parent: Tracker | None = None) -> Tracker | NullTracker:
        if not self.ranks.leader or not self.cfg.mlflow.tracks:
            return NullTracker(self.cfg.mlflow)
        tracker = Tracker(self.cfg.mlflow, spec=spec, run_id=self.run_ids.get(name), parent=parent)
        tracker.delivery.first_attempt.wait(self.cfg.mlflow.start_timeout_s)  # the id goes into checkpoints
        self.opened[name] = tracker
        self.record_ids()
        return tracker

    def record_ids(self) -> None:
        """Put the ids of the runs that exist now into ``run_ids``, which the checkpoint holds; called before
        each save, since a run the server was late for gets its id after :meth:`open` stopped waiting."""
        self.run_ids.update({name: t.run_id for name, t in self.opened.items() if t.run_id})

    def stage(self, stage: str) -> Tracker | NullTracker:
        """The child run of ``stage``: its section's params, nested under the parent."""
        params = {key: str(value) for key, value in flatten(to_dict(getattr(self.cfg, stage))).items()}
        name = f"{self.cfg.mlflow.run_name or 'task-distill'}/{stage}"
        tags = {**self.tags, "stage": stage}
        spec = RunSpec(experiment=self.cfg.mlflow.experiment, run_name=name, params=params, tags=tags)
        return self.open(stage, spec, parent=self.parent if isinstance(self.parent, Tracker) else None)
