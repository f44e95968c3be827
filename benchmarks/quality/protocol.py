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
by Holm's step-down procedure on the bootstrap's p-values.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from trainer.evaluation import suite_statistics as stats  # noqa: E402
from trainer.evaluation.suite import SuiteConfig, expand, labels_of_test, load_tasks  # noqa: E402

KEYS = {"study", "question", "family", "scale", "variants", "distillation_seeds", "suite", "comparisons", "decision"}
SEED_SUFFIX = re.compile(r"-s(\d+)$")


def load(path: Path) -> dict[str, Any]:
    """The protocol at ``path``, checked: every key known and present, each comparison between its variants."""
    protocol = yaml.safe_load(Path(path).read_text(encoding="utf-8"))

    def require(ok: bool, message: str) -> None:
        if not ok:
            raise SystemExit(f"{path}: {message}")

    require(isinstance(protocol, dict), "not a mapping")
    require(protocol.keys() == KEYS, f"keys must be {sorted(KEYS)}; got {sorted(protocol)}")
    variants = protocol["variants"]
    for first, second in protocol["comparisons"]:
        require({first, second} <= set(variants), f"comparison {first} - {second}: not among variants {variants}")
    require(len(protocol["distillation_seeds"]) >= 1, "distillation_seeds: give at least one")
    require(protocol["decision"] == {"level": protocol["decision"]["level"], "correction": "holm"}, "decision")
    SuiteConfig(models=["unused"], **protocol["suite"]).validate()  # the suite's own checks, by its own names
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
    protocol: dict[str, Any], suite: dict[str, Any], exploratory: list[tuple[str, str]] = (), resamples: int = 1000
) -> list[dict[str, Any]]:
    """Every comparison on the suite's skill above chance, computed from its predictions: the protocol's, decided
    together by Holm's procedure (``confirmatory``), then ``exploratory`` ones, each decided alone at the
    protocol's level and labelled so. Each: the pair, the replicate counts, the difference of skill, its 95 %
    interval (not adjusted), the bootstrap p-value, the Holm-adjusted verdict where it applies."""
    differs = [key for key, value in protocol["suite"].items() if suite["config"].get(key) != value]
    if differs:  # a suite run with other settings than the protocol fixed answers another question
        raise SystemExit(f"the suite did not run as the protocol says: {', '.join(differs)} differ")
    cfg = SuiteConfig(**{k: v for k, v in suite["config"].items() if k != "mlflow"})
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
    level = protocol["decision"]["level"]
    point = {v: sum(suite["models"][i]["skill"] for i in groups[v]) / len(groups[v]) for v in named}
    found = []
    for (first, second), kind in pairs:
        samples = skills[:, named.index(first)] - skills[:, named.index(second)]
        found.append(
            {
                "first": first,
                "second": second,
                "kind": kind,
                "students": [len(groups[first]), len(groups[second])],
                "difference": point[first] - point[second],  # of the variants' mean skills over their students
                "ci95": stats.interval(samples),
                "p": stats.p_value(samples),
            }
        )
    confirmatory = [c for c in found if c["kind"] == "confirmatory"]
    holds = dict(zip(map(id, confirmatory), stats.holm([c["p"] for c in confirmatory], level), strict=True))
    for c in found:  # an exploratory comparison is decided alone, at the protocol's level, and labelled so
        significant = holds[id(c)] if c["kind"] == "confirmatory" else c["p"] <= level
        better = "first better" if c["difference"] > 0 else "second better"
        c["verdict"] = better if significant else "no measurable difference"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("protocol", type=Path)
    parser.add_argument("--shell", action="store_true", help="print the settings ablation.sh takes from it")
    args = parser.parse_args()
    protocol = load(args.protocol)
    print(shell(protocol) if args.shell else yaml.safe_dump(protocol, sort_keys=False), end="\n")


if __name__ == "__main__":
    main()
