"""Failing a run at its first non-finite step, without making any step wait for the device.

bf16 training has no loss scaler to notice an overflow and skip the step (DeepSpeed's per-gradient
check, which would, is off unless ``deepspeed.bf16_skip_nonfinite``: this guard does it for less): a
NaN or inf loss or gradient norm goes into the weights, every later step is NaN, and the run would
happily save checkpoints of a model that is already lost. :class:`FiniteGuard` folds, on the device, each
step's loss (before its optimizer step) and gradient norm (after it) into one flag that records
the first bad step. The flag is read on the host only where the loop synchronises anyway: at a
log step, before an evaluation and before a checkpoint is saved, so no checkpoint ever holds
non-finite weights and the error names the last good one to resume from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

NONE = torch.iinfo(torch.int64).max  # "no bad step yet" (so that the minimum over ranks is the first bad one)


class NonFiniteStepError(RuntimeError):
    """A step's loss or gradient norm was NaN or infinite; the run cannot go on."""


class FiniteGuard:
    def __init__(self, device: torch.device) -> None:
        self.first_bad = torch.tensor(NONE, dtype=torch.int64, device=device)

    def observe(self, step: int, value: Any) -> None:
        """Note ``step`` as bad if ``value`` (a loss or a grad norm: tensor, float or None) is not finite."""
        if value is None:
            return
        finite = torch.isfinite(torch.as_tensor(value, device=self.first_bad.device)).all()
        self.first_bad = torch.where(finite, self.first_bad, self.first_bad.clamp_max(step))

    def check(self, last_checkpoint: Path | None) -> None:
        """Raise :class:`NonFiniteStepError` if any rank saw a bad step. All ranks call it together."""
        first_bad = self.first_bad.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)
        step = int(first_bad)  # the one host read
        if step == NONE:
            return
        resume = (
            f"relaunch with the same output_dir to resume from the last good checkpoint, {last_checkpoint}"
            if last_checkpoint is not None
            else "no checkpoint was saved before it: the run must start over"
        )
        raise NonFiniteStepError(
            f"step {step}: the loss or the gradient norm is not finite (NaN or inf); training stops before the "
            f"weights are saved. {resume}. Lowering optimizer.lr or raising optimizer.warmup_fraction usually helps."
        )
