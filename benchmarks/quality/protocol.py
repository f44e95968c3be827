"""A study's protocol: what it compares, with which runs and seeds, and how it decides, fixed before it runs.

    python benchmarks/quality/protocol.py PROTOCOL.yaml --shell   # the settings, as ablation.sh reads them

A protocol (``benchmarks/quality/protocols/*.yaml``) names the study's teacher family, its variants (those of
``ablation/variants.sh``), the distillation seeds every trained variant is run with, the evaluation suite's
settings (sizes, fine-tuning seeds, the rate grid), the comparisons (``first - second`` on the suite's skill
above chance) and the decision rule (a family-wise level, Holm's correction). Its commit must precede its
results' commit (``benchmarks/results.py --check`` verifies it): the comparisons are the study's confirmatory
ones; any other a report adds is exploratory and labelled so.

:func:`decide` computes every comparison from the suite's committed per-example predictions: the students of
one variant are replicates, and the bootstrap draws students, then fine-tuning seeds, then test examples
(``trainer.evaluation.suite_statistics.bootstrap_skills``); the confirmatory comparisons are decided together
by Holm's step-down procedure on the bootstrap's p-values (:func:`judged`).

A task study (``benchmarks/quality/task_distill_evidence.py``) has its own shape (:func:`load_task_study`): one
task, its sizes, the rows it trains, the seeds each row runs at (each seed a whole replicate: the student's
fine-tuning or distillation seed), their budgets, its confirmatory and exploratory comparisons and the same
decision rule. :func:`decide_task_study` decides them from the rows' per-example test predictions: the bootstrap
draws seeds, then test examples, and :func:`judged` decides as for an ablation.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from trainer.evaluation import suite_statistics as stats  # noqa: E402
from trainer.evaluation.suite import SuiteConfig, expand, labels_of_test, load_tasks, reported_config  # noqa: E402

KEYS = {"study", "question", "family", "scale", "variants", "distillation_seeds", "suite", "comparisons", "decision"}
TASK_STUDY_KEYS = {"study", "question", "task", "sizes", "seeds", "rows", "settings", "budgets", "comparisons"}
TASK_STUDY_KEYS |= {"exploratory", "decision"}
SEED_SUFFIX = re.compile(r"-s(\d+)$")
RESAMPLES = 1000  # the bootstrap's, for every study: part of the decision rule, not a setting


def require(ok: bool, path: Path, message: str) -> None:
    if not ok:
        raise SystemExit(f"{path}: {message}")


def checked(path: Path, keys: set[str], compared: str) -> dict[str, Any]:
    """The protocol at ``path``, with what every study's shares checked: exactly ``keys``, each comparison
    (confirmatory, or exploratory where it lists them) between two of its ``compared`` list, the decision
    rule Holm's procedure at a level."""
    protocol = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    require(isinstance(protocol, dict), path, "not a mapping")
    require(protocol.keys() == keys, path, f"keys must be {sorted(keys)}; got {sorted(protocol)}")
    named = protocol[compared]
    for first, second in protocol["comparisons"] + protocol.get("exploratory", []):
        require({first, second} <= set(named), path, f"comparison {first} - {second}: not among {compared} {named}")
    require(protocol["decision"] == {"level": protocol["decision"]["level"], "correction": "holm"}, path, "decision")
    return protocol


def load(path: Path) -> dict[str, Any]:
    """The ablation protocol at ``path``, checked: every key known and present, each comparison between its
    variants."""
    protocol = checked(path, KEYS, "variants")
    require(len(protocol["distillation_seeds"]) >= 1, path, "distillation_seeds: give at least one")
    SuiteConfig(models=["unused"], **protocol["suite"]).validate()  # the suite's own checks, by its own names
    return protocol


