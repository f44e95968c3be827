"""Where a launch's fixed time goes, from `deepspeed launch/run.sh` to its first step and from its last step to exit.

    .venv/bin/python benchmarks/launch_overhead.py [--repeats 3] [--base REV] [--out FILE.json]
    .venv/bin/python benchmarks/launch_overhead.py --table FILE.json   # its markdown table

Launches the tiny CPU distillation as the tests do (``configs/tiny-cpu.yaml``, two CPU ranks, 3 steps, a
checkpoint and an export) on a tiny teacher and the sample corpus's dataset, built first, and times each
phase from outside the ranks (psutil for the processes, the console's timestamps, ``metrics.jsonl``):

  launcher       `deepspeed` starts -> the first rank's process exists (DeepSpeed's runner and launch.py)
  rank start     the rank's process exists -> its first log line (imports, process group, config checks)
  first step     -> the first step's record (teacher, student, engine, loader, the step itself)
  to export      -> the export's log line (2 more steps, evaluation, checkpoint, export)
  rank exit      -> the last rank's process has ended
  launcher exit  -> `deepspeed` has returned

``start to first step`` (a rank's process start to its first step) is what a user of `deepspeed
launch/run.sh` waits for after DeepSpeed's own launcher. With ``--base REV`` the same launches also run
from a git worktree of REV, alternated with this tree's (ABBA: each goes first in every other pair), so
that the two are measured side by side on the same machine in the same minutes; compare their medians
and ranges, not absolute times.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from benchmarks.suite_time import provenance, write_result  # noqa: E402  (REPO on the path first)

PHASES = ("launcher", "rank start", "first step", "to export", "rank exit", "launcher exit")
STEPS = 3
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO trainer\.commands\.train: (.*)$", re.MULTILINE)


def log_time(text: str, starts: str) -> float | None:
    """The epoch time of the first train log line of ``text`` that starts with ``starts``."""
    for stamp, message in STAMP.findall(text):
        if message.startswith(starts):
            return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def first_step_written(metrics: Path) -> bool:
    if not metrics.exists():
        return False
    return any(line.endswith("\n") and '"step": 1,' in line for line in metrics.read_text().splitlines(True))


def alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def launch(tree: Path, teacher: Path, data: Path, out: Path) -> dict[str, float]:
    """One launch from ``tree``; returns each phase's seconds."""
    deepspeed = Path(sys.executable).parent / "deepspeed"
    overrides = [f"teacher={teacher}", f"data={data}", f"output_dir={out}", f"max_steps={STEPS}"]
    overrides += [f"checkpoint.every_steps={STEPS}", f"eval.every_steps={STEPS}", "logging.every_steps=1"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    console = out.with_suffix(".log")
    with console.open("w") as log:
        started = time.time()
        proc = subprocess.Popen(
            [str(deepspeed), "--num_gpus", "2", "launch/run.sh", "configs/tiny-cpu.yaml", *overrides],
            cwd=tree,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        launcher = psutil.Process(proc.pid)
        ranks: dict[int, psutil.Process] = {}
        rank_started = first_step = ranks_ended = None
        while proc.poll() is None:  # poll every 10 ms: the phases are seconds long
            now = time.time()
            for child in launcher.children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):  # a short-lived helper process already gone
                    if child.pid not in ranks and "launch/run.sh" in " ".join(child.cmdline()[:3]):
                        ranks[child.pid] = child
                        rank_started = min(rank_started or now, child.create_time())
            if first_step is None and first_step_written(out / "metrics.jsonl"):
                first_step = now
            if ranks and ranks_ended is None and not any(alive(rank) for rank in ranks.values()):
                ranks_ended = now
            time.sleep(0.01)
        ended = time.time()
    text = console.read_text()
    if proc.returncode != 0 or None in (rank_started, first_step, ranks_ended):
        raise RuntimeError(f"launch from {tree} failed (exit {proc.returncode}):\n{text[-3000:]}")
    first_log, exported = log_time(text, "distilling "), log_time(text, "exported the student")
    marks = [started, rank_started, first_log, first_step, exported, ranks_ended, ended]
    seconds = {phase: round(b - a, 3) for phase, a, b in zip(PHASES, marks, marks[1:], strict=False)}
    seconds["start to first step"] = round(first_step - rank_started, 3)
    seconds["total"] = round(ended - started, 3)
    return seconds


def build_inputs(root: Path) -> tuple[Path, Path]:
    from helpers import SAMPLE_CORPUS, TINY_DATASET_SETTINGS, bert_tokenizer_dir, build_dataset, build_tiny_teacher

    tokenizer = bert_tokenizer_dir()
    teacher = build_tiny_teacher(root / "teacher", tokenizer)
    data = build_dataset(root / "data", tokenizer, SAMPLE_CORPUS, **TINY_DATASET_SETTINGS)
    return teacher, data


def table(result: dict) -> str:
    """Each phase's median (and range) for each tree, side by side: this tree first, then the base."""
    names = list(result["medians"])
    lines = ["| phase | " + " | ".join(f"{name}: median (min-max)" for name in names) + " |"]
    lines.append("|---|" + "---|" * len(names))
    for phase in [*PHASES, "start to first step", "total"]:
        cells = []
        for name in names:
            values = [run[phase] for run in result["runs"][name]]
            cells.append(f"{result['medians'][name][phase]:.2f} s ({min(values):.2f}-{max(values):.2f})")
        lines.append(f"| {phase} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="launches per tree (default 3)")
    parser.add_argument("--base", help="also launch from a worktree of this git revision, alternated")
    parser.add_argument("--out", type=Path, help="write the result JSON here")
    parser.add_argument("--table", type=Path, help="print the markdown table of this result file, and exit")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0

    with tempfile.TemporaryDirectory(prefix="launch-overhead-") as tmp:
        root = Path(tmp)
        teacher, data = build_inputs(root)
        trees = {"this tree": REPO}
        if args.base:
            trees[args.base] = root / "base"
            subprocess.run(["git", "worktree", "add", "--detach", str(root / "base"), args.base], cwd=REPO, check=True)
        try:
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
            for repeat in range(args.repeats):
                order = list(trees.items())
                for name, tree in order if repeat % 2 == 0 else reversed(order):  # ABBA: no tree always goes first
                    out = root / f"run-{len(runs[name])}-{name.replace(' ', '-')}"
                    runs[name].append(launch(tree, teacher, data, out))
                    print(f"{name} #{repeat + 1}: {json.dumps(runs[name][-1])}", flush=True)
        finally:
            if args.base:
                subprocess.run(["git", "worktree", "remove", "--force", str(root / "base")], cwd=REPO, check=False)

    medians = {name: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} for name, rs in runs.items()}
    result = {
        **provenance(" ".join(["benchmarks/launch_overhead.py", *sys.argv[1:]])),
        "sizes": {"ranks": 2, "steps": STEPS, "config": "configs/tiny-cpu.yaml", "repeats": args.repeats},
        "medians": medians,
        "runs": runs,
    }
    for name, median in medians.items():
        print(f"median, {name}: " + ", ".join(f"{k} {v:.2f} s" for k, v in median.items()))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
