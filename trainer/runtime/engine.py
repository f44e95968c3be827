"""DeepSpeed: the process group, the engine config (JSON file + the YAML's numbers), the engine.

The DeepSpeed JSON in ``configs/deepspeed/`` chooses the ZeRO stage and offload; batch sizes,
precision, clipping and the optimizer come from the YAML only, so one number never lives in two
files (a JSON that sets them is an error). The optimizer is ``torch.optim.AdamW`` (fused on
CUDA, so DeepSpeed never compiles its own Adam); only with optimizer offload does DeepSpeed
build its CPU Adam from the same hyperparameters, as ZeRO-Offload requires.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from common.config import ConfigError
from trainer.config import TrainConfig
from trainer.runtime.optim import build_scheduler, param_groups

REPO = Path(__file__).resolve().parents[2]
YAML_OWNED_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer",
    "scheduler",
    "bf16",
    "fp16",
)


@dataclass(frozen=True)
class Distributed:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Distributed:
    """Join the process group the launcher described in RANK, WORLD_SIZE, MASTER_ADDR, ...

    Started without a launcher (``bash launch/run.sh``), the process is a world of one.
    """
    if "RANK" not in os.environ:
        single = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        for key, value in {**single, "MASTER_PORT": str(free_port())}.items():
            os.environ.setdefault(key, value)
    accelerator = get_accelerator()
    local_rank = int(os.environ["LOCAL_RANK"])
    on_cpu = accelerator.device_name() == "cpu"
    if not on_cpu:
        accelerator.set_device(local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:
        # Ranks sharing a CPU: each gets its share of the cores instead of all of them (oversubscription).
        local_ranks = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else accelerator.communication_backend_name())
    device = torch.device("cpu") if on_cpu else torch.device(accelerator.device_name(local_rank))
    return Distributed(int(os.environ["RANK"]), local_rank, int(os.environ["WORLD_SIZE"]), device)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_path(path: str) -> Path:
    """Relative config paths are tried from the working directory, then from the repository root."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate
    return REPO / candidate


def deepspeed_config(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    """The JSON file's ZeRO settings completed with the YAML's batch sizes, precision and clipping."""
    path = resolve_path(cfg.deepspeed.config)
    if not path.is_file():
        raise ConfigError(f"deepspeed.config: file not found: {cfg.deepspeed.config}")
    try:
        ds = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"deepspeed.config: {path} is not valid JSON: {err}") from None
    owned = [key for key in YAML_OWNED_KEYS if key in ds]
    if owned:
        raise ConfigError(f"deepspeed.config: {path} sets {owned}; these come from the training YAML")
    precision = cfg.deepspeed.precision
    ds.update(
        train_batch_size=cfg.global_batch_size,
        train_micro_batch_size_per_gpu=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps(world_size),
        gradient_clipping=cfg.optimizer.grad_clip,
        bf16={"enabled": precision == "bf16"},
        # Dynamic loss scaling (loss_scale 0) keeps fp16 gradients out of underflow and overflow.
        fp16={"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
    )
    ds.setdefault("steps_per_print", 10**9)  # the trainer logs; keep DeepSpeed's own step log quiet
    if offloads_optimizer(ds):
        opt = cfg.optimizer
        params = {"lr": opt.lr, "betas": opt.betas, "eps": opt.eps, "weight_decay": opt.weight_decay}
        ds["optimizer"] = {"type": "AdamW", "params": params}
    return ds


def offloads_optimizer(ds: dict[str, Any]) -> bool:
    offload = ds.get("zero_optimization", {}).get("offload_optimizer") or {}
    return offload.get("device", "none") in ("cpu", "nvme")


def build_engine(model: torch.nn.Module, cfg: TrainConfig, ds: dict[str, Any], device: torch.device) -> Any:
    """``deepspeed.initialize`` with the AdamW + warmup/linear-decay schedule of the config.

    ``ds`` is the run's one :func:`deepspeed_config` (also what tracking records).
    """
    opt = cfg.optimizer
    groups = param_groups(model, opt.weight_decay)

    def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return build_scheduler(optimizer, cfg.max_steps, opt.warmup_fraction)

    if offloads_optimizer(ds):
        optimizer = None  # DeepSpeed builds its CPU Adam from ds["optimizer"]
    else:
        optimizer = torch.optim.AdamW(
            groups, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, fused=device.type == "cuda"
        )
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=groups, optimizer=optimizer, lr_scheduler=schedule, config=ds
    )
    return engine
