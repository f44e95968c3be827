"""The pool that runs the ablation's steps several at a time (benchmarks/quality/pool.sh, ABLATION_JOBS),
driven by small bash scripts: at most N steps run at once, `pool_await` waits for the steps it names and no
others, and a failed step starts nothing new while the steps already running finish."""

from __future__ import annotations

import subprocess
from pathlib import Path

from helpers import REPO

POOL = REPO / "benchmarks" / "quality" / "pool.sh"

# step NAME SECONDS STATUS: marks its start and end in the log (one short append each: atomic), sleeps, exits.
STEP = """
set -euo pipefail
source "$POOL"
step() { echo "+ $1" >>"$LOG"; sleep "$2"; echo "- $1" >>"$LOG"; return "$3"; }
"""


def run_pool(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    log = tmp_path / "log"
    script = tmp_path / "script.sh"
    script.write_text(STEP + body)
    env = {"POOL": str(POOL), "LOG": str(log), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    return proc, log.read_text().splitlines() if log.exists() else []


def most_at_once(log: list[str]) -> int:
    running = peak = 0
    for line in log:
        running += 1 if line.startswith("+") else -1
        peak = max(peak, running)
    return peak


def test_at_most_n_steps_run_at_once_and_all_of_them_run(tmp_path: Path) -> None:
    proc, log = run_pool(
        tmp_path,
        """
pool_init 2
for name in a b c d e; do pool_start "$name" step "$name" 0.5 0; done
pool_finish
echo finished
""",
    )
    assert proc.returncode == 0 and proc.stdout == "finished\n", proc.stderr
    assert sorted(log) == sorted([f"+ {n}" for n in "abcde"] + [f"- {n}" for n in "abcde"])
    assert most_at_once(log) == 2


def test_one_slot_runs_the_steps_one_after_another_in_order(tmp_path: Path) -> None:
    proc, log = run_pool(tmp_path, 'pool_init 1\nfor n in a b c; do pool_start "$n" step "$n" 0 0; done\npool_finish\n')
    assert proc.returncode == 0, proc.stderr
    assert log == ["+ a", "- a", "+ b", "- b", "+ c", "- c"]


def test_await_waits_for_the_named_steps_only(tmp_path: Path) -> None:
    proc, log = run_pool(
        tmp_path,
        """
pool_init 3
pool_start slow step slow 3 0
pool_start fast step fast 0 0
pool_await fast
echo "awaited" >>"$LOG"
pool_finish
""",
    )
    assert proc.returncode == 0, proc.stderr
    assert log.index("- fast") < log.index("awaited") < log.index("- slow")


def test_a_failed_step_starts_nothing_new_lets_the_running_finish_and_fails_naming_it(tmp_path: Path) -> None:
    proc, log = run_pool(
        tmp_path,
        """
pool_init 2
pool_start long step long 1 0
pool_start broken step broken 0 3
pool_await broken
pool_start later step later 0 0
echo "not reached"
""",
    )
    assert proc.returncode == 1 and "not reached" not in proc.stdout
    assert "script.sh: failed: broken" in proc.stderr
    assert "- long" in log  # the running step finished (it records itself, for a resumed run)
    assert "+ later" not in log  # and nothing new started


def test_a_bad_number_of_slots_is_refused_naming_its_source(tmp_path: Path) -> None:
    for bad in ("0", "two", "-1", ""):
        proc, _ = run_pool(tmp_path, f'pool_init "{bad}" ABLATION_JOBS\n')
        assert proc.returncode == 2 and f"ABLATION_JOBS: '{bad}' is not a positive number of slots" in proc.stderr
