"""One device call answers the next open GPU questions: ``bash benchmarks/gpu/run.sh OUT next`` runs this.

    python benchmarks/gpu/next.py OUT --deadline UNIX_SECONDS [--inputs .gpu] [--throughput-args "--quick ..."]
    python benchmarks/gpu/next.py --measure-carry .gpu

The questions are ``benchmarks/gpu/items.json``'s items, in its order. One is answered when its file,
``docs/gpu-campaign/next/NAME.json``, is in the checkout (``--answers``; a device call gets a copy of the working
tree, so the answers committed before it are the state it continues from: nothing is kept on the machine) or
already in OUT (a second call into the same OUT continues too). For each item not answered, in order: started only
if its ``estimate_s`` fits the time left to the deadline (else the next that fits is tried), measured by
``train_throughput.py`` (``repeats`` fresh runs of its ``--only``), and, when every run finished without an error,
written to OUT/NAME.json at once, atomically: a call killed mid-item leaves the files of the items it finished,
whole, and none of the one it was in. OUT/next.md says what each item is now (answered, measured, failed, not
started and why) with its seconds. Back here, the returned NAME.json files are committed into
``docs/gpu-campaign/next/``: the next call, in any later session, starts with the first item still open.

Items whose answer is a quality study (``quality``) run on their own carry (``not_run_by_next`` says why): listed
with their estimates, never started here.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.atomic import write_text_atomically

REPO = Path(__file__).resolve().parents[2]
ITEMS = REPO / "benchmarks" / "gpu" / "items.json"
ANSWERS = REPO / "docs" / "gpu-campaign" / "next"
CARRY_LIMIT = 64 * 2**20  # the device tool's: the working tree and the carried folders together


def load_items(path: Path = ITEMS) -> dict[str, Any]:
    return json.loads(path.read_text())


def tracked_bytes() -> int:
    """The working tree a device call copies: the files git tracks, as they are here."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return sum((REPO / n).stat().st_size for n in names.decode().split("\0") if n and (REPO / n).is_file())


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def windows(report: dict[str, Any]) -> dict[str, list[float]]:
    """Each case's and step's timed windows, tokens/s: a case's log intervals after the first, a step's
    ``--window`` windows (a step timed as one window: its rate alone)."""
    rates = {r["name"]: r.get("interval_tokens_per_s") or [] for r in report["cases"]}
    rates |= {r["name"]: r.get("window_tokens_per_s") or [r["tokens_per_s"]] for r in report["steps"]}
    return rates


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "windows": len(values)}