def load_task_study(path: Path) -> dict[str, Any]:
    """The task study's protocol at ``path``, checked: its keys, its comparisons between its rows, at least two
    seeds (the bootstrap draws them), the suite's checks of its sizes, and compute matched: the controls
    fine-tune for as many epochs as the distilled rows train (``finetune_epochs`` = ``layer_epochs`` +
    ``prediction_epochs``), so a teacher's effect is not more training's."""
    protocol = checked(path, TASK_STUDY_KEYS, "rows")
    seeds, sizes, budgets = protocol["seeds"], protocol["sizes"], protocol["budgets"]
    require(len(set(seeds)) == len(seeds) >= 2, path, f"seeds: give at least two, none twice; got {seeds}")
    require(sizes.keys() == {"train", "dev", "test"}, path, f"sizes: give train, dev and test; got {sorted(sizes)}")
    matched = budgets["layer_epochs"] + budgets["prediction_epochs"]
    require(budgets["finetune_epochs"] == matched, path, f"budgets: finetune_epochs must be {matched} (matched)")
    config = SuiteConfig(models=["unused"], train_size=sizes["train"], dev_size=sizes["dev"], valid_size=sizes["test"])
    config.validate()
    return protocol


def variant_of(run: str, family: str) -> str:
    """``minilm-a5x-s2`` -> ``a5x``."""
    return SEED_SUFFIX.sub("", run).removeprefix(f"{family}-")


def shell(protocol: dict[str, Any]) -> str:
    """The settings ablation.sh takes from a protocol, as shell assignments."""
    suite = [f"{key}={json.dumps(value, separators=(',', ':'))}" for key, value in protocol["suite"].items()]
    return "\n".join(
        [
            f"PROTOCOL_SCALE={shlex.quote(protocol['scale'])}",
            f"ABLATION_FAMILIES={shlex.quote(protocol['family'])}",
            f"ABLATION_VARIANTS={shlex.quote(' '.join(protocol['variants']))}",
            f"ABLATION_SEEDS={shlex.quote(' '.join(map(str, protocol['distillation_seeds'])))}",
            f"PROTOCOL_SUITE=({' '.join(shlex.quote(item) for item in suite)})",
        ]
    )


def decide(
    protocol: dict[str, Any], suite: dict[str, Any], exploratory: list[tuple[str, str]] = (), resamples: int = RESAMPLES
) -> list[dict[str, Any]]:
    """Every comparison on the suite's skill above chance, computed from its predictions: the protocol's, decided
    together by Holm's procedure (``confirmatory``), then ``exploratory`` ones, each decided alone at the
    protocol's level and labelled so. Each: the pair, the replicate counts, the difference of skill, its 95 %
    interval (not adjusted), the bootstrap p-value, the Holm-adjusted verdict where it applies."""
    differs = [key for key, value in protocol["suite"].items() if suite["config"].get(key) != value]
    if differs:  # a suite run with other settings than the protocol fixed answers another question
        raise SystemExit(f"the suite did not run as the protocol says: {', '.join(differs)} differ")
    cfg = reported_config(suite)
    tasks = load_tasks(cfg)
    family = protocol["family"]
    groups: dict[str, list[int]] = {}
    for index, entry in enumerate(suite["models"][1:], start=1):  # the first model is the teacher
        name = Path(entry["model"]).parent.name if entry["model"].endswith("/student") else entry["model"]
        groups.setdefault(variant_of(name, family), []).append(index)
    predictions = [
        stats.TaskPredictions(
            labels_of_test(cfg, task),
            [[expand(m["tasks"][name]["predictions"][str(s)], task) for s in cfg.seeds] for m in suite["models"]],
            task["kind"] == "regression",
        )
        for name, task in tasks.items()
    ]
    chances = [suite["tasks"][name]["chance"] for name in tasks]
    pairs = [(tuple(p), "confirmatory") for p in protocol["comparisons"]]
    pairs += [(tuple(p), "exploratory") for p in exploratory if list(p) not in protocol["comparisons"]]
    named = sorted({v for (pair, _) in pairs for v in pair})
    missing = [v for v in named if v not in groups]
    if missing:
        raise SystemExit(f"the suite scored no student of {missing} (it has {sorted(groups)})")
    skills = stats.bootstrap_skills(predictions, chances, resamples, [groups[v] for v in named]).mean(axis=2)
    point = {v: sum(suite["models"][i]["skill"] for i in groups[v]) / len(groups[v]) for v in named}
    students = {v: len(groups[v]) for v in named}
    return judged(pairs, dict(zip(named, skills.T, strict=True)), point, students, protocol["decision"]["level"])


