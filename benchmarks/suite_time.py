"""The test tiers' time on a clean clone: `make test` (the fast tier), then `make test-all` (both tiers, as CI).

    python3 benchmarks/suite_time.py --out docs/test-suite/suite-time.json [--clone DIR]
    python3 benchmarks/suite_time.py --table docs/test-suite/suite-time.json

Clones this repository's HEAD into DIR (a temporary directory by default), builds its ``.venv`` with
``make setup`` (timed apart), then runs ``make test`` and ``make test-all``, each with a JUnit
report, and records each command's wall time, its test count and its ten slowest tests (setup,
call and teardown together). ``--table`` prints the markdown table of a result file
(docs/benchmarks.md, "The test suite's time").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from xml.etree import ElementTree

REPO = Path(__file__).resolve().parents[1]
SLOWEST = 10


def run_make(clone: Path, args: list[str], report: Path) -> tuple[float, int]:
    """``make ARGS`` in the clone, its pytest writing a JUnit report; returns (seconds, exit code). Each command
    compiles with caches of its own, empty as on a CI machine: torch's compiled graphs (its default cache in /tmp
    outlives a run) and DeepSpeed's CPU Adam (built on first use into ~/.cache/torch_extensions, ~90 s of CPU)."""
    env = {**os.environ, "PYTEST_ADDOPTS": f"--junitxml={report}"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(clone / f".torch-compile-cache-{report.stem}")
    env["TORCH_EXTENSIONS_DIR"] = str(clone / f".torch-extensions-{report.stem}")
    started = time.monotonic()
    rc = subprocess.run(["make", *args], cwd=clone, env=env).returncode
    return time.monotonic() - started, rc


def tests_of(report: Path) -> dict[str, float]:
    """Each test case's seconds (pytest's JUnit ``time``: setup, call and teardown) in a JUnit report."""
    root = ElementTree.parse(report).getroot()
    return {
        f"{case.get('classname')}::{case.get('name')}": float(case.get("time", 0)) for case in root.iter("testcase")
    }


def summary(report: Path, seconds: float, rc: int) -> dict:
    tests = tests_of(report)
    root = ElementTree.parse(report).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    slowest = sorted(tests.items(), key=lambda kv: -kv[1])[:SLOWEST]
    return {"seconds": round(seconds, 1), "exit_code": rc, **counts, "slowest": [[n, round(s, 1)] for n, s in slowest]}


def cpu_model() -> str:
    """The CPU's name as Linux gives it (what a result file records of its machine)."""
    cpuinfo = Path("/proc/cpuinfo")
    names = re.findall(r"^model name\s*: (.*)$", cpuinfo.read_text(), re.MULTILINE) if cpuinfo.exists() else []
    return names[0] if names else "unknown"


def provenance(command: str, tree: Path = REPO) -> dict:
    """What every result file opens with: the command, the commit of ``tree`` (and whether it had uncommitted
    changes), the machine."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tree, capture_output=True, text=True).stdout.strip()

    return {
        "command": command,
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),  # changes to the code, not new outputs
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "load_average_at_end": os.getloadavg()},
    }


def made_by(result: dict, *details: str, file: str | Path | None = None) -> str:
    """The line under a generated table: the result file, its commit and ``details``, and the command that made it."""
    where = ", ".join([f"commit {result['commit'][:10]}", *details])
    return f"From `{file or result['result_file']}` ({where}), made by `{result['command']}`"


def render_between_markers(doc: Path, name: str, text: str) -> None:
    """Replace what lies between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` in ``doc`` with ``text``: the
    docs' tables are generated from result files, never typed."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    page = doc.read_text(encoding="utf-8")
    head, tail = page.index(start) + len(start), page.index(end)
    doc.write_text(page[:head] + "\n" + text + "\n" + page[tail:], encoding="utf-8")


def add_result_options(parser: argparse.ArgumentParser, default_out: Path | None) -> None:
    """The options of a script whose result file feeds a doc table: where the file goes, the page to render
    its table into, and rendering a committed file without measuring again."""
    parser.add_argument("--out", type=Path, default=default_out, help="the result file")
    parser.add_argument("--docs", type=Path, default=None, help="render the table into this Markdown file")
    parser.add_argument("--from-result", action="store_true", help="render --out as it is, without measuring")


def measured_or_committed(
    args: argparse.Namespace, measure: Callable[[], dict], table: Callable[[dict], str], marker: str
) -> dict:
    """``--from-result``: the committed file; else ``measure()``, written to ``--out``. With ``--docs``, its
    table rendered between the page's ``marker`` markers (:func:`render_between_markers`)."""
    if args.from_result:
        result = json.loads(args.out.read_text(encoding="utf-8"))
    else:
        result = measure()
        write_result(args.out, result)
    if args.docs is not None:
        render_between_markers(args.docs, marker, table(result))
    return result


def write_result(path: Path | None, result: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


def measure(clone: Path) -> dict:
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    header = provenance(" ".join(["python3 benchmarks/suite_time.py", *sys.argv[1:]]), clone)  # before any output
    started = time.monotonic()
    subprocess.run(["make", "setup"], cwd=clone, check=True)
    setup_s = time.monotonic() - started
    # The two commands a contributor runs: `make test` (ruff, the fast tier) and `make test-all` (ruff and both
    # tiers in one session, what CI runs), one after the other, each with its report.
    fast_s, fast_rc = run_make(clone, ["test"], clone / "fast.xml")
    all_s, all_rc = run_make(clone, ["test-all"], clone / "all.xml")
    header["machine"]["load_average_at_end"] = os.getloadavg()
    return {
        **header,
        "setup_seconds": round(setup_s, 1),
        "make_test": summary(clone / "fast.xml", fast_s, fast_rc),
        "make_test_all": summary(clone / "all.xml", all_s, all_rc),
    }


def table(result: dict) -> str:
    rows = (
        ("`make test`", "ruff, the fast tier", "make_test"),
        ("`make test-all`", "ruff, both tiers (CI)", "make_test_all"),
    )
    lines = ["| command | runs | tests (skipped) | wall time |", "|---|---|---|---|"]
    for command, runs, key in rows:
        tier = result[key]
        lines.append(f"| {command} | {runs} | {tier['tests']} ({tier['skipped']}) | {tier['seconds'] / 60:.1f} min |")
    lines += ["", f"`make setup` (a new .venv) took {result['setup_seconds'] / 60:.1f} min before them.", ""]
    for command, _, key in rows:
        lines += [f"The ten slowest tests of {command} (setup, call and teardown):", ""]
        lines += ["| test | seconds |", "|---|---|"] + [f"| `{t}` | {s:.1f} |" for t, s in result[key]["slowest"]]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the result JSON here")
    parser.add_argument("--clone", type=Path, help="clone into this (new) directory; default: a temporary one")
    parser.add_argument("--table", type=Path, help="print the markdown table of this result file, and exit")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    with tempfile.TemporaryDirectory(prefix="suite-time-") as tmp:
        result = measure(args.clone or Path(tmp) / "clone")
    write_result(args.out, result)
    print(table(result))
    return 1 if result["make_test"]["exit_code"] or result["make_test_all"]["exit_code"] else 0


if __name__ == "__main__":
    sys.exit(main())
