"""What the optimizer is given: parameter groups with weight decay, and the learning-rate schedule.

Shared by distillation (``trainer.runtime.engine``) and fine-tuning (``trainer.finetuning.finetune``).
The schedule is DistilBERT's: linear warmup, then linear decay to zero at ``max_steps``.
"""

from __future__ import annotations

from typing import Any

import torch

# Parameters exempt from weight decay, as in BERT and DistilBERT: biases and LayerNorm weights.
NO_DECAY = ("bias", "LayerNorm.weight", "layer_norm.weight")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: trainable parameters with ``weight_decay``, and the ``NO_DECAY`` ones without."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if name.endswith(NO_DECAY) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def follow_settings(groups: list[dict[str, Any]], opt: Any) -> dict[str, tuple[Any, Any]]:
    """Give the optimizer this launch's betas, eps and weight decay after a checkpoint restored the saving
    launch's (a relaunch's overrides would otherwise be accepted and ignored); the groups are
    :func:`param_groups`' two, the decayed one first. Returns what changed: ``{key: (before, now)}``."""
    changed: dict[str, tuple[Any, Any]] = {}
    for i, group in enumerate(groups):
        wanted = {"betas": tuple(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay if i == 0 else 0.0}
        for key, value in wanted.items():
            before = tuple(group[key]) if key == "betas" else group[key]
            if before != value:
                changed.setdefault(key, (before, value))
                group[key] = value
    return changed


def warmup_steps(max_steps: int, warmup_fraction: float) -> int:
    return round(max_steps * warmup_fraction)


def lr_factor(step: int, max_steps: int, warmup: int) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based).

    Warmup reaches the peak on its last step, decay ends one step short of zero, so no
    update is ever wasted on a zero learning rate. Past the last step (where DeepSpeed steps the
    scheduler once more after the final update) the factor is 0: with a warmup that rounds to the
    whole run (``max_steps=10, warmup_fraction=0.95``) there is no decay left to divide by.
    """
    if step >= max_steps:
        return 0.0
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (max_steps - step) / (max_steps - warmup))


def build_scheduler(
    optimizer: torch.optim.Optimizer, max_steps: int, warmup_fraction: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR that DeepSpeed steps after each optimizer step and keeps in its checkpoints."""
    warmup = warmup_steps(max_steps, warmup_fraction)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, max_steps, warmup))


def follow_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, peak_lr: float) -> tuple[float, float]:
    """Set the optimizer's lr to what this launch's schedule gives at the step the scheduler resumed at.

    A checkpoint restores the optimizer's lr and the scheduler's base lr as the saving launch's
    schedule left them, while the schedule itself (``max_steps``, warmup) comes from this launch's
    config. A relaunch that extends ``max_steps`` would otherwise take its first step at the old
    schedule's last lr (zero, at the end of a finished run) and its peak from the old config.
    Returns the first group's lr before and after, so the caller can say that it changed.
    """
    groups = scheduler.optimizer.param_groups
    before = groups[0]["lr"]
    scheduler.base_lrs = [peak_lr] * len(groups)
    for group, factor in zip(groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = peak_lr
        group["lr"] = peak_lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() reports
    return before, groups[0]["lr"]
