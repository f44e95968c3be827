"""The processes of a plain data-parallel loop (``finetune``, ``task-distill``): which rank this is, on
which device, and the two collectives such a loop needs.

Pre-training distillation runs in a DeepSpeed engine (``runtime/engine.py``); the task-level commands
train models small enough for one device, so they need data parallelism only: every rank holds the
whole model, takes its share of each global batch (``share``), and ends each step with the mean
gradient (``average_gradients``). One process when the launcher set no ``WORLD_SIZE``; under
``deepspeed launch/run.sh``, ``torchrun`` or Slurm's ``srun``, the rank its environment names (gloo on
CPU, NCCL on GPUs).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import field

import torch
from torch import nn


@dataclasses.dataclass
class Ranks:
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def leader(self) -> bool:
        """Rank 0: the one that evaluates, writes files and records to MLflow."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        """Wait for every rank, then tear the process group down (a no-op for one process)."""
        if self.world_size > 1:
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()

    def share(self, batch: torch.Tensor) -> tuple[torch.Tensor, float]:
        """This rank's rows of a global batch of example indices, and the weight of its mean loss.

        Rank r takes rows r, r + W, r + 2W, ... With that weight (its rows' share of the batch, times W,
        because ``average_gradients`` divides by W), the mean of the ranks' gradients is exactly the
        gradient of the whole batch's mean loss, also when the batch does not divide evenly. A rank
        left without rows (a last batch smaller than W) computes on the first row with weight 0, so
        that every rank has gradients for the same parameters when they are averaged.
        """
        rows = batch[self.rank :: self.world_size]
        if len(rows) == 0:
            return batch[:1], 0.0
        return rows, len(rows) * self.world_size / len(batch)


def local_device(local_rank: int = 0) -> torch.device:
    """The device this process computes on: CUDA device ``local_rank`` where CUDA is present and
    ``DS_ACCELERATOR`` (the launcher's own switch) does not say ``cpu``; the CPU otherwise. Every
    command that runs a model outside the DeepSpeed engine asks here, so that none of them stays on
    the CPU of a GPU machine."""
    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
    return torch.device("cuda", local_rank) if cuda else torch.device("cpu")


def init_ranks() -> Ranks:
    """One process, or the rank the launcher's environment names (gloo on CPU, NCCL on GPUs)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = local_device(int(os.environ.get("LOCAL_RANK", "0")))
    cuda = device.type == "cuda"
    if world_size == 1:
        return Ranks(device=device)
    import torch.distributed as dist

    from trainer.runtime.engine import on_one_node_without_port, rendezvous_on_a_free_port
    from trainer.runtime.rendezvous import joining_at_rank_zero

    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    if on_one_node_without_port():  # as training does: two launches on one machine never share a port
        rendezvous_on_a_free_port(backend, int(os.environ["RANK"]), world_size)
    else:  # as training does: a wrong MASTER_ADDR or an unreachable rank 0 says so instead of hanging
        with joining_at_rank_zero(int(os.environ["RANK"]), world_size):
            dist.init_process_group(backend)
    return Ranks(dist.get_rank(), world_size, device)


def average_gradients(parameters: list[nn.Parameter], ranks: Ranks) -> None:
    """Every rank ends the step with the mean of the ranks' gradients (what DDP does, without its hooks:
    task-distill's loss is not the module's own forward)."""
    if ranks.world_size == 1:
        return
    for p in parameters:
        if p.grad is not None:
            torch.distributed.all_reduce(p.grad)
            p.grad /= ranks.world_size


def mean_over_ranks(value: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """The mean of a scalar across ranks (every rank must call it at the same point)."""
    if ranks.world_size == 1:
        return value
    total = value.detach().clone()
    torch.distributed.all_reduce(total)
    return total / ranks.world_size
