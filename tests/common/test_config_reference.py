"""docs/config.md must list every config key that the commands accept (and no stale ones)."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from preprocessing.augment import AugmentConfig
from preprocessing.config import PreprocessConfig
from trainer.config import TrainConfig
from trainer.evaluation.mlm import EvaluateMlmConfig
from trainer.evaluation.suite import SuiteConfig
from trainer.finetuning.finetune import FinetuneConfig
from trainer.finetuning.task_distill import TaskDistillConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def dotted_keys(cls: type, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            keys |= dotted_keys(hints[field.name], f"{prefix}{field.name}.")
        else:
            keys.add(prefix + field.name)
    return keys


def documented_keys(section: str) -> set[str]:
    text = DOC.read_text(encoding="utf-8")
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([\w.*]+)` \|", body, flags=re.M))


def test_every_key_is_documented():
    sections = (
        ("preprocessing", PreprocessConfig),
        ("trainer", TrainConfig),
        ("finetune", FinetuneConfig),
        ("evaluate-suite", SuiteConfig),
        ("task-distill", TaskDistillConfig),
        ("augment", AugmentConfig),
        ("evaluate-mlm", EvaluateMlmConfig),
    )
    for section, cls in sections:
        documented = documented_keys(section)
        commands = ("finetune", "evaluate-suite", "task-distill")
        expected = {k for k in dotted_keys(cls) if not (section in commands and k.startswith("mlflow."))}
        expected = {"beam.*" if k == "beam" else k for k in expected}
        assert expected <= documented, f"{section}: undocumented keys {sorted(expected - documented)}"
        stale = documented - expected - {"mlflow.*"}
        assert not stale, f"{section}: docs/config.md lists keys that no longer exist: {sorted(stale)}"
