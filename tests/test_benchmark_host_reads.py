"""benchmarks/host_reads.py: the census of device-to-host reads in the real engine's steps, on a CPU rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_engine_step_has_no_full_device_sync_and_our_loop_reads_nothing(
    tmp_path: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path
) -> None:
    """DeepSpeed's throughput timer synchronised the device twice a step (start of forward, end of step)
    until ``deepspeed_config`` turned it off; the loop's own calls (masker, guard, meter) read nothing back.
    What DeepSpeed's ZeRO-2 optimizer still reads each step (overflow, grad-norm checks) is listed."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TMPDIR": str(tmp_path)}
    script = [sys.executable, str(REPO / "benchmarks/host_reads.py"), "--steps", "2"]
    out = subprocess.run(
        [*script, f"teacher={tiny_teacher_dir}", f"data={tiny_dataset_dir}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
        check=True,
    ).stdout
    rows = out[out.index("per step") :].splitlines()[1:]
    assert rows[-1].split()[-1] == "total" and int(rows[-1].split()[0]) > 0
    assert not [row for row in rows if "accelerator.synchronize" in row]
    assert [row for row in rows if "engine.step" in row and "has_overflow" in row]
    ours = [row for row in rows if "loop:" in row and "padding_mask (host tensors)" not in row]
    assert ours == []
