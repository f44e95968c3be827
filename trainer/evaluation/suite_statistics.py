"""The evaluation suite's statistics: chance levels, skill above chance, and paired bootstrap intervals.

A raw share (a student's average over its teacher's) flatters a weak model: a constant predictor already
"keeps" a third of a teacher whose accuracies sit near their tasks' majority classes. So each task's score is
read against *chance*, what a constant predictor scores on the same test examples: the majority class's share
for a classification (accuracy), 0 for a regression (Pearson's r). A model's *skill* is the mean over tasks of
its score above chance; its *share* is its skill over the reference model's.

A difference between two models is only claimed with its 95 % interval: a *paired bootstrap* resamples the
test examples (the same examples for both models, so what they have in common cancels) and the seeds (the same
seed indices for both) ``resamples`` times, and takes the 2.5th and 97.5th percentiles of the difference of
their skills (``percentile`` method). An interval that holds zero is "no measurable difference".

A study that compares variants of a student, each distilled several times (seeds of data order, masking and
new parameters), groups each variant's students: the bootstrap then draws students too (:func:`bootstrap_skills`),
so its intervals cover the distillation's own variance. A study that makes several comparisons decides them
together by Holm's step-down procedure on the bootstrap's p-values (:func:`p_value`, :func:`holm`), so that
the chance of any false "better" among them stays at 5 %.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

SEED = 0  # the resampling is seeded: the same predictions give the same intervals


def chance(labels: list[Any], regression: bool) -> float:
    """What a constant predictor scores: the majority class's share, or a correlation of 0."""
    if regression:
        return 0.0
    return Counter(map(str, labels)).most_common(1)[0][1] / len(labels)


@dataclass
class TaskPredictions:
    """One task's test labels and every model's predictions on them: ``predicted[model]`` is
    ``[seed][example]`` (class labels as text, or regression values)."""

    labels: list[Any]
    predicted: list[list[list[Any]]]
    regression: bool

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(predicted [models, seeds, examples], labels [examples])`` as numbers (classes: their index)."""
        if self.regression:
            return np.asarray(self.predicted, dtype=np.float64), np.asarray(self.labels, dtype=np.float64)
        classes = {name: i for i, name in enumerate(sorted({str(v) for v in self.labels}))}
        index = np.vectorize(lambda v: classes.get(str(v), -1), otypes=[np.int64])
        return index(np.asarray(self.predicted, dtype=object)), index(np.asarray(self.labels, dtype=object))


def scores(predicted: np.ndarray, labels: np.ndarray, regression: bool) -> np.ndarray:
    """The metric of each ``[..., examples]`` row of predictions against ``labels``: accuracy, or Pearson's r
    (0 where a row or the labels are constant, as the fine-tuning's own correlation reports it)."""
    if not regression:
        return (predicted == labels).mean(axis=-1)
    x = predicted - predicted.mean(axis=-1, keepdims=True)
    y = labels - labels.mean()
    norms = np.sqrt((x * x).sum(axis=-1) * (y * y).sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        r = (x * y).sum(axis=-1) / norms
    return np.where(norms > 0, r, 0.0)


def score(predicted: list[Any], labels: list[Any], regression: bool) -> float:
    """One model's metric on one task's test examples, as the bootstrap computes it."""
    arrays = TaskPredictions(labels, [[predicted]], regression).arrays()
    return float(scores(*arrays, regression)[0, 0])


def bootstrap_skills(
    tasks: list[TaskPredictions], chances: list[float], resamples: int, groups: list[list[int]] | None = None
) -> np.ndarray:
    """``[resamples, groups, tasks]``: each group's mean score above chance on each task, on each paired resample
    (the mean over the last axis is the skill). A group is the models that are replicates of one variant
    (students distilled with different seeds); by default each model is its own group.

    Each resample draws, per task, the test examples (shared by every group: paired) and the fine-tuning seed
    indices (shared too), and, per group of more than one, its students with replacement: a hierarchical
    bootstrap over students, then seeds, then examples, so an interval covers the distillation's own variance
    as well as the fine-tuning's and the test set's."""
    rng = np.random.default_rng(SEED)
    arrays = [task.arrays() for task in tasks]
    groups = groups or [[m] for m in range(arrays[0][0].shape[0])]
    alone = [g for g, members in enumerate(groups) if len(members) == 1]  # scored together, as one array
    models = [groups[g][0] for g in alone]
    above = np.zeros((resamples, len(groups), len(tasks)))
    for b in range(resamples):
        for t, ((predicted, labels), task, level) in enumerate(zip(arrays, tasks, chances, strict=True)):
            n, seeds = labels.shape[0], predicted.shape[1]
            examples = rng.integers(0, n, n)
            chosen = rng.integers(0, seeds, seeds)
            resampled = predicted[models][:, chosen][:, :, examples]  # [models, seeds, examples]
            above[b, alone, t] = scores(resampled, labels[examples], task.regression).mean(axis=1) - level
            for g, members in enumerate(groups):
                if len(members) > 1:
                    students = rng.choice(members, len(members))  # replicates drawn with replacement
                    resampled = predicted[students][:, chosen][:, :, examples]  # [students, seeds, examples]
                    above[b, g, t] = scores(resampled, labels[examples], task.regression).mean() - level
    return above


def p_value(samples: np.ndarray) -> float:
    """The bootstrap's two-sided p-value for "no difference": twice the share of resamples on the smaller side
    of zero, at most 1. A resample at exactly zero (common on a few test examples) counts half to each side."""
    ties = (samples == 0).mean() / 2
    return float(min(1.0, 2 * min((samples < 0).mean() + ties, (samples > 0).mean() + ties)))


def holm(p_values: list[float], level: float = 0.05) -> list[bool]:
    """Which of ``m`` comparisons Holm's step-down procedure rejects at family-wise ``level``: the k-th smallest
    p-value (k from 0) must be at most ``level / (m - k)``, and once one is not, no larger one is."""
    rejected = [False] * len(p_values)
    for k, i in enumerate(sorted(range(len(p_values)), key=lambda i: p_values[i])):
        if p_values[i] > level / (len(p_values) - k):
            break
        rejected[i] = True
    return rejected


def interval(samples: np.ndarray) -> list[float]:
    """The 95 % percentile interval of ``samples``."""
    low, high = np.percentile(samples, [2.5, 97.5])
    return [float(low), float(high)]


def verdict(ci: list[float], first: str, second: str) -> str:
    if ci[0] > 0:
        return f"{first} better"
    if ci[1] < 0:
        return f"{second} better"
    return "no measurable difference"


def described(difference: dict[str, Any], first: str, second: str) -> str:
    """``+0.087 [+0.066, +0.107]: MiniLM better``: a ``{difference, ci95, verdict}`` record in words, the verdict's
    "first" and "second" named."""
    low, high = difference["ci95"]
    said = difference["verdict"].replace("first", first).replace("second", second)
    return f"{difference['difference']:+.3f} [{low:+.3f}, {high:+.3f}]: {said}"
