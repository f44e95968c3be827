"""``python -m trainer finetune``: the command line of :mod:`trainer.finetuning.finetune`, whose docstring is its
help. ``deepspeed launch/run.sh finetune ...`` starts it on each rank."""

from __future__ import annotations

from common.cli import split_config_args
from common.config import load_config
from trainer.finetuning import finetune


def main(argv: list[str]) -> int:
    path, overrides = split_config_args(argv, finetune.__doc__)
    cfg = load_config(finetune.FinetuneConfig, path, overrides)
    result = finetune.finetune(cfg, config_path=path)
    if not result:  # a rank other than 0: rank 0 reports
        return 0
    if cfg.task == "regression":
        print(f"validation pearson {result['pearson']:.4f} spearman {result['spearman']:.4f} ({result['total']})")
    else:
        print(f"validation accuracy {result['accuracy']:.4f} ({result['correct']}/{result['total']})")
    return 0
