"""The linear probe: what a linear model reads from a model's frozen features (``evaluate-suite method=probe``).

Each text is encoded once by the frozen model (eval mode, no gradient, float32) and its last hidden
states are averaged over its real tokens: the pooling that sentence-embedding encoders such as
all-MiniLM-L6-v2 are trained for, and one that needs no trained weights of its own, so a student
(which has no pooler) is read on the same footing as its teacher. A sentence pair is encoded as two
texts, ``u`` and ``v``, and represented by ``(u, v, |u - v|, u * v)`` (InferSent's and SentEval's
features). The features are standardised with the training split's statistics, then a linear model
is fitted on the training split and scored on the validation split:

* classification: a ridge classifier (ridge regression on one-hot targets, the class with the
  highest score predicted), scored by accuracy;
* regression: ridge regression, scored by Pearson's r.

Ridge for both, rather than logistic regression for classes, because it is solved in closed form:
exact, deterministic, and cheap enough to cross-validate its penalty (40 fits a task), where an
iterative logistic fit (L-BFGS) cost seconds a fit. For comparing models, what matters is that
every model is read by the same linear model. The fits run in float64 where the features are, on
the encoder's device, so that on a GPU machine the CPU does none of the arithmetic (the ablation's
second GPU run, with the fits still on the CPU, spent 8-36 s a model and task), and a fold's Gram
matrix is formed once for all the penalties: it is the fit's largest cost.

The penalty's weight is chosen from a fixed grid by 5-fold cross-validation on the training split
(interleaved folds: the task files are shuffled, so each fold is a fair sample), by the task's own
metric, the larger weight on a tie: a fixed weight would favour whichever model's features happen
to suit it. The probe needs more examples than the fine-tune's 500 (384 or more features each), so
evaluate-suite gives it all the data by default.

Why a probe beside fine-tuning: the suite's fine-tune (32 steps from a fresh pooler and head) moves
with its seed by several points, which hides differences of that size between students. The
probe has no seed and no optimisation noise (the same model gives the same score to the last digit
on the CPU), and costs about a forward pass over the examples. What it measures is narrower: the
information a linear model can read from the frozen representation, not how well the model learns
a task, which is what fine-tuning measures and what a user will do with a student.
"""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path
from typing import Any

import torch

from common.tokenizer import load_tokenizer
from trainer.modeling import load_teacher
from trainer.runtime.ranks import local_device

log = logging.getLogger(__name__)

PENALTIES = tuple(10.0**k for k in range(-1, 7))  # the ridge penalty's grid, 0.1 to 1e6 (scikit-learn's alpha)
FOLDS = 5


def probe(
    model_dir: str, task: dict[str, Any], data: dict[str, Path], max_seq_len: int, batch_size: int
) -> dict[str, Any]:
    """``task``'s metric (accuracy or Pearson's r) of a linear model on ``model_dir``'s frozen features:
    fitted on ``data["train"]`` (its penalty chosen by cross-validation there), scored on ``data["test"]``
    (JSONL files of the task's columns). Returns ``score`` and each test example's ``predictions``
    (``predicted`` and ``label``: class labels, or regression values)."""
    # frozen, eval mode, a head not needed; on the GPU where there is one, and the ridge fits with it
    model = load_teacher(model_dir, torch.float32).base_model.to(local_device())
    tokenizer = load_tokenizer(model_dir)
    splits = {split: read_jsonl(data[split]) for split in ("train", "test")}

    def features(rows: list[dict[str, Any]]) -> torch.Tensor:
        u = encode(model, tokenizer, [row[task["text_column"]] for row in rows], max_seq_len, batch_size)
        if task["kind"] != "pair":
            return u
        v = encode(model, tokenizer, [row[task["text_pair_column"]] for row in rows], max_seq_len, batch_size)
        return torch.cat([u, v, (u - v).abs(), u * v], dim=-1)

    x_train, x_valid = standardise(features(splits["train"]), features(splits["test"]))
    labels_train = [row[task["label_column"]] for row in splits["train"]]
    labels_valid = [row[task["label_column"]] for row in splits["test"]]
    device = x_train.device
    if task["kind"] == "regression":
        y_train, y_valid = (
            torch.tensor(labels, dtype=torch.float64, device=device) for labels in (labels_train, labels_valid)
        )
    else:  # class indices; a test label never seen in training counts as wrong (index -1)
        classes = sorted(set(labels_train), key=str)
        index = {label: i for i, label in enumerate(classes)}
        y_train, y_valid = (
            torch.tensor([index.get(label, -1) for label in labels], device=device)
            for labels in (labels_train, labels_valid)
        )
    penalty = cross_validated_penalty(x_train, y_train)
    predicted = Ridge(x_train, y_train).predict(x_valid, penalty)
    score = metric(predicted, y_valid)
    log.info("probe: %s | %s | penalty %g | %s %.4f", model_dir, task["name"], penalty, task["metric"], score)
    as_label = float if task["kind"] == "regression" else (lambda i: classes[int(i)])
    return {
        "score": score,
        "predictions": {"predicted": [as_label(v) for v in predicted.tolist()], "label": labels_valid},
    }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@torch.no_grad()