def summarize(item: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each measured name's windows over all repeats (median, range) and the item's ratios (``[top, bottom]``, or a
    suffix: each ``NAME-suffix`` over ``NAME``): the medians' ratio and its range, the slowest numerator window over
    the fastest denominator's up to the reverse."""
    pooled: dict[str, list[float]] = {}
    for run in runs:
        for name, rates in windows(run).items():
            pooled.setdefault(name, []).extend(rates)
    rates = {name: spread(values) for name, values in pooled.items() if values}
    ratios = {}
    pairs = [pair for pair in item.get("ratios", []) if isinstance(pair, list)]
    for suffix in (spec for spec in item.get("ratios", []) if isinstance(spec, str)):  # each twin over its base
        pairs += [[name, name.removesuffix(suffix)] for name in rates if name.endswith(suffix)]
    for top, bottom in pairs:
        if top in rates and bottom in rates:
            a, b = rates[top], rates[bottom]
            ratios[f"{top} / {bottom}"] = {
                "median": a["median"] / b["median"],
                "min": a["min"] / b["max"],
                "max": a["max"] / b["min"],
            }
    return {"tokens_per_s": rates, "ratios": ratios}


def failures(report: dict[str, Any]) -> list[str]:
    """What keeps a run from answering: a case or step that failed or was stopped, one not started, or none run."""
    measured = report["cases"] + report["steps"]
    bad = [f"{r['name']}: {str(r.get('error', r.get('rc')))[-300:]}" for r in measured if "error" in r or r.get("rc")]
    bad += [f"{name}: not started before the deadline" for name in report.get("not_started", [])]
    if not measured:
        bad.append("nothing measured: --only named nothing of this list")
    return bad


def run_item(
    item: dict[str, Any], inputs: Path, work: Path, deadline: float, extra: list[str]
) -> tuple[dict[str, Any] | None, list[str]]:
    """The item measured: ``repeats`` fresh train_throughput.py runs, one after another; (its answer, []) or
    (None, what failed)."""
    runs = []
    for repeat in range(item.get("repeats", 1)):
        results = work / item["name"] / f"run-{repeat}"
        shutil.rmtree(results, ignore_errors=True)
        spec = item["throughput"]
        command = [sys.executable, "benchmarks/gpu/train_throughput.py", str(results), f"--data={inputs}"]
        command += [f"--parts={spec['parts']}", f"--only={spec['only']}", f"--deadline={deadline}", *extra]
        print(f"=== {item['name']} run {repeat + 1}: {shlex.join(command[1:])}", flush=True)
        subprocess.run(command, cwd=REPO, check=False)
        path = results / "throughput.json"
        if not path.is_file():
            return None, [f"run {repeat + 1}: train_throughput.py wrote no throughput.json (its output above)"]
        report = json.loads(path.read_text())
        if bad := failures(report):
            return None, [f"run {repeat + 1}: {b}" for b in bad]
        runs.append(report)
    answer = {k: item[k] for k in ("name", "question", "throughput", "repeats", "estimate_s")}
    answer |= {"device": runs[0]["device"], "versions": runs[0]["versions"], **summarize(item, runs), "runs": runs}
    return answer, []


def status_md(rows: list[tuple[dict[str, Any], str]], started: float, carry: str) -> str:
    lines = [f"# GPU next: this call {time.time() - started:.0f} s", "", carry, ""]
    lines += ["| item | estimate s | status |", "|---|---|---|"]
    lines += [f"| {item['name']} | {item['estimate_s']} | {status} |" for item, status in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--deadline", type=float, help="Unix time by which to have stopped")
    parser.add_argument("--inputs", type=Path, default=REPO / ".gpu", help="what make gpu-wheels gpu-data made")
    parser.add_argument("--answers", type=Path, default=ANSWERS, help="the committed answers")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-next"), help="the runs' own results")
    parser.add_argument("--throughput-args", default="", help="more train_throughput.py arguments (--quick ...)")
    parser.add_argument("--measure-carry", type=Path, default=None, help="record this folder's size in items.json")
    args = parser.parse_args(argv)
    if args.measure_carry is not None:
        spec = load_items()
        spec["carry"] |= {"path": str(args.measure_carry), "bytes": folder_bytes(args.measure_carry)}
        spec["carry"]["source"] = f"measured by next.py --measure-carry on {time.strftime('%Y-%m-%d')}"
        write_text_atomically(ITEMS, json.dumps(spec, indent=2) + "\n")
        carried = spec["carry"]["bytes"] / 1e6
        print(f"{args.measure_carry}: {carried:.1f} MB; with the tracked tree {carry_bytes(spec) / 2**20:.1f} MiB")
        return 0
    if args.out is None or args.deadline is None:
        parser.error("OUT and --deadline are required")
    started = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(args.throughput_args)
    here = folder_bytes(args.inputs) if args.inputs.is_dir() else 0
    carry = f"Carried: {args.inputs.name} {here / 1e6:.1f} MB."
    items = load_items()["items"]

    def answered(item: dict[str, Any]) -> str | None:
        if (args.answers / f"{item['name']}.json").is_file():
            return "answered: committed"
        if (args.out / f"{item['name']}.json").is_file():
            return f"answered by an earlier call into this OUT ({item['name']}.json)"
        return None

    rows: list[tuple[dict[str, Any], str]] = []

    def report(current: str | None = None) -> None:  # next.md: the items done, the current one, the rest
        later = [(item, answered(item) or "open") for item in items[len(rows) + bool(current) :]]
        now = [(items[len(rows)], current)] if current else []
        write_text_atomically(args.out / "next.md", status_md(rows + now + later, started, carry))

    for item in items:
        left = args.deadline - time.time()
        if done := answered(item):
            status = done
        elif "throughput" not in item:
            status = f"not run by next: {item['not_run_by_next']}"
        elif item["estimate_s"] > left:
            status = f"not started: needs {item['estimate_s']} s, {left:.0f} s left"
        else:
            report(f"running since {time.strftime('%H:%M:%S')}, {left:.0f} s left (a call killed here answers nothing)")
            began = time.time()
            answer, bad = run_item(item, args.inputs, args.work, args.deadline, extra)
            if answer is None:
                status = f"FAILED after {time.time() - began:.0f} s (next.log): {'; '.join(bad)[:500]}"
            else:
                answer["wall_s"] = time.time() - began
                write_text_atomically(args.out / f"{item['name']}.json", json.dumps(answer, indent=2) + "\n")
                status = f"**measured** in {answer['wall_s']:.0f} s: {item['name']}.json"
        print(f"--- {item['name']}: {status}", flush=True)
        rows.append((item, status.replace("\n", " ").replace("|", "/")))
        report()
    print((args.out / "next.md").read_text())
    return 0


def carry_bytes(spec: dict[str, Any]) -> int:
    """What a `next` call carries: the tracked tree as it is now and the carried folder as last measured."""
    return tracked_bytes() + spec["carry"]["bytes"]


if __name__ == "__main__":
    sys.exit(main())
