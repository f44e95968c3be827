"""docs/training.md's worked example of sizing a cluster run: ``plan`` for the ``distilbert-base`` preset on
1 GPU, one node of 8, and 8 nodes of 8 (at the assumed network, and at a slow one), kept as a result file and
rendered as the doc's table.

    python benchmarks/plan_cluster_example.py [--out docs/training/plan-distilbert-base.json] [--docs docs/training.md]

Each layout is one ``python -m trainer plan ... --json`` run (no GPU, no weights: the models are built on the
meta device); the result file keeps each run's command and cluster section. With ``--docs`` the table
between the ``plan-example`` markers of that file is replaced by one rendered from the result file
(``--from-result`` renders an existing file without running ``plan`` again).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.suite_time import add_result_options, made_by, measured_or_committed, provenance  # noqa: E402  (REPO on the path first)

PRESET = ["configs/distilbert-base.yaml", "teacher=configs/teachers/bert-base-uncased", "data=no-dataset"]
LAYOUTS = {  # name -> plan's cluster options
    "1 GPU": ["--world-size", "1"],
    "1 node x 8": ["--nodes", "1", "--gpus-per-node", "8"],
    "8 nodes x 8": ["--nodes", "8", "--gpus-per-node", "8"],
    "8 nodes x 8, 25 GB/s network": ["--nodes", "8", "--gpus-per-node", "8", "--inter-node-gbs", "25"],
}


def run_plan(options: list[str]) -> dict:
    command = [sys.executable, "-m", "trainer", "plan", *PRESET, *options, "--json"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True)
    return {"command": " ".join(["python -m trainer plan", *PRESET, *options]), **json.loads(done.stdout)["cluster"]}


def span(pair: list[float], fmt: str, scale: float = 1.0) -> str:
    low, high = sorted(x * scale for x in pair)
    shown = format(low, fmt), format(high, fmt)
    return shown[0] if shown[0] == shown[1] else f"{shown[0]}-{shown[1]}"


def table(result: dict) -> str:
    rows = [
        "| layout | step (ms) | of which communication (ms) | tokens/s | vs linear | wall-clock, "
        f"{result['layouts']['1 GPU']['run']['steps']:,} steps (h) | GPU-hours |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, plan in result["layouts"].items():
        step, run = plan["step"], plan["run"]
        rows.append(
            f"| {name} | {span(step['seconds'], ',.1f', 1e3)} | {step['comm_s'] * 1e3:,.1f} | "
            f"{span(step['tokens_per_s'], ',.0f')} | {span(step['efficiency'], '.0%')} | "
            f"{span(run['wall_s'], ',.2f', 1 / 3600)} | {span(run['gpu_hours'], ',.1f')} |"
        )
    gpu = result["layouts"]["1 GPU"]["inputs"]["gpu_tokens_per_s"]
    assumed = result["layouts"]["8 nodes x 8"]["inputs"]
    rows += [
        "",
        f"Single GPU: {gpu['value']:,.0f} tokens/s, {gpu['source']}. Assumed: NVLink "
        f"{assumed['intra_node_gbs']['value']:g} GB/s within a node, {assumed['inter_node_gbs']['value']:g} GB/s "
        f"across nodes (the last row: 25), {assumed['overlap']['value'][0]:.0%}-{assumed['overlap']['value'][1]:.0%} "
        f"of the overlappable communication hidden (the ranges), checkpoints written at "
        f"{assumed['storage_gbs']['value']:g} GB/s. {made_by(result)}.",
    ]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_result_options(parser, REPO / "docs" / "training" / "plan-distilbert-base.json")
    args = parser.parse_args()

    def measure() -> dict:
        return {
            **provenance(" ".join(["python benchmarks/plan_cluster_example.py", *sys.argv[1:]])),
            "result_file": str(args.out.resolve().relative_to(REPO)),
            "layouts": {name: run_plan(options) for name, options in LAYOUTS.items()},
        }

    print(table(measured_or_committed(args, measure, table, "plan-example")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
