"""``python -m trainer evaluate-mlm``: the command line of :mod:`trainer.evaluation.mlm`, whose docstring is its
help."""

from __future__ import annotations

from common.cli import split_model_args
from common.config import load_config
from trainer.evaluation import mlm


def main(argv: list[str]) -> int:
    config, overrides = split_model_args(argv, mlm.__doc__)
    cfg = load_config(mlm.EvaluateMlmConfig, config, overrides)
    report = mlm.evaluate_mlm(cfg)
    for entry in report["models"]:
        print(mlm.format_line(entry))
    for difference in report["differences"]:
        print(mlm.format_difference(difference))
    if cfg.output:
        print(f"written to {cfg.output}")
    return 0
