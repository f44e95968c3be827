"""``python -m trainer COMMAND ...``: one entry point, one module per command.

Each command's module has ``main(argv: list[str]) -> int``; modules load lazily so that ``pull``
never pays for importing DeepSpeed (``plan`` does, about 1.5 s: it reads the ZeRO settings through
DeepSpeed's own config model, which owns their defaults).
"""

from __future__ import annotations

import importlib
import sys

from common.cli import exit_process, run_cli

COMMANDS = {
    "train": ("trainer.commands.train", "distil a student (normally started by `deepspeed launch/run.sh`)"),
    "plan": ("trainer.commands.plan", "validate a config and size the run without training"),
    "export": ("trainer.commands.export", "write a Hugging Face model directory from a checkpoint"),
    "pull": ("trainer.tracking.pull", "download a registered student (models:/NAME@ALIAS) to a directory"),
    "finetune": ("trainer.commands.finetune", "fine-tune a student on a text-classification dataset"),
    "register": ("trainer.tracking.registry", "register an exported student in the MLflow model registry"),
    "promote": ("trainer.tracking.registry", "point an alias at a registered student version"),
    "register-checkpoints": ("trainer.commands.register_checkpoints", "register a run's queued checkpoint students"),
    "task-distill": ("trainer.commands.task_distill", "distil a fine-tuned teacher into a student on a task's data"),
    "evaluate-mlm": ("trainer.commands.evaluate_mlm", "held-out masked-LM accuracy, perplexity, top-1 agreement"),
    "evaluate-suite": ("trainer.commands.evaluate_suite", "fine-tune models on the evaluation suite, one table"),
}


def usage() -> str:
    lines = ["usage: python -m trainer COMMAND [ARGS ...]", "", "commands:"]
    width = max(map(len, COMMANDS))
    lines += [f"  {name:<{width}} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv) if argv[0] in ("register", "promote") else module.main(argv[1:])


if __name__ == "__main__":
    exit_process(run_cli(main))
