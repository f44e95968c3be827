"""``python -m trainer finetune [CONFIG.yaml] model=... data=... output_dir=... [key=value ...]``.

What a downstream team does with a registered student: pull it (``model=models:/NAME@ALIAS``,
``models:/NAME/VERSION``, or a local Hugging Face directory), fine-tune it for text
classification (``task=classification``: accuracy) or regression (``task=regression``: one output,
mean squared error, scored by Pearson and Spearman correlation), and read its score on a
validation split. The data is a CSV or JSONL file with ``text`` and ``label`` columns (names
configurable; ``text_pair_column`` adds a second text, encoded as a sentence pair), or a
``datasets`` dataset saved with ``save_to_disk`` (trained on its ``train`` split); the validation split is
``validation=PATH`` (a file, or a saved dataset's ``validation`` split), else the dataset's own ``validation``
split, else a held-out ``valid_fraction`` chosen by ``seed``. A plain torch loop
that runs on a laptop CPU, deterministic for a seed. Logged to MLflow like training (experiment
``finetune``); ``mlflow.register_as`` registers the classifier too.

Several GPUs (or nodes): ``deepspeed launch/run.sh finetune [CONFIG.yaml] key=value ...`` (or
``torchrun``). Data parallel (``trainer/runtime/ranks.py``): each rank computes its share of every
batch of ``batch_size`` and the ranks average their gradients, so the optimisation is the
one-process run's (the same up to float rounding and dropout, whose masks are drawn per rank); rank 0
validates, writes the model and records to MLflow.
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import json
import logging
import math
import random
import tempfile
import time
from dataclasses import field
from pathlib import Path
from typing import Any

import torch
import yaml

from common.atomic import atomic_directory, write_text_atomically
from common.config import ConfigError, flatten, require, to_dict
from trainer.config import MlflowConfig
from trainer.runtime.metrics import duration
from trainer.runtime.optim import build_scheduler, param_groups
from trainer.runtime.ranks import average_gradients, init_ranks, mean_over_ranks
from trainer.tracking.registry import register_or_explain
from trainer.tracking.tracker import NullTracker, RunSpec, open_tracker

log = logging.getLogger(__name__)

SPLIT_NAMES = ("validation", "valid", "test")  # a saved DatasetDict's validation split, first found
TASKS = ("classification", "regression")


@dataclasses.dataclass
class FinetuneMlflowConfig(MlflowConfig):
    experiment: str = "finetune"


@dataclasses.dataclass
class FinetuneConfig:
    model: str  # models:/NAME@ALIAS, models:/NAME/VERSION, or a local Hugging Face directory
    data: str  # CSV, JSONL, or a `datasets` dataset directory (save_to_disk)
    output_dir: str
    validation: str | None = None  # a separate validation file or dataset directory
    test: str | None = None  # a held-out file or dataset scored once, by the final model: no choice is made on it
    save_predictions: bool = False  # predictions.json: each validation (and test) example's prediction and label
    new_pooler: bool = False  # re-initialise a pooler the model brings (the suite: every model starts alike)
    valid_fraction: float = 0.2  # held out from `data` when there is no validation split
    text_column: str = "text"
    text_pair_column: str | None = None  # a second text per example: the pair is encoded as one sequence
    label_column: str = "label"
    task: str = "classification"  # or "regression": numeric labels, one output, MSE
    max_seq_len: int = 128
    epochs: int = 3
    batch_size: int = 16
    lr: float = 5e-5
    weight_decay: float = 0.01
    warmup_fraction: float = 0.1
    grad_clip: float = 1.0
    log_every_steps: int = 10
    seed: int = 0
    mlflow: FinetuneMlflowConfig = field(default_factory=FinetuneMlflowConfig)

    def validate(self) -> None:
        require(0 < self.valid_fraction < 1, "valid_fraction", "must be in (0, 1)")
        for key in ("max_seq_len", "epochs", "batch_size", "log_every_steps"):
            require(getattr(self, key) >= 1, key, "must be >= 1")
        require(self.lr > 0, "lr", "must be > 0")
        require(0 <= self.warmup_fraction < 1, "warmup_fraction", "must be in [0, 1)")
        require(self.task in TASKS, "task", f"must be one of {', '.join(TASKS)}, got {self.task!r}")


@dataclasses.dataclass
class Split:
    texts: list[str]
    labels: list[Any]
    pairs: list[str] | None = None  # the second texts, with text_pair_column

    def subset(self, indices: list[int]) -> Split:
        pairs = None if self.pairs is None else [self.pairs[i] for i in indices]
        return Split([self.texts[i] for i in indices], [self.labels[i] for i in indices], pairs)


def finetune(cfg: FinetuneConfig, config_path: str | None = None) -> dict[str, Any]:
    """Fine-tune ``cfg.model`` on ``cfg.data``; returns the validation metrics (also in metrics.json) on
    rank 0, ``{}`` elsewhere."""
    from transformers import AutoTokenizer, DataCollatorWithPadding

    ranks = init_ranks()
    train, valid = load_splits(cfg)  # bad data fails here, before a model is downloaded
    names, label_ids = label_mapping(train, valid, cfg)
    test = load_test(cfg, names)
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output_dir, prefix=".base.") as tmp:
        model_dir, source = resolve_model(cfg.model, cfg.mlflow, Path(tmp) / "model")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        torch.manual_seed(cfg.seed)
        if cfg.task == "regression":
            head: dict[str, Any] = {"num_labels": 1, "problem_type": "regression"}
        else:
            head = {"num_labels": len(names), "id2label": dict(enumerate(names)), "label2id": label_ids}
        model = load_classifier(model_dir, head, cfg.new_pooler)
        if cfg.task == "regression":
            start_at_mean(model, train.labels)
    model.to(ranks.device)
    spec = run_spec(cfg, config_path, source, names)
    tracker = open_tracker(cfg.mlflow, spec) if ranks.leader else NullTracker(cfg.mlflow)
    token_types = getattr(model.config, "type_vocab_size", 2)
    train_set = encode(tokenizer, train, label_ids, cfg.max_seq_len, token_types)
    valid_set = encode(tokenizer, valid, label_ids, cfg.max_seq_len, token_types)
    collate = on_device(DataCollatorWithPadding(tokenizer), ranks.device)  # pads a batch to its longest example
    metric = PRIMARY_METRIC[cfg.task]
    log.info(
        "fine-tuning %s on %d examples, validating on %d, rank %d of %d",
        cfg.model,
        len(train.texts),
        len(valid.texts),
        ranks.rank,
        ranks.world_size,
    )

    steps_per_epoch = math.ceil(len(train_set) / cfg.batch_size)
    total_steps = cfg.epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr)
    scheduler = build_scheduler(optimizer, total_steps, cfg.warmup_fraction)
    order = torch.Generator().manual_seed(cfg.seed)
    step = 0
    started = time.perf_counter()
    result: dict[str, Any] = {}
    for epoch in range(1, cfg.epochs + 1):
        model.train()
        for indices in torch.randperm(len(train_set), generator=order).split(cfg.batch_size):
            rows, weight = ranks.share(indices)
            loss = model(**collate([train_set[i] for i in rows])).loss * weight
            loss.backward()
            average_gradients(list(model.parameters()), ranks)
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % cfg.log_every_steps == 0 or step == total_steps:
                loss = mean_over_ranks(loss.detach(), ranks)  # the batch's mean loss
                metrics = {"train/loss": loss.item(), "train/lr": scheduler.get_last_lr()[0], "train/epoch": epoch}
                tracker.log_metrics(metrics, step)
                elapsed = time.perf_counter() - started
                eta = (total_steps - step) * elapsed / step
                log.info(
                    "step %d/%d | loss %.4f | elapsed %s | eta %s",
                    step,
                    total_steps,
                    metrics["train/loss"],
                    duration(elapsed),
                    duration(eta),
                )
        if ranks.leader:
            result = evaluate(model, collate, valid_set, cfg.batch_size, names if cfg.save_predictions else None)
            tracker.log_metrics({f"eval/{metric}": result[metric], "eval/loss": result["loss"]}, step)
            log.info("epoch %d | validation %s %.4f | loss %.4f", epoch, metric, result[metric], result["loss"])
        ranks.barrier()

    if ranks.leader and test is not None:
        test_set = encode(tokenizer, test, label_ids, cfg.max_seq_len, token_types)
        result["test"] = evaluate(model, collate, test_set, cfg.batch_size, names if cfg.save_predictions else None)
        log.info(
            "test %s %.4f | loss %.4f (%d examples)",
            metric,
            result["test"][metric],
            result["test"]["loss"],
            len(test_set),
        )
    if ranks.leader and cfg.save_predictions:
        # Per example, for the suite's paired bootstrap; JSON lists (class names, or regression values).
        kept = {"validation": result.pop("predictions")} | ({"test": result["test"].pop("predictions")} if test else {})
        write_text_atomically(output_dir / "predictions.json", json.dumps(kept) + "\n")
    if ranks.leader:
        model_out = save_model(model, tokenizer, output_dir / "model")
        result.update(steps=step, labels=names, model=str(model_out), source=source)
        write_text_atomically(output_dir / "metrics.json", json.dumps(result, indent=2) + "\n")
        tracker.finish({f"eval/{metric}": result[metric]})
        register_or_explain(model_out, cfg.mlflow, tracker, task="text-classification")
    ranks.close()
    return result


def load_classifier(model_dir: Path, head: dict[str, Any], new_pooler: bool = False) -> Any:
    """The student with a new classification (or regression) head set up by ``head``'s keyword arguments,
    and one line saying which weights are new. ``new_pooler``: a pooler the checkpoint brings (a teacher's,
    trained) is initialised afresh too, as a student's always is, so that models compared start alike.

    A student checkpoint has a masked-LM head and no pooler or classifier, so transformers' load
    report (a table of a dozen lines) lists the same expected keys on every fine-tune. It is
    replaced by one INFO line; a key outside those expected ones is still a warning.
    """
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    # Errors (and a size mismatch, which raises) still surface. transformers runs its tensor-parallel plan check
    # exactly when the loader's level is WARNING or above, and that check warns (one line of ~1,000 characters)
    # that the classifier's layers "were not sharded": true and irrelevant without tensor parallelism.
    loggers = [
        hf_logging.get_logger(f"transformers.{name}") for name in ("modeling_utils", "distributed.tensor_parallel")
    ]
    levels = [quieted.level for quieted in loggers]
    for quieted in loggers:
        quieted.setLevel(logging.ERROR)
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(model_dir, **head, output_loading_info=True)
    finally:
        for quieted, level in zip(loggers, levels, strict=True):
            quieted.setLevel(level)
    new_head = ("classifier.", "pooler.")
    missing = sorted(info["missing_keys"])
    unexpected = [k for k in info["unexpected_keys"] if not k.startswith(("cls.predictions.", "lm_head."))]
    fresh = [k for k in missing if any(part in k for part in new_head)]
    pooler = getattr(model.base_model, "pooler", None)
    renewed = new_pooler and pooler is not None and not any(".pooler." in f".{k}" for k in fresh)
    if renewed:  # as BERT's and RoBERTa's initialisation sets a missing pooler's Linear (its only weights)
        with torch.no_grad():
            for layer in pooler.modules():
                if isinstance(layer, torch.nn.Linear):
                    layer.weight.normal_(0.0, model.config.initializer_range)
                    layer.bias.zero_()
    log.info(
        "new weights for the classification head: %s%s; the masked-LM head is left out",
        ", ".join(fresh),
        " and the checkpoint's pooler, initialised afresh (new_pooler)" if renewed else "",
    )
    if len(fresh) < len(missing) or unexpected:
        log.warning(
            "the checkpoint in %s does not match %s: missing %s, unexpected %s",
            model_dir,
            type(model).__name__,
            [k for k in missing if k not in fresh],
            unexpected,
        )
    return model


# -------------------------------------------------------------------------------------------------- data
def load_splits(cfg: FinetuneConfig) -> tuple[Split, Split]:
    """The train and validation splits (see the module docstring for which validation split)."""
    splits = read_dataset(Path(cfg.data), cfg)
    if "train" not in splits and len(splits) > 1:  # training on a validation or test split would go unnoticed
        raise ConfigError(f"data: {cfg.data} holds the splits {sorted(splits)} and none named 'train'")
    train = splits.pop("train", None) or next(iter(splits.values()))
    if cfg.validation is not None:
        valid = validation_split(read_dataset(Path(cfg.validation), cfg), cfg.validation)
    elif any(name in splits for name in SPLIT_NAMES):
        valid = next(splits[name] for name in SPLIT_NAMES if name in splits)
    else:
        train, valid = hold_out(train, cfg.valid_fraction, cfg.seed)
    require(len(train.texts) > 0, "data", f"{cfg.data}: no training examples")
    require(len(valid.texts) > 0, "validation", f"{cfg.validation or cfg.data}: no validation examples")
    return train, valid


def load_test(cfg: FinetuneConfig, names: list[str]) -> Split | None:
    """The ``test=`` split, if any: a file's one split, or a saved dataset's test split; its labels must be ones
    the model is trained on."""
    if cfg.test is None:
        return None
    splits = read_dataset(Path(cfg.test), cfg)
    test = splits.get("test") or validation_split(splits, cfg.test)
    require(len(test.texts) > 0, "test", f"{cfg.test}: no test examples")
    unknown = sorted({str(v) for v in test.labels} - set(names)) if names else []
    require(not unknown, "test", f"labels {unknown} do not occur in the training data")
    return test


def validation_split(splits: dict[str, Split], path: str) -> Split:
    """The split ``validation=PATH`` names: a file's one split, or a saved dataset's validation split (the
    first of ``SPLIT_NAMES``). Its first split would be its train split in a DatasetDict: the model would be
    scored, and its best epoch chosen, on what it trained on (task distillation's augmented-train runs)."""
    if len(splits) == 1:
        return next(iter(splits.values()))
    for name in SPLIT_NAMES:
        if name in splits:
            return splits[name]
    raise ConfigError(f"validation: {path} holds the splits {sorted(splits)} and none of {list(SPLIT_NAMES)}")


def read_dataset(path: Path, cfg: FinetuneConfig) -> dict[str, Split]:
    """``{split name: Split}`` from a CSV or JSONL file, either possibly gzipped (one split, "train"),
    or a saved dataset."""
    if path.is_dir():
        return read_saved_dataset(path, cfg)
    if not path.is_file():
        raise ConfigError(f"data: {path} does not exist")
    opener: Any = gzip.open if path.suffix == ".gz" else open
    suffix = path.with_suffix("").suffix if path.suffix == ".gz" else path.suffix
    if suffix == ".csv":
        with opener(path, "rt", newline="", encoding="utf-8") as f:
            rows = [(f"{path}:{i}", row) for i, row in enumerate(csv.DictReader(f), start=2)]
    elif suffix in (".jsonl", ".json"):
        rows = []
        with opener(path, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((f"{path}:{i}", json.loads(line)))
                except json.JSONDecodeError as err:
                    raise ConfigError(f"data: {path}:{i} is not JSON: {err}") from None
    else:
        raise ConfigError(f"data: {path} must be .csv or .jsonl (optionally .gz), or a `datasets` directory")
    return {"train": to_split(rows, cfg, str(path))}


def read_saved_dataset(path: Path, cfg: FinetuneConfig) -> dict[str, Split]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise ConfigError(f"data: {path} is not a dataset saved with save_to_disk: {err}") from None
    parts = loaded if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    return {
        name: to_split(((f"{path}[{name}][{i}]", row) for i, row in enumerate(part)), cfg, f"{path}[{name}]")
        for name, part in parts.items()
    }


def to_split(rows: Any, cfg: FinetuneConfig, source: str) -> Split:
    """Texts (and pairs) and labels; a missing column or a non-numeric regression label is an error,
    an empty text a counted, reported skip."""
    text_columns = [cfg.text_column] + ([cfg.text_pair_column] if cfg.text_pair_column else [])
    texts, pairs, labels, empty = [], [], [], 0
    for where, row in rows:
        for column in (*text_columns, cfg.label_column):
            if not isinstance(row, dict) or column not in row:
                key = "text_pair_column" if column == cfg.text_pair_column else "text_column / label_column"
                raise ConfigError(f"data: {where} has no column {column!r} (set {key})")
        label = row[cfg.label_column]
        if label is None or label == "":
            raise ConfigError(f"data: {where} has an empty {cfg.label_column!r}")
        if cfg.task == "regression":
            label = regression_label(label, where, cfg.label_column)
        values = [row[column] for column in text_columns]
        if any(not isinstance(value, str) or not value.strip() for value in values):
            empty += 1
            continue
        texts.append(values[0])
        pairs.append(values[-1])
        labels.append(label)
    if empty:
        log.warning("%s: skipped %d rows with an empty %s", source, empty, " or ".join(map(repr, text_columns)))
    return Split(texts, labels, pairs if cfg.text_pair_column else None)


def regression_label(value: Any, where: str, column: str) -> float:
    """A regression target as a finite float (CSV gives strings)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number):
        raise ConfigError(f"data: {where} has {column!r} = {value!r}, not a finite number (task=regression)")
    return number


def hold_out(split: Split, fraction: float, seed: int) -> tuple[Split, Split]:
    """A seeded shuffle, the last ``fraction`` held out for validation."""
    order = list(range(len(split.texts)))
    random.Random(seed).shuffle(order)
    cut = len(order) - max(1, round(len(order) * fraction))
    return split.subset(order[:cut]), split.subset(order[cut:])


def label_mapping(train: Split, valid: Split, cfg: FinetuneConfig) -> tuple[list[str], dict[str, int]]:
    """Label names and ids: integer labels 0..N-1 keep their ids, other labels are sorted.
    Regression has no classes: ``([], {})``."""
    if cfg.task == "regression":
        return [], {}
    values = set(train.labels)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        values = sorted(values)  # as numbers: sorted as text, 10 came before 2 and 11 classes were refused
        require(values == list(range(len(values))), "label_column", f"integer labels must be 0..N-1, got {values}")
    elif all(isinstance(v, str) and v.isdecimal() for v in values):
        values = sorted(values, key=int)  # a CSV's integer labels, read as text: "10" after "9"
    else:
        values = sorted(values, key=str)
    names = [str(v) for v in values]
    unknown = sorted({str(v) for v in valid.labels} - set(names))
    require(not unknown, "validation", f"labels {unknown} do not occur in the training data")
    require(len(names) >= 2, "label_column", f"needs at least two labels in {cfg.data}, got {names}")
    return names, {name: i for i, name in enumerate(names)}


def encode(
    tokenizer: Any, split: Split, label_ids: dict[str, int], max_seq_len: int, token_types: int = 2
) -> list[dict[str, Any]]:
    """Token ids (a pair as ``[CLS] a [SEP] b [SEP]`` with its token types, the longer text truncated
    first) and the label: its class id, or the float target when there are no classes.

    A model with one token-type row (a student this trainer built from a config, RoBERTa-style) reads
    a pair by its separators alone: token types of 1 would index past its embedding.
    """
    encoded = tokenizer(
        split.texts, split.pairs, truncation=True, max_length=max_seq_len, return_token_type_ids=token_types > 1
    )
    labels = [label_ids[str(label)] if label_ids else float(label) for label in split.labels]
    return [{**{key: values[i] for key, values in encoded.items()}, "labels": labels[i]} for i in range(len(labels))]


# ------------------------------------------------------------------------------------------------- model
def resolve_model(uri: str, mlflow: MlflowConfig, scratch: Path, key: str = "model") -> tuple[Path, dict[str, str]]:
    """A local directory as is; an MLflow model URI (``models:/...``, ``runs:/...``) pulled into ``scratch``.
    ``key`` names the config key in the error for a directory that is not a model."""
    path = Path(uri)
    if path.is_dir() or ":/" not in uri:
        if not (path / "config.json").is_file():
            raise ConfigError(f"{key}: {path} is not a Hugging Face model directory (no config.json)")
        return path, {"model_uri": str(path)}
    from trainer.tracking.config import resolve_tracking_uri
    from trainer.tracking.pull import SOURCE_FILE, pull

    pull(uri, scratch, resolve_tracking_uri(mlflow))
    return scratch, json.loads((scratch / SOURCE_FILE).read_text(encoding="utf-8"))


PRIMARY_METRIC = {"classification": "accuracy", "regression": "pearson"}  # what a run is scored by


def on_device(collate: Any, device: torch.device) -> Any:
    """``collate``, with the batch it makes moved to ``device``."""

    def collate_on_device(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return {key: value.to(device) for key, value in collate(rows).items()}

    return collate_on_device


@torch.no_grad()
def evaluate(
    model: Any, collate: Any, examples: list[dict[str, Any]], batch_size: int, names: list[str] | None = None
) -> dict[str, Any]:
    """Validation loss and score: accuracy (with the counts), or for a one-output regression head
    Pearson and Spearman correlation of prediction and target (the loss is then the MSE). With ``names``
    (the class names; ``[]`` for regression), also each example's prediction and label (``predictions``)."""
    model.eval()
    predictions, targets, loss_sum = [], [], 0.0
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start : start + batch_size])
        out = model(**batch)
        predictions.append(out.logits.squeeze(-1) if out.logits.shape[-1] == 1 else out.logits.argmax(-1))
        targets.append(batch["labels"])
        loss_sum += float(out.loss) * len(batch["labels"])
    predicted, target = torch.cat(predictions), torch.cat(targets)
    result: dict[str, Any] = {"total": len(examples), "loss": loss_sum / len(examples)}
    if predicted.is_floating_point():
        spearman = correlation(spearman_ranks(predicted), spearman_ranks(target))
        result.update(pearson=correlation(predicted, target), spearman=spearman)
    else:
        correct = int((predicted == target).sum())
        result.update(accuracy=correct / len(examples), correct=correct)
    if names is not None:
        as_label = (lambda i: names[int(i)]) if names else float
        result["predictions"] = {
            "predicted": [as_label(v) for v in predicted.tolist()],
            "label": [as_label(v) for v in target.tolist()],
        }
    return result


def correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson's r in float64; 0 when either side is constant (a collapsed regressor correlates with nothing)."""
    value = float(torch.corrcoef(torch.stack([x.double(), y.double()]))[0, 1])
    return value if math.isfinite(value) else 0.0


def spearman_ranks(values: torch.Tensor) -> torch.Tensor:
    """Ranks from 1, ties given their mean rank (as Spearman's coefficient needs)."""
    _, inverse, counts = torch.unique(values.double(), return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts + 1
    return (first + (counts - 1) / 2)[inverse]


def start_at_mean(model: Any, targets: list[float]) -> None:
    """Set the regression output's bias to the mean training target. The head starts at zero, and
    AdamW moves a bias by about ``lr`` per step, so a target mean of a few units would otherwise be
    reached only by distorting the encoder, and a short fine-tune would spend itself on the offset."""
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features == 1]
    output = linear[-1]  # the head comes last in every Hugging Face sequence-classification model
    with torch.no_grad():
        output.bias.fill_(sum(targets) / len(targets))


def save_model(model: Any, tokenizer: Any, dest: Path) -> Path:
    """Model and tokenizer, written atomically (see ``common.atomic``)."""
    with atomic_directory(dest) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return dest


def run_spec(cfg: FinetuneConfig, config_path: str | None, source: dict[str, str], labels: list[str]) -> RunSpec:
    tags = {"source_model": source.get("model_uri", cfg.model), "data": cfg.data, "labels": ",".join(labels)}
    tags.update({f"source_{key}": value for key, value in source.items() if key != "model_uri"})
    return RunSpec(
        experiment=cfg.mlflow.experiment,
        run_name=cfg.mlflow.run_name,
        params={key: str(value) for key, value in flatten(to_dict(cfg)).items()},
        tags=tags,
        files=[("config", Path(config_path))] if config_path else [],
        texts={"config/resolved.yaml": yaml.safe_dump(to_dict(cfg), sort_keys=False)},
    )
