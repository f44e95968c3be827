"""docs/faults.md's reliability table: the fault-injection tests run once more, each leaving a record of what it
injected and what happened, gathered into one result file and rendered as the table.

    python benchmarks/reliability.py [--out docs/training/reliability.json] [--docs docs/faults.md]
    python benchmarks/reliability.py --from-result --docs docs/faults.md   # render the committed file

The tests (``FAULT_TESTS``) are the suite's own: they start the real launcher on CPU ranks or the real
preprocessing command (or, for a fault one process meets the same way, the real loader, engine or filesystem in
one) and assert the outcome (bitwise equality with an uninterrupted run, the line a survivor prints, the one line
of a failed run and what it left, ...); a test that fails fails this script. Each writes its record through
``tests/helpers.record_fault``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.suite_time import add_result_options, made_by, measured_or_committed, provenance  # noqa: E402

FAULT_TESTS = [
    "tests/trainer/test_chaos.py",
    "tests/trainer/test_launcher.py::test_a_node_that_freezes_mid_step_stops_the_other_within_the_peer_timeout_and_both_resume",
    "tests/trainer/test_launcher.py::test_a_full_disk_fails_the_save_in_one_line_keeps_latest_and_the_relaunch_resumes",
    "tests/trainer/test_storage.py::test_with_damaged_shards_skip_its_samples_are_counted_never_used_and_the_positions_stay_exact",
    "tests/trainer/test_storage.py::test_the_start_check_names_a_removed_and_a_truncated_shard_in_one_line_without_reading_any",
    "tests/trainer/test_storage.py::test_a_shard_that_vanishes_mid_run_stops_the_rank_in_one_line_naming_it",
    "tests/trainer/test_checkpoint.py::test_a_failed_save_leaves_no_partial_checkpoint_whether_killed_refused_or_out_of_room",
    "tests/trainer/test_checkpoint.py::test_the_start_check_refuses_an_output_dir_without_room_or_read_only_in_one_line",
    "tests/tracking/test_registry_auth.py",
    "tests/tracking/test_registered_checkpoints.py::test_registrations_under_faults_wait_retry_and_land_once_each_in_order_while_training_never_waits",
    "tests/preprocessing/test_preprocess_faults.py",
]
RECORDS_ENV = "ENCODER_DISTILL_FAULT_RECORDS"  # tests/helpers.FAULT_RECORDS_ENV


def span(pair: list[float] | None, fmt: str) -> str:
    """A (low, high) pair as one figure or a range; "-" where the figure does not apply."""
    if pair is None:
        return "-"
    low, high = (format(x, fmt) for x in pair)
    return low if low == high else f"{low}-{high}"


def table(result: dict) -> str:
    rows = [
        "| fault | injected | by kind | outcome | data lost | survivors stopped in (s) | back to training in (s) "
        "| steps redone |",
        "|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for record in result["records"]:
        kinds = ", ".join(f"{kind} {n}" for kind, n in record["kinds"].items())
        rows.append(
            f"| {record['fault']} | {record['injected']} | {kinds} | {record['outcome']} | {record['data_lost']} | "
            f"{'-' if record['stop_s'] is None else format(record['stop_s'], '.1f')} | "
            f"{span(record['recovery_s'], '.0f')} | {span(record['steps_redone'], 'd')} |"
        )
    rows += [
        "",
        made_by(result, f"{result['machine']['cpus']} CPUs")
        + f"; each row is a test in the suite: {', '.join(sorted(result['tests']))}.",
    ]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_result_options(parser, REPO / "docs" / "training" / "reliability.json")
    args = parser.parse_args()

    def measure() -> dict:
        header = provenance(" ".join(["python benchmarks/reliability.py", *sys.argv[1:]]))
        with tempfile.TemporaryDirectory() as records:
            env = {**os.environ, RECORDS_ENV: records, "DS_ACCELERATOR": "cpu"}
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FAULT_TESTS]
            subprocess.run(command, cwd=REPO, env=env, check=True)
            found = [json.loads(p.read_text()) for p in sorted(Path(records).glob("*.json"))]
        return {
            **header,
            "result_file": str(args.out.resolve().relative_to(REPO)),
            "tests": sorted({r["test"] for r in found}),
            "records": found,
        }

    print(table(measured_or_committed(args, measure, table, "reliability")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