def encode(model: Any, tokenizer: Any, texts: list[str], max_seq_len: int, batch_size: int) -> torch.Tensor:
    """``[len(texts), width]`` float64 on the model's device: each text's last hidden states averaged
    over its real tokens."""
    pooled = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(
            texts[start : start + batch_size],
            truncation=True,
            max_length=max_seq_len,
            padding=True,
            return_tensors="pt",
        )
        input_ids, attention_mask = batch["input_ids"].to(model.device), batch["attention_mask"].to(model.device)
        hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        real = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled.append(((hidden * real).sum(1) / real.sum(1)).double())
    return torch.cat(pooled)


def standardise(train: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both splits scaled to zero mean and unit variance per feature, by the training split's statistics
    (a constant feature is left at zero), so that one penalty weighs every feature alike."""
    mean, std = train.mean(0), train.std(0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    return (train - mean) / std, (valid - mean) / std


def cross_validated_penalty(x: torch.Tensor, y: torch.Tensor) -> float:
    """The grid's penalty with the best mean held-out metric over the folds (the larger on a tie)."""
    fold = torch.arange(len(x), device=x.device) % FOLDS
    held_out = {penalty: 0.0 for penalty in PENALTIES}  # summed over the folds, in fold order
    for k in range(FOLDS):
        fit = Ridge(x[fold != k], y[fold != k])  # the fold's Gram matrix, once for every penalty
        for penalty in PENALTIES:
            held_out[penalty] += metric(fit.predict(x[fold == k], penalty), y[fold == k])
    return max(reversed(PENALTIES), key=lambda penalty: held_out[penalty] / FOLDS)  # the first best: the largest


class Ridge:
    """Ridge regression of ``y`` on ``x``, minimising |x W + b - y|^2 + penalty |W|^2 with the intercept
    ``b`` unpenalised, prepared for any penalty: the centred Gram matrix ``x'x`` (2 n d^2 operations,
    the fit's largest cost) and ``x'y`` are formed once, each penalty then costs one d x d solve.
    ``y`` holds float targets (regression) or class indices (a one-hot column a class; predicted: the
    class whose column scores highest)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.classes = not y.is_floating_point()
        targets = torch.nn.functional.one_hot(y, int(y.max()) + 1).to(x.dtype) if self.classes else y.unsqueeze(-1)
        self.x_mean, self.y_mean = x.mean(0), targets.mean(0)  # centred here, so the intercept is y's mean
        xc = x - self.x_mean
        self.gram = xc.T @ xc
        self.xty = xc.T @ (targets - self.y_mean)

    def predict(self, x_eval: torch.Tensor, penalty: float) -> torch.Tensor:
        eye = torch.eye(self.gram.shape[0], dtype=self.gram.dtype, device=self.gram.device)
        weight = torch.linalg.solve(self.gram + penalty * eye, self.xty)
        scores = (x_eval - self.x_mean) @ weight + self.y_mean
        return scores.argmax(-1) if self.classes else scores.squeeze(-1)


def metric(predicted: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson's r for regression, accuracy for classes."""
    if not y.is_floating_point():
        return float((predicted == y).double().mean())
    a, b = predicted - predicted.mean(), y - y.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))
