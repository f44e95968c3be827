"""The shipped configs and the DeepSpeed config built from them (no process group needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import ConfigError, load_config
from trainer.config import TrainConfig
from trainer.runtime.engine import deepspeed_config

REPO = Path(__file__).resolve().parents[2]


def load(preset: str, *overrides: str) -> TrainConfig:
    return load_config(TrainConfig, REPO / "configs" / preset, list(overrides))


def test_distilbert_preset_is_distilberts_recipe() -> None:
    cfg = load("distilbert-base.yaml")
    assert cfg.teacher == "bert-base-uncased"
    assert cfg.student.init == "from_teacher" and cfg.student.teacher_layers == [0, 2, 4, 7, 9, 11]
    assert cfg.global_batch_size == 4096
    opt = cfg.optimizer
    assert (opt.lr, opt.betas, opt.eps, opt.warmup_fraction, opt.grad_clip) == (5e-4, [0.9, 0.98], 1e-6, 0.05, 5.0)
    obj = cfg.objective
    assert (obj.ce, obj.mlm, obj.cos, obj.mse, obj.temperature) == (5.0, 2.0, 1.0, 0.0, 2.0)
    # where it is not the reference code's default (every real token): docs/objectives.md says so and why
    assert obj.ce_positions == "masked" and cfg.masking.frequency_smoothing == 0.7
    assert cfg.deepspeed.precision == "bf16"

    ds = deepspeed_config(cfg, world_size=64)
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["train_batch_size"] == 4096
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 64 == 4096
    # the trainer's FiniteGuard, not DeepSpeed's per-gradient check, catches a non-finite bf16 step
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": False} and ds["fp16"]["enabled"] is False
    assert ds["gradient_clipping"] == 5.0
    assert "optimizer" not in ds  # torch AdamW is passed in: DeepSpeed compiles no Adam


def test_tiny_cpu_preset_is_the_same_recipe_in_fp32() -> None:
    tiny, full = load("tiny-cpu.yaml", "teacher=t", "data=d"), load("distilbert-base.yaml")
    assert tiny.objective == full.objective and tiny.masking == full.masking
    assert tiny.deepspeed.precision == "fp32"
    ds = deepspeed_config(tiny, world_size=2)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        8,
        2,
        2,
    )
    assert ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False


@pytest.mark.parametrize(("name", "stage"), [("zero1", 1), ("zero2", 2), ("zero3", 3), ("zero2-offload", 2)])
def test_every_shipped_deepspeed_json_builds(name: str, stage: int) -> None:
    cfg = load("distilbert-base.yaml", f"deepspeed.config=configs/deepspeed/{name}.json", "deepspeed.precision=fp16")
    ds = deepspeed_config(cfg, world_size=8)
    assert ds["zero_optimization"]["stage"] == stage
    assert ds["fp16"]["enabled"] is True and ds["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    assert ds["fp16"]["initial_scale_power"] == 16
    if name.endswith("offload"):  # ZeRO-Offload needs DeepSpeed's CPU Adam, with the YAML's hyperparameters
        assert ds["optimizer"] == {
            "type": "AdamW",
            "params": {"lr": 5e-4, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.01},
        }


def test_batch_sizes_must_multiply_exactly() -> None:
    cfg = load("distilbert-base.yaml")  # micro 64
    with pytest.raises(ConfigError, match="global_batch_size: 4096 is not micro_batch_size"):
        deepspeed_config(cfg, world_size=3)


def test_a_deepspeed_json_may_not_set_what_the_yaml_owns(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_batch_size": 64}))
    cfg = load("distilbert-base.yaml", f"deepspeed.config={path}")
    with pytest.raises(ConfigError, match=r"deepspeed\.config: .*train_batch_size"):
        deepspeed_config(cfg, world_size=1)
    with pytest.raises(ConfigError, match=r"deepspeed\.config: file not found"):
        deepspeed_config(load("distilbert-base.yaml", "deepspeed.config=nope.json"), world_size=1)
    # Stage 0 (also a JSON without ZeRO) in fp32 or fp16 saves no optimizer partitions: no resume, no export.
    path.write_text(json.dumps({"gradient_clipping_comment": "no zero_optimization"}))
    with pytest.raises(
        ConfigError, match=r"deepspeed\.config: .* sets ZeRO stage 0; the trainer needs stage 1, 2 or 3"
    ):
        deepspeed_config(load("distilbert-base.yaml", f"deepspeed.config={path}"), world_size=1)


def test_the_initial_loss_scale_comes_from_the_yaml_and_is_checked() -> None:
    cfg = load("distilbert-base.yaml", "deepspeed.precision=fp16", "deepspeed.initial_scale_power=32")
    assert deepspeed_config(cfg, world_size=8)["fp16"]["initial_scale_power"] == 32
    with pytest.raises(ConfigError, match=r"deepspeed\.initial_scale_power"):
        load("distilbert-base.yaml", "deepspeed.initial_scale_power=-1")


def test_skipping_non_finite_bf16_steps_is_deepspeeds_check_and_bf16_only() -> None:
    cfg = load("distilbert-base.yaml", "deepspeed.bf16_skip_nonfinite=true")
    assert deepspeed_config(cfg, world_size=8)["bf16"] == {"enabled": True, "check_grad_overflow": True}
    for precision in ("fp16", "fp32"):
        with pytest.raises(
            ConfigError, match=rf"deepspeed\.bf16_skip_nonfinite: applies to .* bf16 only, not {precision}"
        ):
            load("distilbert-base.yaml", "deepspeed.bf16_skip_nonfinite=true", f"deepspeed.precision={precision}")