def judged(
    pairs: list[tuple[tuple[str, str], str]],
    samples: dict[str, np.ndarray],
    point: dict[str, float],
    students: dict[str, int],
    level: float,
) -> list[dict[str, Any]]:
    """Each ``((first, second), kind)`` pair compared: the difference of the ``point`` estimates, its 95 %
    interval and p-value from the two names' paired bootstrap ``samples`` (one value a resample); the
    confirmatory pairs decided together by Holm's procedure at ``level``, an exploratory one alone at
    ``level`` (and labelled so). ``students``: each name's replicates, recorded beside the pair."""
    found = []
    for (first, second), kind in pairs:
        difference = samples[first] - samples[second]
        found.append(
            {
                "first": first,
                "second": second,
                "kind": kind,
                "students": [students[first], students[second]],
                "difference": point[first] - point[second],  # of the names' means over their replicates
                "ci95": stats.interval(difference),
                "p": stats.p_value(difference),
            }
        )
    confirmatory = [c for c in found if c["kind"] == "confirmatory"]
    holds = dict(zip(map(id, confirmatory), stats.holm([c["p"] for c in confirmatory], level), strict=True))
    for c in found:  # an exploratory comparison is decided alone, at the protocol's level, and labelled so
        significant = holds[id(c)] if c["kind"] == "confirmatory" else c["p"] <= level
        better = "first better" if c["difference"] > 0 else "second better"
        c["verdict"] = better if significant else "no measurable difference"
    return found


def decide_task_study(protocol: dict[str, Any], predicted: dict[str, dict[str, list[Any]]]) -> dict[str, Any]:
    """A task study's figures from its rows' test predictions (``predicted[row][seed]``, as
    ``trainer.evaluation.suite.compact`` keeps them, in the test file's order) and the task files: the
    chance level, each row's score at each seed, and the protocol's comparisons (then its exploratory ones) of
    the rows' mean scores. The bootstrap draws the seeds (the same seed indices for every row), then the test
    examples (the same for every row): paired, as the suite's. What the study records, and what
    ``benchmarks/results.py --check`` computes again."""
    sizes, rows = protocol["sizes"], protocol["rows"]
    cfg = SuiteConfig(models=["unused"], tasks=[protocol["task"]], valid_size=sizes["test"])
    task = load_tasks(cfg)[protocol["task"]]
    labels, regression = labels_of_test(cfg, task), task["kind"] == "regression"
    seeds = [str(seed) for seed in protocol["seeds"]]
    missing = [f"{row} seed {s}" for row in rows for s in seeds if s not in predicted.get(row, {})]
    if missing:
        raise SystemExit(f"the study has no predictions of {', '.join(missing)}")
    expanded = [[expand(predicted[row][s], task) for s in seeds] for row in rows]
    chance = stats.chance(labels, regression)
    scores = {row: [stats.score(p, labels, regression) for p in each] for row, each in zip(rows, expanded, strict=True)}
    skills = stats.bootstrap_skills([stats.TaskPredictions(labels, expanded, regression)], [chance], RESAMPLES)
    pairs = [(tuple(p), "confirmatory") for p in protocol["comparisons"]]
    pairs += [(tuple(p), "exploratory") for p in protocol["exploratory"]]
    point = {row: statistics.mean(scores[row]) - chance for row in rows}
    level = protocol["decision"]["level"]
    found = judged(
        pairs, dict(zip(rows, skills[:, :, 0].T, strict=True)), point, dict.fromkeys(rows, len(seeds)), level
    )
    return {"chance": chance, "scores": scores, "comparisons": found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("protocol", type=Path)
    parser.add_argument("--shell", action="store_true", help="print the settings ablation.sh takes from it")
    args = parser.parse_args()
    protocol = load(args.protocol)
    print(shell(protocol) if args.shell else yaml.safe_dump(protocol, sort_keys=False), end="\n")


if __name__ == "__main__":
    main()
