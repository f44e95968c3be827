"""``python -m trainer task-distill``: the command line of :mod:`trainer.finetuning.task_distill`, whose docstring
is its help. ``deepspeed launch/run.sh task-distill ...`` starts it on each rank."""

from __future__ import annotations

from common.cli import split_config_args
from common.config import load_config
from trainer.finetuning import task_distill
from trainer.finetuning.finetune import PRIMARY_METRIC


def main(argv: list[str]) -> int:
    path, overrides = split_config_args(argv, task_distill.__doc__)
    cfg = load_config(task_distill.TaskDistillConfig, path, overrides)
    result = task_distill.task_distill(cfg, config_path=path)
    if result:  # rank 0 reports
        metric = PRIMARY_METRIC[cfg.task]
        tested = f"; test {metric} {result['test'][metric]:.4f}" if "test" in result else ""
        print(
            f"best validation {metric} {result[metric]:.4f} at step {result['best_step']}{tested}; "
            f"model in {result['model']}"
        )
    return 0
