"""``python -m trainer evaluate-suite``: the command line of :mod:`trainer.evaluation.suite`, whose docstring is
its help."""

from __future__ import annotations

from common.cli import split_model_args
from common.config import load_config
from trainer.evaluation import suite


def main(argv: list[str]) -> int:
    config, overrides = split_model_args(argv, suite.__doc__)
    cfg = load_config(suite.SuiteConfig, config, overrides)
    report = suite.evaluate_suite(cfg)
    print(suite.format_table(report))
    print(f"written to {cfg.output}")
    return 0
