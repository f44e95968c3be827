"""benchmarks/store_streaming.py: the loader's data wait over a throttled real S3 server, at a GPU's rate.

Run short (3 s a measurement): it must report every row, and the throttle must be real: a store slower than
what the stand-in GPU consumes makes the loop wait far longer than an unthrottled one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.full
def test_a_store_slower_than_the_gpu_starves_it_and_a_fast_one_does_not(tmp_path: Path) -> None:
    out = tmp_path / "store-streaming.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/store_streaming.py", "--seconds", "3", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["source"], r["bandwidth_x"]): r for r in result["rows"]}
    assert set(rows) == {("local", None), ("s3", 0.8), ("s3", 1.5), ("s3", 3.0), ("s3", None)}
    assert all(r["batches"] > 0 for r in rows.values())
    starved, unthrottled = rows["s3", 0.8]["data_wait_share"], rows["s3", None]["data_wait_share"]
    assert starved > 0.1 and starved > 3 * unthrottled
    assert result["sizes"]["micro_batch"] == 256 and result["commit"]
    assert "| s3 | 0.8x the need |" in done.stdout
