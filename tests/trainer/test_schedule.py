"""The LR schedule: 5% linear warmup to the peak, then linear decay, stepped as DeepSpeed does; its ranges."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch

from common.config import ConfigError, load_config
from trainer.config import TrainConfig
from trainer.runtime.optim import (
    build_scheduler,
    follow_schedule,
    follow_settings,
    lr_factor,
    param_groups,
    warmup_steps,
)

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.yaml"


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


@pytest.mark.parametrize(("max_steps", "fraction"), [(3, 0.9), (10, 0.95), (2, 0.75), (1, 0.0)])
def test_a_warmup_as_long_as_the_run_ends_at_zero_without_dividing_by_zero(max_steps: int, fraction: float) -> None:
    """DeepSpeed steps the scheduler after the last update too: the factor past the end is 0, whatever the warmup."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1.0)
    scheduler = build_scheduler(optimizer, max_steps=max_steps, warmup_fraction=fraction)
    lrs = []
    for _ in range(max_steps):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert all(lr > 0 for lr in lrs) and max(lrs) == pytest.approx(1.0)
    assert scheduler.get_last_lr()[0] == 0.0


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


def test_a_relaunch_with_more_steps_follows_its_own_schedule_from_the_resumed_step() -> None:
    """A finished 4-step run relaunched with max_steps=6 (and a new peak lr): the checkpoint's optimizer
    says lr 0 (its schedule's end); the first resumed step must use the new schedule's lr at step 4."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=5e-4)
    scheduler = build_scheduler(optimizer, max_steps=4, warmup_fraction=0.0)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.0

    resumed_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    resumed = build_scheduler(resumed_opt, max_steps=6, warmup_fraction=0.0)
    resumed_opt.load_state_dict(optimizer.state_dict())  # as DeepSpeed's load_checkpoint does, both
    resumed.load_state_dict(scheduler.state_dict())
    assert resumed_opt.param_groups[0]["lr"] == 0.0  # what the step would have used

    assert follow_schedule(resumed, peak_lr=1e-3) == pytest.approx((0.0, 1e-3 * lr_factor(4, 6, 0)))
    assert resumed_opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 2 / 6)
    assert resumed.get_last_lr() == pytest.approx([1e-3 * 2 / 6])
    resumed_opt.step()
    resumed.step()  # and the schedule goes on from there
    assert resumed_opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 1 / 6)


def test_follow_schedule_changes_nothing_for_an_unchanged_relaunch() -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=5e-4)
    scheduler = build_scheduler(optimizer, max_steps=20, warmup_fraction=0.1)
    for _ in range(7):
        optimizer.step()
        scheduler.step()
    before = optimizer.param_groups[0]["lr"]
    assert follow_schedule(scheduler, peak_lr=5e-4) == pytest.approx((before, before))


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("optimizer.lr=.inf", "optimizer.lr"),
        ("optimizer.eps=-1e-8", "optimizer.eps"),
        ("optimizer.weight_decay=-0.01", "optimizer.weight_decay"),
        ("seed=-1", "seed"),
    ],
)
def test_out_of_range_optimizer_settings_and_seed_are_config_errors(override: str, key: str) -> None:
    """Each once passed validation: a negative decay trained silently, the others failed after the teacher loaded."""
    with pytest.raises(ConfigError, match=f"^{re.escape(key)}: "):
        load_config(TrainConfig, TINY, ["data=d", "output_dir=o", override])


def test_a_resumed_optimizer_takes_this_launchs_betas_eps_and_decay() -> None:
    """A checkpoint restores the saving launch's settings; a relaunch's overrides once stayed without effect."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    saved = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
    resumed = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-3)
    resumed.load_state_dict(saved.state_dict())
    now = load_config(TrainConfig, TINY, ["data=d", "output_dir=o"]).optimizer
    assert follow_settings(resumed.param_groups, now) == {}  # the same settings: nothing touched
    now = load_config(TrainConfig, TINY, ["data=d", "output_dir=o", "optimizer.weight_decay=0.1", "optimizer.eps=1e-8"])
    changed = follow_settings(resumed.param_groups, now.optimizer)
    assert changed == {"eps": (1e-6, 1e-8), "weight_decay": (0.01, 0.1)}
    assert [g["weight_decay"] for g in resumed.param_groups] == [0.1, 0.0]  # biases and LayerNorm stay undecayed
    assert all(g["eps"] == 1e-8 and tuple(g["betas"]) == (0.9, 0.98) for g in resumed.param_groups)
