"""The cluster half of ``plan``: what each rank sends per optimizer step, how long a step takes on N GPUs,
and what a whole run costs.

Three layers, each resting on the one before:

1. :func:`communication` (exact, checked): the collectives DeepSpeed 0.19's ZeRO issues in one optimizer
   step, by stage, precision, gradient accumulation and world size, and the bytes of each, as its
   communication logger counts them (the tensor handed to each call, summed over the step).
   ``tests/trainer/test_plan_cluster.py`` runs the real engine on 2 and 4 gloo ranks with that logger on and
   asserts these bytes, stage by stage. The link bytes beside them are what a ring algorithm moves through
   each rank's link (NCCL's "bus bytes"), what the time model divides by a bandwidth.
2. :func:`step_time` (a model): the compute of a measured single-GPU step, shrunk by the number of
   GPUs, plus the communication at the link bandwidth of the layout, of which an assumed fraction (a
   range) hides behind the compute.
3. :func:`run_cost`: steps x step time, plus the checkpoint saves at a storage bandwidth; GPU-hours.

Every figure that comes out carries where its inputs came from: ``measured`` (a committed result file, or
the caller's own measurement given on the command line) or ``assumed`` (a documented default).

Why the volumes look as they do (DeepSpeed 0.19, what the test holds):

* ZeRO-1 and -2 reduce gradients with all-reduce, not reduce-scatter (``use_multi_rank_bucket_allreduce``,
  on by default, whatever ``reduce_scatter`` says): the whole gradient, ``b·Ψ`` bytes. ZeRO-1 reduces
  once per optimizer step; ZeRO-2 at every micro-step, so gradient accumulation multiplies its volume.
  After the optimizer step each rank all-gathers the updated 16-bit (or fp32) weights: its partition of
  each parameter group, padded to a multiple of 2N elements (DeepSpeed's alignment).
* ZeRO-3 reduce-scatters gradients at every micro-step (each parameter padded to a multiple of N) and
  all-gathers weights: the persistent ones (at most ``stage3_param_persistence_threshold`` elements, kept
  whole on every rank) once per step after the optimizer updates them; the others at every micro-step
  for the forward, kept for the backward while the student fits under ``stage3_max_live_parameters`` (1e9
  here). A student too large for that is gathered again in the backward: up to twice the figure shown.
* A few scalar all-reduces (the gradient norm, the overflow check) and broadcasts, under 1 KiB a step,
  are left out.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from common.config import ConfigError
from trainer.runtime.optim import param_groups

REPO = Path(__file__).resolve().parents[2]
GPU_CAMPAIGN = REPO / "docs" / "gpu-campaign" / "throughput.json"
COMM_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}  # DeepSpeed's ``communication_data_type`` names
ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: ZeRO-1/2 pad each group to a multiple of 2N


@dataclass(frozen=True)
class Collective:
    """One kind of collective in one optimizer step, seen from one rank."""

    op: str  # DeepSpeed's name, as its communication logger records it
    carries: str  # what it moves
    message_bytes: int  # the tensors handed to the calls in one step (what DeepSpeed's logger counts)
    link_bytes: int  # what a ring moves through one rank's link, each way (NCCL's bus bytes)
    overlaps: bool  # may hide behind compute (overlap_comm's gradient reduction, ZeRO-3's prefetch)


def padded(numel: int, multiple: int) -> int:
    return math.ceil(numel / multiple) * multiple


def ring_link_bytes(op: str, message: int, world: int) -> int:
    """Bytes through each rank's link for ``message`` bytes handed to ``op`` on ``world`` ranks (a ring)."""
    if op == "all_reduce":
        return 2 * (world - 1) * message // world
    if op == "all_gather_into_tensor":  # each rank's message is its own piece; it receives everyone else's
        return (world - 1) * message
    if op == "reduce_scatter_tensor":  # the message is the whole input; each rank keeps 1/N of it
        return (world - 1) * message // world
    raise ValueError(op)


