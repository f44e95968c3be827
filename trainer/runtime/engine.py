"""DeepSpeed: the process group, the engine config (JSON file + the YAML's numbers), the engine.

The DeepSpeed JSON in ``configs/deepspeed/`` chooses the ZeRO stage and offload; batch sizes,
precision, clipping and the optimizer come from the YAML only, so one number never lives in two
files (a JSON that sets them is an error). The optimizer is ``torch.optim.AdamW`` (fused on
CUDA, so DeepSpeed never compiles its own Adam); only with optimizer offload does DeepSpeed
build its CPU Adam from the same hyperparameters, as ZeRO-Offload requires.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import psutil
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT as DEEPSPEED_DEFAULT_PORT
from deepspeed.constants import default_pg_timeout

from common.atomic import write_text_atomically
from common.config import ConfigError
from trainer.config import TrainConfig
from trainer.runtime.cpus import usable_cpus
from trainer.runtime.optim import build_scheduler, param_groups
from trainer.runtime.rendezvous import joining_at_rank_zero

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

    def close(self) -> None:
        """Tear this rank's process group down, once its collectives are over.

        Left to the interpreter's exit, the group's C++ threads are destroyed in no set order, and a
        gloo rank now and then aborts there ("terminate called without an active exception": a
        failed exit status after a finished run). Not a collective: each rank closes on its own.
        """
        if dist.is_initialized():
            dist.destroy_process_group()


def init_distributed() -> Distributed:
    """Join the process group the launcher described in RANK, WORLD_SIZE, MASTER_ADDR, ...

    Started without a launcher (``bash launch/run.sh``), the process is a world of one. Ranks the
    DeepSpeed launcher started on one node without ``--master_port`` meet on a port the system
    picks (:func:`rendezvous_on_a_free_port`), so that two runs on one machine never share the
    launcher's fixed default port; an explicit ``--master_port`` (or a multi-node run) is used as
    given, and a port another process holds fails in one line naming it. Such a launch first checks
    its address (:func:`trainer.runtime.rendezvous.reach_rank_zero`): a MASTER_ADDR that does not
    resolve fails at once, a rank that cannot reach rank 0 logs while it waits and gives up after
    the rendezvous timeout, and the join itself logs every 30 s while ranks are missing.
    """
    alone = "RANK" not in os.environ
    if alone:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    accelerator = get_accelerator()
    local_rank = int(os.environ["LOCAL_RANK"])
    on_cpu = accelerator.device_name() == "cpu"
    if not on_cpu:
        accelerator.set_device(local_rank)
    else:
        skip_shm_comm_build()
        if "OMP_NUM_THREADS" not in os.environ:
            # Ranks sharing a CPU: each gets its share of the cores instead of all of them (oversubscription).
            local_ranks = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
            torch.set_num_threads(max(1, usable_cpus() // local_ranks))
    backend = "gloo" if on_cpu else accelerator.communication_backend_name()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if alone or on_one_node_without_port():
        rendezvous_on_a_free_port(backend, rank, world_size)
        joining: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    else:
        joining = joining_at_rank_zero(rank, world_size)
    try:
        with joining:
            deepspeed.init_distributed(dist_backend=backend)  # adopts the group joined above, if any
    except dist.DistNetworkError as err:
        if "EADDRINUSE" not in str(err):
            raise
        port = os.environ["MASTER_PORT"]
        raise ConfigError(
            f"port {port} (MASTER_PORT) is already in use on this machine, by another run or service: choose a "
            "free one with `deepspeed --master_port PORT ...`, or leave --master_port out on one node "
            "to let the run pick one"
        ) from None
    device = torch.device("cpu") if on_cpu else torch.device(accelerator.device_name(local_rank))
    return Distributed(rank, local_rank, world_size, device)


def on_one_node_without_port() -> bool:
    """Whether the DeepSpeed launcher started every rank on this node, with its default port.

    The launcher sets CROSS_SIZE (nodes) and LOCAL_SIZE (ranks here) and starts each rank as a
    child of one ``deepspeed.launcher.launch`` process, which :func:`rendezvous_on_a_free_port`
    relies on. Its default port cannot be told from an explicit ``--master_port 29500``; either
    way the run was not told to use that port for a reason a free one would defeat.
    """
    env = os.environ
    return (
        env.get("CROSS_SIZE") == "1"
        and env.get("LOCAL_SIZE") == env.get("WORLD_SIZE")
        and env.get("MASTER_PORT") == str(DEEPSPEED_DEFAULT_PORT)
    )


def rendezvous_on_a_free_port(backend: str, rank: int, world_size: int) -> None:
    """Start the process group on a TCP store whose port the system chose, and tell the other ranks.

    Rank 0 binds its store on port 0, so no other process can take the port between choosing and
    binding it (a port probed free and bound later can be). It writes the port to a file named
    after the launcher process (the parent of every rank on this node, alive for the whole run:
    its pid and start time name exactly one launch), the other ranks read it there, and rank 0
    removes the file once every rank has joined. MASTER_PORT is set to the port chosen.
    """
    timeout = default_pg_timeout  # DeepSpeed's (DEEPSPEED_TIMEOUT), as if it had started the group itself
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        if world_size > 1:
            write_text_atomically(port_handoff(), str(store.port))
    else:
        handoff = port_handoff()
        deadline = time.monotonic() + timeout.total_seconds()  # the launcher stops every rank if rank 0 fails
        while not handoff.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: rank 0 did not publish its port in {handoff} within {timeout}")
            time.sleep(0.05)
        store = dist.TCPStore("127.0.0.1", int(handoff.read_text()), world_size, is_master=False, timeout=timeout)
    os.environ["MASTER_PORT"] = str(store.port)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    store.set(f"joined/{rank}", "1")
    if rank == 0 and world_size > 1:
        store.wait([f"joined/{r}" for r in range(world_size)])
        port_handoff().unlink()


def port_handoff() -> Path:
    """The file through which rank 0 tells the ranks of its launch the port it bound."""
    launcher = psutil.Process(os.getppid())
    return Path(tempfile.gettempdir()) / f"encoder-distill-port-{launcher.pid}-{launcher.create_time():.0f}"


def skip_shm_comm_build() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce op for CPU ranks.

    DeepSpeed builds it (a C++ JIT compile, tens of seconds on every new install path) whenever
    it starts a CPU process group, for its inference all-reduce, which training never calls. The
    op also names its shared memory after MASTER_PORT, which two runs on one port would share.
    DeepSpeed keeps the result of its op probe in one module-level dict meant to be edited.
    """
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def resolve_path(path: str) -> Path:
    """Relative config paths are tried from the working directory, then from the repository root."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate
    return REPO / candidate


def deepspeed_config(cfg: TrainConfig, world_size: int, *, load_universal: bool = False) -> dict[str, Any]:
    """The JSON file's ZeRO settings completed with the YAML's batch sizes, precision and clipping.

    ``load_universal``: the run resumes from a checkpoint saved by another number of ranks, through
    its universal form (``runtime.checkpoint``).
    """
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
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if stage not in (1, 2, 3):  # stage 0 in fp32 or fp16 writes no optimizer partitions: no resume, no export
        raise ConfigError(
            f"deepspeed.config: {path} sets ZeRO stage {stage}; the trainer needs stage 1, 2 or 3, whose "
            "checkpoints it resumes on any number of ranks and exports (on one rank, stage 1 partitions nothing)"
        )
    precision = cfg.deepspeed.precision
    ds.update(
        train_batch_size=cfg.global_batch_size,
        train_micro_batch_size_per_gpu=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps(world_size),
        gradient_clipping=cfg.optimizer.grad_clip,
        # DeepSpeed's per-gradient bf16 overflow check only where a run asks to skip non-finite steps; otherwise
        # the trainer's FiniteGuard stops the run, for less host work (trainer.config says what the check costs).
        bf16={"enabled": precision == "bf16", "check_grad_overflow": cfg.deepspeed.bf16_skip_nonfinite},
        # Dynamic loss scaling (loss_scale 0) keeps fp16 gradients out of underflow and overflow.
        fp16={
            "enabled": precision == "fp16",
            "loss_scale": 0,
            "initial_scale_power": cfg.deepspeed.initial_scale_power,
        },
    )
    ds["checkpoint"] = {**ds.get("checkpoint", {}), "load_universal": load_universal}
    ds.setdefault("steps_per_print", 10**9)  # the trainer logs; keep DeepSpeed's own step log quiet
    # DeepSpeed's throughput timer (on by default, read by nothing here: the trainer meters its own steps)
    # synchronises the device at the start of every forward and the end of every step, so the host could
    # never queue a step ahead of the GPU (counted by the retired benchmarks/host_reads.py; docs/log/benchmarks.md).
    ds.setdefault("timers", {"throughput": {"enabled": False}})
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
    # ZeRO gathers partitions with torch.distributed.all_gather_into_tensor, which torch deprecates in
    # favour of all_gather_single: one FutureWarning per rank about DeepSpeed's code, which no run can act on.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated", category=FutureWarning
    )
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
