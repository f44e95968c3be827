"""A non-finite step stops the run before anything is saved, naming the step and the checkpoint to resume from."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import REPO

from trainer.runtime.guard import FiniteGuard, NonFiniteStepError


def test_the_first_bad_step_is_reported_and_finite_steps_pass(tmp_path: Path) -> None:
    guard = FiniteGuard(torch.device("cpu"))
    guard.observe(1, torch.tensor(2.5))
    guard.observe(1, 0.7)  # a grad norm as DeepSpeed may return it: a float
    guard.observe(2, None)  # no grad norm this step
    guard.check(None)
    guard.observe(3, torch.tensor(math.inf))
    guard.observe(4, torch.tensor(math.nan))
    with pytest.raises(NonFiniteStepError, match=r"step 3: .*not finite.*step-00000002") as err:
        guard.check(tmp_path / "step-00000002")
    assert "resume" in str(err.value)
    with pytest.raises(NonFiniteStepError, match="no checkpoint was saved"):
        guard.check(None)


def test_a_nan_loss_fails_the_run_before_the_next_checkpoint(
    tmp_path: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path
) -> None:
    """The real loop (one process, DeepSpeed ZeRO-2 on the CPU); the loss of step 3 is made NaN."""
    output = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import math
        from common.cli import run_cli
        from trainer.commands import train
        from trainer.objective.distiller import Distiller

        forward, calls = Distiller.forward, []

        def poisoned(self, batch, attention_mask):
            out = forward(self, batch, attention_mask)
            calls.append(1)
            if len(calls) == 2 * 2 + 1:  # the first micro-batch of step 3 (accumulation 2 on one rank)
                out["loss"] = out["loss"] * math.nan
            return out

        Distiller.forward = poisoned
        raise SystemExit(run_cli(train.main, [
            "configs/tiny-cpu.yaml", "teacher={tiny_teacher_dir}", "data={tiny_dataset_dir}",
            "output_dir={output}", "max_steps=6", "global_batch_size=4", "checkpoint.every_steps=2",
            "logging.every_steps=5", "eval.every_steps=100", "loader.num_workers=0",
        ]))
        """
    )
    env = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "NonFiniteStepError: step 3: the loss or the gradient norm is not finite" in proc.stderr, proc.stderr[-3000:]
    assert f"resume from the last good checkpoint, {output / 'checkpoints' / 'step-00000002'}" in proc.stderr
    checkpoints = output / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-00000002"
    assert not (checkpoints / "step-00000004").exists()  # the poisoned weights were never saved
    assert not (output / "student").exists()
