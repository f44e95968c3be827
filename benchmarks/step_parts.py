"""What the two steps ``benchmarks/distill_step.py`` compares the project's with share: the naive reference
(``naive_step.py``) and the real peer (``peer_step.py``), and the clipping every timed step does.

Both are set up as their users set them up: float32 weights run under autocast in the training dtype (the
teacher in the same 16-bit dtype as the project's, issue 52), torch's default AdamW with the config's
settings, DistilBERT's output terms only. One definition each here, so that the two differ only where their
recipes do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from common.config import ConfigError
from trainer.config import TrainConfig
from trainer.objective.layer_distillation import method_class


def clip_gradients(params: Iterable[torch.nn.Parameter], cfg: TrainConfig) -> None:
    """What every step ``distill_step.py`` times does before its optimizer step, as the engine does (DeepSpeed's
    ``gradient_clipping`` is ``optimizer.grad_clip``): the gradients' global norm clipped to ``optimizer.grad_clip``,
    nothing where it is 0. No host sync: the clip coefficient stays on the device."""
    if cfg.optimizer.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], cfg.optimizer.grad_clip)


def refuse_layer_terms(cfg: TrainConfig, step: str) -> None:
    """A :class:`ConfigError` where ``cfg``'s objective has an active layer term: ``step`` ("the naive step",
    "the peer step") implements DistilBERT's output terms only."""
    for name in cfg.objective.LAYER_METHODS:
        if method_class(name).active_weights(getattr(cfg.objective, name)):
            raise ConfigError(f"objective.{name}: {step} implements DistilBERT's output terms only")


def torch_adamw(student: Any, cfg: TrainConfig) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over the student with the config's settings, in torch's default (not fused)
    implementation, as a hand-written script or TextBrewer's documentation builds it."""
    opt = cfg.optimizer
    return torch.optim.AdamW(
        student.parameters(), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay
    )


def training_autocast(cfg: TrainConfig, device: torch.device) -> torch.autocast:
    """Autocast in the training dtype (``deepspeed.precision``: bf16 or fp16); off in fp32."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.deepspeed.precision)
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)
