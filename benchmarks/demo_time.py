"""How long `make demo` takes, and where the minutes go: the demo run several times, each stage timed.

    python benchmarks/demo_time.py [--runs 3] [--setup] [--out docs/demo/demo-time.json] [--docs README.md]
    python benchmarks/demo_time.py --from-result --docs README.md   # render the committed file

Each run is ``bash demo/run.sh`` as ``make demo`` runs it (after setup), into a fresh output; its closing
line names each stage's seconds. ``--setup`` also times ``make setup`` once in a fresh clone with an empty
pip cache directory (downloads included: it depends on the network). The machine's load average before each
run is recorded: a busy machine is the commonest reason for a slow demo.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.suite_time import add_result_options, made_by, measured_or_committed, provenance  # noqa: E402

CLOSING = re.compile(r"^=== done in \d+ min \d+ s \((?P<stages>.*)\) ===$", re.MULTILINE)
STAGE = re.compile(r"(?P<name>[\w-]+) (?P<seconds>\d+) s")


def run_demo(python_bin: Path) -> dict:
    """One demo run: total seconds, seconds per stage, load before, lines printed."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "DEMO_OUTPUT": out, "DS_ACCELERATOR": "cpu", "PATH": f"{python_bin}:{os.environ['PATH']}"}
        started = time.monotonic()
        proc = subprocess.run(["bash", "demo/run.sh"], cwd=REPO, env=env, capture_output=True, text=True)
        seconds = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"the demo failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    closing = CLOSING.search(proc.stdout)
    if closing is None:
        raise RuntimeError(f"no closing line in the demo's output:\n{proc.stdout[-2000:]}")
    stages = {m["name"]: int(m["seconds"]) for m in STAGE.finditer(closing["stages"])}
    score = re.search(r"the student keeps -?[\d.]+% of the teacher's skill above chance", proc.stdout)
    return {
        "seconds": round(seconds, 1),
        "stages": stages,
        "load_average_before": round(load, 2),
        "lines": len((proc.stdout + proc.stderr).splitlines()),
        "closing_score": score[0] if score else None,
    }


def time_setup() -> dict:
    """``make setup`` in a fresh clone of HEAD, with a pip cache of its own (so every wheel is downloaded)."""
    with tempfile.TemporaryDirectory() as scratch:
        clone = Path(scratch) / "clone"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        env = {**os.environ, "PIP_CACHE_DIR": str(Path(scratch) / "pip-cache")}
        started = time.monotonic()
        subprocess.run(["make", "setup"], cwd=clone, env=env, check=True, capture_output=True)
        seconds = time.monotonic() - started
        venv_bytes = sum(p.stat().st_size for p in (clone / ".venv").rglob("*") if p.is_file() and not p.is_symlink())
        shutil.rmtree(clone)
    return {"seconds": round(seconds, 1), "venv_gb": round(venv_bytes / 1e9, 2)}


def minutes(seconds: float) -> str:
    return f"{int(seconds) // 60} min {int(seconds) % 60:02d} s"


def table(result: dict) -> str:
    runs = result["runs"]
    totals = [r["seconds"] for r in runs]
    stages = list(runs[0]["stages"])
    rows = [
        "| run | load before | " + " | ".join(stages) + " | whole demo |",
        "|---:|---:|" + "---:|" * len(stages) + "---:|",
    ]
    for i, run in enumerate(runs, 1):
        cells = " | ".join(f"{run['stages'].get(s, '-')} s" for s in stages)
        rows.append(f"| {i} | {run['load_average_before']:.2f} | {cells} | {minutes(run['seconds'])} |")
    setup = result.get("setup")
    setup_line = (
        f" `make setup` on a fresh clone took {minutes(setup['seconds'])} once (downloads included; "
        f"a {setup['venv_gb']:.1f} GB `.venv`)."
        if setup
        else ""
    )
    rows += [
        "",
        f"The demo took {minutes(min(totals))} to {minutes(max(totals))} over {len(runs)} runs on "
        f"{result['machine']['cpus']} CPUs ({result['machine']['cpu']}), after setup.{setup_line} "
        f"{made_by(result, result['date'])}.",
    ]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="demo runs (default 3)")
    parser.add_argument("--setup", action="store_true", help="also time `make setup` in a fresh clone")
    add_result_options(parser, REPO / "docs" / "demo" / "demo-time.json")
    args = parser.parse_args()

    def measure() -> dict:
        header = provenance(" ".join(["python benchmarks/demo_time.py", *sys.argv[1:]]))
        setup = time_setup() if args.setup else None
        python_bin = Path(sys.executable).parent
        runs = [run_demo(python_bin) for _ in range(args.runs)]
        return {
            **header,
            "date": time.strftime("%Y-%m-%d"),
            "result_file": str(args.out.resolve().relative_to(REPO)),
            "setup": setup,
            "runs": runs,
        }

    print(table(measured_or_committed(args, measure, table, "demo-time")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
