"""The LR schedule: 5% linear warmup to the peak, then linear decay, stepped like DeepSpeed does."""

from __future__ import annotations

import itertools

import pytest
import torch

from trainer.runtime.optim import build_scheduler, lr_factor, warmup_steps


def test_warmup_then_linear_decay() -> None:
    max_steps = 100
    warmup = warmup_steps(max_steps, 0.05)
    assert warmup == 5
    factors = [lr_factor(s, max_steps, warmup) for s in range(max_steps)]
    assert factors[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert factors[5] == pytest.approx(95 / 95)
    assert factors[50] == pytest.approx(50 / 95)
    assert factors[-1] == pytest.approx(1 / 95)
    assert all(a >= b for a, b in itertools.pairwise(factors[4:]))
    assert min(factors) > 0


def test_no_warmup_starts_at_peak() -> None:
    assert lr_factor(0, 10, 0) == 1.0
    assert lr_factor(9, 10, 0) == pytest.approx(0.1)


def test_scheduler_drives_optimizer_lr_and_survives_state_dict_round_trip() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=5e-4)
    scheduler = build_scheduler(optimizer, max_steps=20, warmup_fraction=0.1)
    lrs = []
    for _ in range(7):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 5e-4, 5e-4 * 17 / 18])

    # A resumed run rebuilds the scheduler and loads its state (as DeepSpeed's load_checkpoint does).
    resumed_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=5e-4)
    resumed = build_scheduler(resumed_opt, max_steps=20, warmup_fraction=0.1)
    resumed.load_state_dict(scheduler.state_dict())
    assert resumed.get_last_lr() == pytest.approx(scheduler.get_last_lr())
    assert resumed.get_last_lr()[0] == pytest.approx(5e-4 * lr_factor(7, 20, 2))
