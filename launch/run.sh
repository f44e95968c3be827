#!/usr/bin/env bash
"""exec" "${PYTHON:-python3}" -u "$0" "$@"
"""
# One file, two languages. Run by bash (`bash launch/run.sh CONFIG.yaml [key=value ...]`), the
# line above re-executes this file with Python as a single process. Run by the DeepSpeed launcher
# (`deepspeed launch/run.sh CONFIG.yaml ...`), which starts `python -u launch/run.sh
# --local_rank=N CONFIG.yaml ...` per rank, Python reads that line as a string and runs the code
# below. RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment, so
# the --local_rank argument is dropped. A first argument `task-distill` runs task-specific
# distillation (trainer/commands/task_distill.py), `finetune` fine-tuning (trainer/commands/finetune.py),
# instead of pre-training distillation.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cli import exit_process, run_cli

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
if args[:1] == ["task-distill"]:
    from trainer.commands.task_distill import main

    args = args[1:]
elif args[:1] == ["finetune"]:
    from trainer.commands.finetune import main

    args = args[1:]
else:
    from trainer.commands.train import main
exit_process(run_cli(main, args))  # without the last garbage collection: common/fast_exit.py
