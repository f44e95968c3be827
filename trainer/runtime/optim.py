"""The learning-rate schedule: linear warmup, then linear decay to zero at ``max_steps`` (DistilBERT)."""

from __future__ import annotations

import torch


def warmup_steps(max_steps: int, warmup_fraction: float) -> int:
    return round(max_steps * warmup_fraction)


def lr_factor(step: int, max_steps: int, warmup: int) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based).

    Warmup reaches the peak on its last step, decay ends one step short of zero, so no
    update is ever wasted on a zero learning rate.
    """
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (max_steps - step) / (max_steps - warmup))


def build_scheduler(
    optimizer: torch.optim.Optimizer, max_steps: int, warmup_fraction: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR that DeepSpeed steps after each optimizer step and keeps in its checkpoints."""
    warmup = warmup_steps(max_steps, warmup_fraction)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, max_steps, warmup))
