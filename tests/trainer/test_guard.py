"""A non-finite step stops the run before anything is saved, naming the step and the checkpoint to resume from."""

from __future__ import annotations

import json
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


def poisoned_run(output: Path, teacher: Path, data: Path, poison: str, *overrides: str) -> subprocess.CompletedProcess:
    """The real loop (one process, DeepSpeed on the CPU: tiny-cpu.yaml's ZeRO-2 unless ``overrides`` say otherwise;
    6 steps of 2 micro-batches, a checkpoint every 2 steps); the first micro-batch of step 3 gets a NaN ``loss``,
    or a finite loss whose ``gradients`` are NaN."""
    script = textwrap.dedent(
        f"""
        import math
        import torch
        from common.cli import run_cli
        from trainer.commands import train
        from trainer.objective.distiller import Distiller

        class NanGradient(torch.autograd.Function):
            forward = staticmethod(lambda ctx, x: x.clone())
            backward = staticmethod(lambda ctx, grad: grad * math.nan)

        forward, calls = Distiller.forward, []

        def poisoned(self, batch, attention_mask):
            out = forward(self, batch, attention_mask)
            calls.append(1)
            if len(calls) == 2 * 2 + 1:  # the first micro-batch of step 3 (accumulation 2 on one rank)
                out["loss"] = out["loss"] * math.nan if {poison!r} == "loss" else NanGradient.apply(out["loss"])
            return out

        Distiller.forward = poisoned
        raise SystemExit(run_cli(train.main, [
            "configs/tiny-cpu.yaml", "teacher={teacher}", "data={data}",
            "output_dir={output}", "max_steps=6", "global_batch_size=4", "checkpoint.every_steps=2",
            "logging.every_steps=5", "eval.every_steps=100", "loader.num_workers=0", *{list(overrides)!r},
        ]))
        """
    )
    env = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


def assert_stopped_at_step_3(proc: subprocess.CompletedProcess, output: Path) -> None:
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "NonFiniteStepError: step 3: the loss or the gradient norm is not finite" in proc.stderr, proc.stderr[-3000:]
    assert f"resume from the last good checkpoint, {output / 'checkpoints' / 'step-00000002'}" in proc.stderr
    checkpoints = output / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-00000002"
    assert not (checkpoints / "step-00000004").exists()  # the poisoned weights were never saved
    assert not (output / "student").exists()


@pytest.mark.full
def test_a_nan_loss_fails_the_run_before_the_next_checkpoint(
    tmp_path: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path
) -> None:
    output = tmp_path / "run"
    assert_stopped_at_step_3(poisoned_run(output, tiny_teacher_dir, tiny_dataset_dir, "loss"), output)


@pytest.mark.full
@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_bf16_nan_gradients_stop_the_run_by_default(
    zero: str, tmp_path: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path
) -> None:
    """bf16, a finite loss with NaN gradients: the guard stops the run at the step's gradient norm. ZeRO-2's own
    per-gradient check is off (``deepspeed_config``), so it applies the step; ZeRO-3 skips it on its own, and the
    guard stops the run all the same."""
    output = tmp_path / "run"
    overrides = ("deepspeed.precision=bf16", f"deepspeed.config=configs/deepspeed/{zero}.json")
    assert_stopped_at_step_3(poisoned_run(output, tiny_teacher_dir, tiny_dataset_dir, "gradients", *overrides), output)


@pytest.mark.full
def test_bf16_nan_gradients_skip_the_step_when_asked(
    tmp_path: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path
) -> None:
    """With ``deepspeed.bf16_skip_nonfinite`` DeepSpeed skips that one step and the run trains on to its export,
    the step's norm logged as not finite."""
    output = tmp_path / "run"
    overrides = ("deepspeed.precision=bf16", "deepspeed.bf16_skip_nonfinite=true")
    proc = poisoned_run(output, tiny_teacher_dir, tiny_dataset_dir, "gradients", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    norms = {r["step"]: r["train/grad_norm"] for r in records if "train/grad_norm" in r}
    assert sorted(norms) == [1, 2, 3, 4, 5, 6]
    assert not math.isfinite(norms[3]) and all(math.isfinite(n) for step, n in norms.items() if step != 3)
    assert all(math.isfinite(r["train/loss"]) for r in records if "train/loss" in r)  # the NaN never reached weights
    assert (output / "student" / "model.safetensors").is_file()