def communication(
    engine_module: torch.nn.Module, ds: dict[str, Any], world: int, accumulation: int
) -> list[Collective]:
    """The collectives of one optimizer step of ``engine_module`` (the Distiller: student and projections, in
    the training dtype; meta tensors do) under the DeepSpeed config ``ds``, on ``world`` data-parallel ranks.
    Empty on one rank: nothing crosses a link."""
    if world == 1:
        return []
    zero = DeepSpeedZeroConfig(**ds.get("zero_optimization", {}))
    params = list(engine_module.parameters())
    trainable = [p for p in params if p.requires_grad]
    comm_dtype = ds.get("communication_data_type")
    b = COMM_BYTES[comm_dtype] if comm_dtype else trainable[0].element_size()

    def collective(op: str, carries: str, message: int, overlaps: bool) -> Collective:
        return Collective(op, carries, message, ring_link_bytes(op, message, world), overlaps)

    if zero.stage in (1, 2):
        gradients = sum(p.numel() for p in trainable)
        reductions = 1 if zero.stage == 1 else accumulation
        groups = [sum(p.numel() for p in g["params"]) for g in param_groups(engine_module, 0.0)]
        partition = sum(padded(n, ALIGNMENT * world) // world for n in groups if n)
        return [
            collective(
                "all_reduce", f"gradients, {reductions}x per step", reductions * b * gradients, zero.overlap_comm
            ),
            collective("all_gather_into_tensor", "updated weights after the optimizer step", b * partition, False),
        ]
    # ZeRO-3: persistent parameters as DeepSpeed marks them (in order, until the model-wide cap)
    persistent = gathered = 0
    for p in params:
        piece = math.ceil(p.numel() / world)
        if (
            p.numel() <= zero.param_persistence_threshold
            and persistent * world + p.numel() <= zero.model_persistence_threshold
        ):
            persistent += piece
        else:
            gathered += piece
    scattered = sum(padded(p.numel(), world) for p in trainable)
    weights = persistent + accumulation * gathered
    return [
        collective(
            "reduce_scatter_tensor",
            f"gradients, {accumulation}x per step",
            accumulation * b * scattered,
            zero.overlap_comm,
        ),
        collective(
            "all_gather_into_tensor", f"weights: persistent 1x, others {accumulation}x per step", b * weights, True
        ),
    ]


# ------------------------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Cluster:
    """The hardware a run is planned for. Bandwidths are all-reduce bus bandwidths (GB/s, what nccl-tests'
    ``all_reduce_perf`` reports as busbw for large messages): within a node over NVLink, and across nodes
    (a node's network, all its NICs together). The defaults are assumptions (docs/training.md, "Sizing a
    cluster run", says where they come from and the one command that measures each on a real cluster)."""

    nodes: int = 1
    gpus_per_node: int = 1
    intra_node_gbs: float = 360.0  # NVLink 4 (H100/H200 HGX), ~80 % of its 450 GB/s
    inter_node_gbs: float = 80.0  # 8 x 100 Gb/s per node at ~80 %; InfiniBand NDR (8 x 400 Gb/s) ~320
    overlap: tuple[float, float] = (0.0, 0.8)  # share of the overlappable communication hidden by compute
    storage_gbs: float = 2.0  # aggregate write bandwidth of the checkpoint filesystem
    gpu_hour_price: float | None = None

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def link_gbs(self) -> float:
        """The ring's slowest link: NVLink within one node, the network once the ring crosses nodes."""
        return self.intra_node_gbs if self.nodes == 1 else min(self.intra_node_gbs, self.inter_node_gbs)


@dataclass(frozen=True)
class Measured:
    """A single-GPU throughput to scale from, and where it came from."""

    tokens_per_s: float
    source: str


def campaign_throughput(
    preset: str, seq_len: int, micro: int, global_batch: int, path: Path = GPU_CAMPAIGN
) -> Measured | None:
    """The committed GPU campaign's tokens/s for this preset and shape (no overrides), the case run at the
    config's global batch first. None when the campaign has no such case."""
    if not path.is_file():
        return None
    campaign = json.loads(path.read_text(encoding="utf-8"))
    cases = [
        c
        for c in campaign["cases"]
        if c["preset"] == preset
        and c["seq"] == seq_len
        and c["micro"] == micro
        and not c["overrides"]
        and c.get("tokens_per_s")
    ]
    cases.sort(key=lambda c: c.get("global_batch") != global_batch)
    if not cases:
        return None
    case = cases[0]
    return Measured(case["tokens_per_s"], f"{path.relative_to(REPO)} case {case['name']} ({campaign['device']})")


@dataclass(frozen=True)
class StepTime:
    """One optimizer step on the cluster: its compute, its communication, and how much of the communication the
    overlap range hides (low, high)."""

    compute_s: float
    comm_s: float
    hidden_s: tuple[float, float]

    @property
    def seconds(self) -> tuple[float, float]:
        """(fastest, slowest): the most hidden, the least."""
        return self.compute_s + self.comm_s - self.hidden_s[1], self.compute_s + self.comm_s - self.hidden_s[0]


def step_time(tokens_per_step: int, measured: Measured, collectives: list[Collective], cluster: Cluster) -> StepTime:
    """Compute: the step's tokens spread over the GPUs at the measured single-GPU rate (each GPU keeps the
    micro-batch it was measured at, and runs fewer micro-steps). Communication: link bytes at the layout's
    bandwidth. Of the overlappable part, ``cluster.overlap`` (low, high) hides behind the compute, never more
    than the compute itself."""
    compute = tokens_per_step / cluster.world / measured.tokens_per_s
    comm = sum(c.link_bytes for c in collectives) / (cluster.link_gbs * 1e9)
    overlappable = sum(c.link_bytes for c in collectives if c.overlaps) / (cluster.link_gbs * 1e9)
    hidden = tuple(min(share * overlappable, compute) for share in cluster.overlap)
    return StepTime(compute, comm, hidden)  # type: ignore[arg-type]


def checkpoint_bytes(engine_module: torch.nn.Module, ds: dict[str, Any]) -> int:
    """What one save writes, all ranks together: the float32 master copy and AdamW's two moments of each
    trainable parameter, and, except under ZeRO-3 (whose weights live only in those partitions unless
    ``stage3_gather_16bit_weights_on_model_save``), the weights in the training dtype.
    ``tests/trainer/test_plan_cluster.py`` checks this against a real save."""
    zero = DeepSpeedZeroConfig(**ds.get("zero_optimization", {}))
    trainable = sum(p.numel() for p in engine_module.parameters() if p.requires_grad)
    weights = sum(p.numel() * p.element_size() for p in engine_module.parameters())
    saves_weights = zero.stage < 3 or zero.gather_16bit_weights_on_model_save
    return 12 * trainable + (weights if saves_weights else 0)


def scaling(
    engine_module: torch.nn.Module,
    ds: dict[str, Any],
    batch: tuple[int, int, int],
    measured: Measured,
    cluster: Cluster,
) -> dict[str, Any]:
    """Step time and tokens/s on 1, 2, 4, ... nodes of ``cluster.gpus_per_node`` at the config's global batch
    (``batch``: global batch, micro-batch, sequence length), as far as the batch divides; efficiency is
    against the measured single GPU times the GPUs. ``knee``, at each end of the overlap range: the last
    node count after which doubling the nodes adds less than half of the added GPUs' linear share (None
    when the batch runs out first)."""
    global_batch, micro, seq_len = batch
    rows = []
    nodes = 1
    while global_batch % (micro * (world := nodes * cluster.gpus_per_node)) == 0:
        layout = Cluster(**{**cluster.__dict__, "nodes": nodes})
        accumulation = global_batch // (micro * world)
        step = step_time(
            global_batch * seq_len, measured, communication(engine_module, ds, world, accumulation), layout
        )
        speeds = [global_batch * seq_len / seconds for seconds in step.seconds]
        rows.append(
            {
                "nodes": nodes,
                "gpus": world,
                "accumulation": accumulation,
                "step_s": step.seconds,
                "comm_s": step.comm_s,
                "tokens_per_s": speeds,
                "efficiency": [speed / (world * measured.tokens_per_s) for speed in speeds],
            }
        )
        nodes *= 2
    knee: list[int | None] = []
    for end in (0, 1):
        found = None
        for before, after in itertools.pairwise(rows):
            added = (after["gpus"] - before["gpus"]) * measured.tokens_per_s
            if after["tokens_per_s"][end] - before["tokens_per_s"][end] < added / 2:
                found = before["nodes"]
                break
        knee.append(found)
    return {"rows": rows, "knee_nodes": knee}


def run_cost(step: StepTime, steps: int, save_bytes: int, every_steps: int, cluster: Cluster) -> dict[str, Any]:
    """Wall-clock (fastest, slowest) of ``steps`` steps and their checkpoint saves (a save blocks the step that
    makes it), GPU-hours, and the cost at ``cluster.gpu_hour_price``."""
    saves = steps // every_steps
    save_s = save_bytes / (cluster.storage_gbs * 1e9)
    wall = [steps * seconds + saves * save_s for seconds in step.seconds]
    gpu_hours = [w * cluster.world / 3600 for w in wall]
    return {
        "steps": steps,
        "wall_s": wall,
        "gpu_hours": gpu_hours,
        "cost": None if cluster.gpu_hour_price is None else [h * cluster.gpu_hour_price for h in gpu_hours],
        "checkpoint": {
            "bytes": save_bytes,
            "save_s": save_s,
            "saves": saves,
            "share": [saves * save_s / w for w in wall],
        },
    }


@dataclass(frozen=True)
class Sizing:
    """What ``plan`` is asked to size: the cluster, which of its settings the caller gave (the rest are the
    assumed defaults), a single-GPU throughput the caller measured, and a token budget (``"data"``: one pass
    over the dataset's train split)."""

    cluster: Cluster
    given: frozenset[str] = frozenset()
    gpu_tokens_per_s: float | None = None
    tokens: str | None = None


ASSUMPTIONS = ("intra_node_gbs", "inter_node_gbs", "overlap", "storage_gbs")


def cluster_plan(
    sizing: Sizing,
    engine_module: torch.nn.Module,
    ds: dict[str, Any],
    batch: tuple[int, int, int],
    preset: str,
    max_steps: int,
    every_steps: int,
    train_tokens: int | None,
) -> dict[str, Any]:
    """``plan``'s cluster section, as plain data: the communication of one step on the cluster, and, when a
    single-GPU throughput is known, the step time, the scaling over nodes and the run's time and cost."""
    check_cluster(sizing.cluster)
    cluster = sizing.cluster
    global_batch, micro, seq_len = batch
    accumulation = global_batch // (micro * cluster.world)
    collectives = communication(engine_module, ds, cluster.world, accumulation)
    inputs = {
        key: {"value": getattr(cluster, key), "source": "given" if key in sizing.given else "assumed"}
        for key in ASSUMPTIONS
    }
    if cluster.gpu_hour_price is not None:
        inputs["gpu_hour_price"] = {"value": cluster.gpu_hour_price, "source": "given"}
    section: dict[str, Any] = {
        "layout": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node, "world_size": cluster.world},
        "communication": [c.__dict__ for c in collectives],
        "inputs": inputs,
    }
    if sizing.gpu_tokens_per_s is not None:
        measured = Measured(sizing.gpu_tokens_per_s, "given: --gpu-tokens-per-s")
    else:
        measured = campaign_throughput(preset, seq_len, micro, global_batch)
    if measured is None:
        section["missing"] = (
            f"no measured single-GPU throughput for {preset} at {seq_len} tokens, micro-batch {micro}: "
            "pass --gpu-tokens-per-s (docs/training.md, 'Sizing a cluster run', says how to measure it)"
        )
        return section
    inputs["gpu_tokens_per_s"] = {"value": measured.tokens_per_s, "source": f"measured: {measured.source}"}
    if sizing.tokens is None:
        steps, budget = max_steps, "max_steps"
    elif sizing.tokens == "data":
        if train_tokens is None:
            raise ConfigError("--tokens data: the dataset has no manifest.json yet; give a number of tokens")
        steps, budget = math.ceil(train_tokens / (global_batch * seq_len)), "one pass over the train split"
    else:
        steps, budget = math.ceil(int(float(sizing.tokens)) / (global_batch * seq_len)), f"--tokens {sizing.tokens}"
    step = step_time(global_batch * seq_len, measured, collectives, cluster)
    section["step"] = {
        "compute_s": step.compute_s,
        "comm_s": step.comm_s,
        "seconds": step.seconds,
        "tokens_per_s": [global_batch * seq_len / s for s in step.seconds],
        "efficiency": [global_batch * seq_len / s / (cluster.world * measured.tokens_per_s) for s in step.seconds],
    }
    section["scaling"] = scaling(engine_module, ds, batch, measured, cluster)
    section["run"] = {
        "budget": budget,
        **run_cost(step, steps, checkpoint_bytes(engine_module, ds), every_steps, cluster),
    }
    return section


def check_cluster(cluster: Cluster) -> None:
    for key, value in (("--nodes", cluster.nodes), ("--gpus-per-node", cluster.gpus_per_node)):
        if value < 1:
            raise ConfigError(f"{key}: must be >= 1")
    for key, value in (("--intra-node-gbs", cluster.intra_node_gbs), ("--inter-node-gbs", cluster.inter_node_gbs)):
        if value <= 0:
            raise ConfigError(f"{key}: must be > 0")
    low, high = cluster.overlap
    if not 0 <= low <= high <= 1:
        raise ConfigError("--overlap: LOW,HIGH with 0 <= LOW <= HIGH <= 1")
    if cluster.storage_gbs <= 0:
        raise ConfigError("--storage-gbs: must be > 0")
