"""``plan``'s cluster section: communication per step checked against DeepSpeed's own logger, and the time model.

The communication volumes are the one part of the cluster model that can be checked on this machine: the
real engine, on 2 and 4 gloo ranks started by the ``deepspeed`` launcher, with DeepSpeed's communication
logger on (``tests/trainer/engine_probe.py``), must hand its collectives exactly the bytes ``plan`` predicts,
for every ZeRO stage. The time model's arithmetic is checked on the shipped preset.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import EngineProbes, Probe

from common.config import ConfigError, load_config
from trainer.commands import plan as plan_command
from trainer.config import TrainConfig
from trainer.modeling import base_config, load_teacher_config, student_config
from trainer.planning import plan
from trainer.planning.cluster import Cluster, Sizing, checkpoint_bytes, communication
from trainer.runtime.engine import deepspeed_config

REPO = Path(__file__).resolve().parents[2]
BERT_BASE = REPO / "configs" / "teachers" / "bert-base-uncased"
CONTROL = 1024  # all-reduces under 1 KiB (the gradient norm and overflow scalars) and broadcasts: plan leaves them out


def planned(overrides: list[str], world: int) -> tuple[dict[str, int], int]:
    """``plan``'s message bytes per collective in one step, and its checkpoint bytes, for the probe's run."""
    cfg = load_config(TrainConfig, REPO / "configs" / "tiny-cpu.yaml", overrides)
    teacher_config = load_teacher_config(cfg.teacher)
    s_config = student_config(cfg.student, base_config(cfg.student, teacher_config))
    distiller, _ = plan.meta_distiller(cfg, teacher_config, s_config)
    ds = deepspeed_config(cfg, world)
    collectives = communication(distiller, ds, world, cfg.gradient_accumulation_steps(world))
    return {c.op: c.message_bytes for c in collectives}, checkpoint_bytes(distiller, ds)


@pytest.mark.full
@pytest.mark.parametrize(
    "probe",
    [
        Probe("zero1", 2, "bf16", 8),  # accumulation 2: ZeRO-1 still reduces once per step
        Probe("zero2", 2, "fp32", 8),  # accumulation 2: ZeRO-2 reduces at every micro-step
        Probe("zero3", 2, "fp32", 8),
        # A second world size, on the stage whose partitions it shapes most (every tensor gathered and scattered).
        # ZeRO-1's and -2's 4-rank launches (~25 s each) left the suite: at 2 ranks their volumes already depend on
        # the world size (each rank gathers the other's half), against DeepSpeed's own count.
        Probe("zero3", 4, "bf16", 16),
    ],
    ids=str,
)
def test_communication_per_step_equals_what_deepspeed_logs(
    tiny_teacher_dir: Path, engine_probes: EngineProbes, probe: Probe
) -> None:
    """Bytes per optimizer step handed to each kind of collective, as DeepSpeed's communication logger counts
    them on a real engine (the launcher, gloo), equal ``plan``'s to the byte; what plan leaves out is under
    1 KiB a step. The checkpoint a save writes is within 2 % of ``plan``'s (the rest is torch.save's framing)."""
    overrides = probe.overrides(tiny_teacher_dir)
    engine = engine_probes.measure(probe)
    expected, checkpoint = planned(overrides, probe.ranks)

    measured: dict[str, int] = {}
    control = 0
    for op, calls in engine["comm_calls"].items():
        for size, n in calls.items():
            if op != "broadcast" and (op != "all_reduce" or int(size) >= CONTROL):
                measured[op] = measured.get(op, 0) + int(size) * n
            else:
                control += int(size) * n
    steps = 2  # the probe logs optimizer steps 2 and 3
    assert {op: total / steps for op, total in measured.items()} == expected
    assert control / steps < CONTROL
    assert engine["checkpoint_bytes"] == pytest.approx(checkpoint, rel=0.02)


def test_zero_stages_on_one_layout_differ_as_deepspeed_lays_them_out(tiny_teacher_dir: Path) -> None:
    """The rules the volumes rest on, on 8 ranks with accumulation 4: ZeRO-2 reduces at every micro-step (4x
    ZeRO-1's gradient volume), ZeRO-1 and -2 gather the same updated weights, ZeRO-3 reduce-scatters 4x and
    gathers the small persistent weights once and the rest at every micro-step; one rank sends nothing."""
    base = [f"teacher={tiny_teacher_dir}", "data=unused", "output_dir=unused", "micro_batch_size=2"]
    base += ["global_batch_size=64", "deepspeed.precision=bf16"]
    by_stage = {}
    for zero in ("zero1", "zero2", "zero3"):
        by_stage[zero], _ = planned([*base, f"deepspeed.config=configs/deepspeed/{zero}.json"], 8)
    assert by_stage["zero2"]["all_reduce"] == 4 * by_stage["zero1"]["all_reduce"]
    assert by_stage["zero2"]["all_gather_into_tensor"] == by_stage["zero1"]["all_gather_into_tensor"]
    gradients = by_stage["zero1"]["all_reduce"]
    assert 4 * gradients <= by_stage["zero3"]["reduce_scatter_tensor"] < 4 * gradients + 4 * 8 * 2 * 50  # padding
    cfg_ds = load_config(TrainConfig, REPO / "configs" / "tiny-cpu.yaml", base)
    teacher_config = load_teacher_config(cfg_ds.teacher)
    distiller, _ = plan.meta_distiller(
        cfg_ds, teacher_config, student_config(cfg_ds.student, base_config(cfg_ds.student, teacher_config))
    )
    assert communication(distiller, deepspeed_config(cfg_ds, 1), 1, 32) == []


def run_plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert plan_command.main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_distilbert_preset_on_64_gpus_scales_from_the_measured_h200_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shipped preset on 8 nodes x 8: the single-GPU rate comes from the committed GPU campaign (marked
    measured), the bandwidths are the assumed defaults (marked so); the step is the compute of 1/64 of the
    batch plus the communication at the network's bandwidth, less what the overlap range hides; the run's
    wall-clock and GPU-hours follow from max_steps, the checkpoint cost from the storage bandwidth."""
    preset = str(REPO / "configs" / "distilbert-base.yaml")
    args = [preset, f"teacher={BERT_BASE}", f"data={tmp_path}/none", f"output_dir={tmp_path}/out", "--json"]
    result = run_plan_json(capsys, *args, "--nodes", "8", "--gpus-per-node", "8", "--gpu-hour-price", "2.5")
    cluster = result["cluster"]
    assert cluster["layout"] == {"nodes": 8, "gpus_per_node": 8, "world_size": 64}
    gpu = cluster["inputs"]["gpu_tokens_per_s"]
    assert gpu["source"].startswith("measured: docs/gpu-campaign/throughput.json case distilbert-512-gb4096-mb64")
    assert cluster["inputs"]["inter_node_gbs"]["source"] == "assumed"
    tokens = 4096 * 512
    step = cluster["step"]
    assert step["compute_s"] == pytest.approx(tokens / 64 / gpu["value"])
    link = sum(c["link_bytes"] for c in cluster["communication"])
    assert step["comm_s"] == pytest.approx(link / (cluster["inputs"]["inter_node_gbs"]["value"] * 1e9))
    fastest, slowest = step["seconds"]
    assert fastest <= slowest == pytest.approx(step["compute_s"] + step["comm_s"])  # nothing hidden at the low end
    rows = cluster["scaling"]["rows"]
    assert [r["gpus"] for r in rows] == [8, 16, 32, 64]  # micro 64: the 4096 batch allows no more
    assert rows[-1]["step_s"] == step["seconds"]
    run = cluster["run"]
    assert run["steps"] == result["config"]["max_steps"]
    saves = run["steps"] // result["config"]["checkpoint"]["every_steps"]
    assert run["wall_s"][1] == pytest.approx(run["steps"] * slowest + saves * run["checkpoint"]["save_s"])
    assert run["gpu_hours"][1] == pytest.approx(run["wall_s"][1] * 64 / 3600)
    assert run["cost"][1] == pytest.approx(2.5 * run["gpu_hours"][1])

    slow_network = run_plan_json(capsys, *args, "--nodes", "8", "--gpus-per-node", "8", "--inter-node-gbs", "2")
    assert slow_network["cluster"]["inputs"]["inter_node_gbs"] == {"value": 2.0, "source": "given"}
    assert slow_network["cluster"]["step"]["seconds"][1] > slowest
    assert slow_network["cluster"]["scaling"]["knee_nodes"][1] is not None  # a 2 GB/s network stops paying

    budget = run_plan_json(capsys, *args, "--world-size", "8", "--tokens", "2e9")
    assert budget["cluster"]["run"]["steps"] == -(-2_000_000_000 // tokens)


def test_a_shape_the_campaign_never_measured_asks_for_a_throughput(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    preset = str(REPO / "configs" / "distilbert-base.yaml")
    args = [preset, f"teacher={BERT_BASE}", f"data={tmp_path}/none", "micro_batch_size=8", "--json"]
    result = run_plan_json(capsys, *args, "--world-size", "8")
    assert "--gpu-tokens-per-s" in result["cluster"]["missing"]
    given = run_plan_json(capsys, *args, "--world-size", "8", "--gpu-tokens-per-s", "100000")
    assert given["cluster"]["inputs"]["gpu_tokens_per_s"]["source"] == "measured: given: --gpu-tokens-per-s"


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["--nodes", "2", "--gpus-per-node", "4", "--world-size", "4"], "--world-size"),
        (["--overlap", "0.9,0.1"], "--overlap"),
        (["--overlap", "half"], "--overlap"),
        (["--inter-node-gbs", "0"], "--inter-node-gbs"),
        (["--tokens", "lots"], "--tokens"),
    ],
)
def test_bad_cluster_options_name_the_option(tmp_path: Path, argv: list[str], key: str) -> None:
    preset = str(REPO / "configs" / "distilbert-base.yaml")
    with pytest.raises(ConfigError, match=key):
        plan_command.main([preset, f"teacher={BERT_BASE}", f"data={tmp_path}/none", *argv])


def test_default_cluster_is_one_node_of_world_size() -> None:
    assert Sizing(Cluster(gpus_per_node=4)).cluster.world == 4
    assert Cluster(nodes=2, gpus_per_node=8, intra_node_gbs=300, inter_node_gbs=50).link_gbs == 50
    assert Cluster(nodes=1, gpus_per_node=8, intra_node_gbs=300, inter_node_gbs=50).link_gbs == 300


def test_the_worked_example_in_the_docs_is_the_committed_result_rendered() -> None:
    """docs/training.md's table is generated from docs/training/plan-distilbert-base.json, never typed."""
    import sys

    sys.path.insert(0, str(REPO))
    from benchmarks.plan_cluster_example import table

    result = json.loads((REPO / "docs" / "training" / "plan-distilbert-base.json").read_text(encoding="utf-8"))
    assert table(result) in (REPO / "docs" / "training.md").read_text(encoding="utf-8")
    assert not result["dirty"]
