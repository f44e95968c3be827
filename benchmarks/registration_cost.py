"""What registering checkpoints during training costs the training loop: step time with and without.

    .venv/bin/python benchmarks/registration_cost.py [--pairs 3] [--ranks 2] [--out FILE.json]
    .venv/bin/python benchmarks/registration_cost.py --table FILE.json   # its markdown table

Launches the tiny CPU distillation as the tests do (``configs/tiny-cpu.yaml``, two CPU ranks through the
real ``deepspeed`` launcher, a checkpoint every 5 steps, 60 steps), tracked by a real ``mlflow server``
on 127.0.0.1, in two arms: ``off`` (no registration until the end) and ``every save``
(``mlflow.register_checkpoints=true``: 11 students exported and registered in the background). The arms
alternate ABBA, so that neither always runs first. The figure is each run's mean step time from its
``metrics.jsonl`` (``train/elapsed_s`` from step 5 to the last step, checkpoint saves included): the
registration's whole cost to the loop, snapshots included, and the CPU its worker process takes from the
ranks (the worker runs in Linux's SCHED_IDLE class). It also counts the versions registered before the
last step, to show whether the registration ran while the loop trained or after it. The server runs in Linux's
SCHED_IDLE class: in a real deployment it is on another machine, and its work is not the trainer's cost.

``--ranks 2`` on a 2-core machine leaves the worker no idle core (the case of a CPU node whose every core
trains); ``--ranks 1`` leaves it one, as a GPU node's spare cores do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from benchmarks.launch_overhead import build_inputs  # noqa: E402  (REPO on the path first)
from benchmarks.suite_time import provenance, write_result  # noqa: E402

STEPS, EVERY = 60, 5
CONFIG = "configs/tiny-cpu.yaml"
ARMS = {"off": [], "every save": ["mlflow.register_checkpoints=true"]}


def launch(arm: str, index: int, teacher: Path, data: Path, out: Path, uri: str, ranks: int) -> dict[str, float]:
    """One run of ``arm``; returns its mean step time and how many of its versions beat its last step."""
    from mlflow import MlflowClient

    name = f"cost-{index}"
    overrides = [f"teacher={teacher}", f"data={data}", f"output_dir={out}", f"max_steps={STEPS}"]
    overrides += [f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=2", "eval.every_steps=15"]
    overrides += ["logging.every_steps=1", f"mlflow.tracking_uri={uri}", f"mlflow.register_as={name}", *ARMS[arm]]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    deepspeed = Path(sys.executable).parent / "deepspeed"
    with out.with_suffix(".log").open("w") as log:
        done = subprocess.run(
            [str(deepspeed), "--num_gpus", str(ranks), "launch/run.sh", CONFIG, *overrides],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if done.returncode != 0:
        raise RuntimeError(f"{arm} run failed:\n{out.with_suffix('.log').read_text()[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    elapsed = {r["step"]: r["train/elapsed_s"] for r in records if "train/elapsed_s" in r}
    last_step_at = (out / "metrics.jsonl").stat().st_mtime  # close enough: the final records follow the step
    versions = MlflowClient(uri).search_model_versions(f"name = '{name}'")
    early = [v for v in versions if v.tags.get("kind") == "checkpoint" and v.creation_timestamp / 1000 < last_step_at]
    return {
        "step_s": round((elapsed[STEPS] - elapsed[EVERY]) / (STEPS - EVERY), 4),
        "versions": len(versions),
        "registered_before_the_end": len(early),
    }


def table(result: dict) -> str:
    """Each arm's mean step time: median and range over its runs; the ratio of the medians."""
    runs = result["runs"]
    lines = ["| arm | runs | mean step time, median (min-max) | versions registered | of them before the last step |"]
    lines.append("|---|---|---|---|---|")
    for arm, rs in runs.items():
        steps = [r["step_s"] for r in rs]
        lines.append(
            f"| {arm} | {len(rs)} | {statistics.median(steps) * 1000:.0f} ms ({min(steps) * 1000:.0f}-"
            f"{max(steps) * 1000:.0f}) | {rs[0]['versions']} | {min(r['registered_before_the_end'] for r in rs)}-"
            f"{max(r['registered_before_the_end'] for r in rs)} |"
        )
    ratios = result["pair_ratios"]
    lines.append("")
    lines.append(
        f"Ratio every save / off, per ABBA pair: median {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} pairs)."
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="runs per arm, alternated ABBA (default 3)")
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks per run (default 2)")
    parser.add_argument("--out", type=Path, help="write the result JSON here")
    parser.add_argument("--table", type=Path, help="print the markdown table of this result file, and exit")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    from helpers import MlflowServer

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="registration-cost-") as tmp:
        root = Path(tmp)
        teacher, data = build_inputs(root)
        server = MlflowServer(root / "mlflow", idle=True)  # stands in for a server on another machine
        (root / "mlflow").mkdir()
        server.start()
        try:
            runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
            for pair in range(args.pairs):
                order = list(ARMS) if pair % 2 == 0 else list(reversed(ARMS))  # ABBA
                for arm in order:
                    index = sum(map(len, runs.values()))
                    runs[arm].append(launch(arm, index, teacher, data, root / f"run-{index}", server.uri, args.ranks))
                    print(f"{arm} #{pair + 1}: {json.dumps(runs[arm][-1])}", flush=True)
        finally:
            server.stop()
    ratios = [round(b["step_s"] / a["step_s"], 4) for a, b in zip(runs["off"], runs["every save"], strict=True)]
    result = {
        **provenance(" ".join(["benchmarks/registration_cost.py", *sys.argv[1:]])),
        "sizes": {"ranks": args.ranks, "steps": STEPS, "checkpoint_every_steps": EVERY, "config": CONFIG},
        "wall_s": round(time.time() - started, 1),
        "runs": runs,
        "pair_ratios": ratios,
    }
    print(table(result))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
