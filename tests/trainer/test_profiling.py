"""profile.steps: the config's checks, and the profiler's window over a loop's steps (on CPU; the
real launcher's run is in test_launcher.py, the CUDA figures in the GPU campaign)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.config import ConfigError, load_config
from trainer.config import ProfileConfig, TrainConfig
from trainer.runtime.profiling import NoProfiler, StepProfiler, step_profiler

REQUIRED = ["teacher=t", "data=d", "output_dir=o", "max_steps=20"]


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["profile.steps=-1"], "profile.steps: must be >= 0"),
        (["profile.steps=1", "profile.start_step=0"], "profile.start_step: must be >= 1"),
        (["profile.steps=5", "profile.start_step=18"], r"profile.start_step: profiles steps 18-22, past max_steps"),
    ],
)
def test_bad_profile_settings_name_the_key(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(TrainConfig, None, [*REQUIRED, *overrides])


def test_off_by_default_and_then_a_do_nothing_profiler(tmp_path: Path) -> None:
    cfg = load_config(TrainConfig, None, REQUIRED)
    profiler = step_profiler(cfg.profile, tmp_path, 0, torch.device("cpu"))
    assert cfg.profile.steps == 0 and type(profiler) is NoProfiler


def test_the_window_covers_exactly_its_steps(tmp_path: Path) -> None:
    layer = torch.nn.Linear(64, 64)
    profiler = StepProfiler(ProfileConfig(steps=2, start_step=3), tmp_path, 1, torch.device("cpu"))
    matmuls_in_window = 0
    for step in range(1, 7):
        profiler.step_begins(step)
        for _ in range(step):  # step s runs s matmuls: the window's count says which steps it held
            layer(torch.randn(8, 64))
        matmuls_in_window += step if 3 <= step <= 4 else 0
        profiler.step_ended(step)
    summary = json.loads((tmp_path / "profile-rank1.json").read_text())
    assert summary["steps"] == 2 and summary["first_step"] == 3
    addmm = {name: calls for name, _, calls in summary["top_ops"]}["aten::addmm"]
    assert addmm == matmuls_in_window // 2  # calls per step, over steps 3 and 4 only
    assert (tmp_path / "profile-rank1.md").read_text().startswith("Profile of 2 steps")
    assert not (tmp_path / "profile-rank1-trace.json").exists()  # trace is off by default
