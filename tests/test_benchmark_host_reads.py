"""benchmarks/host_reads.py: the census of device-to-host reads in the real engine's steps, on a CPU rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def census(tmp_path: Path, teacher: Path, data: Path, *overrides: str) -> tuple[list[str], list[str]]:
    """(host-read rows, op rows) of ``benchmarks/host_reads.py --steps 2``; each list ends with its total."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TMPDIR": str(tmp_path)}
    script = [sys.executable, str(REPO / "benchmarks/host_reads.py"), "--steps", "2"]
    out = subprocess.run(
        [*script, f"teacher={teacher}", f"data={data}", *overrides],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
        check=True,
    ).stdout
    reads, ops = out[out.index("per step") :].split("aten ops per step")
    # past each table's header line(s): the reads table's column header, the ops table's title and column header
    return [line for line in reads.splitlines()[1:] if line.strip()], ops.splitlines()[2:]


@pytest.mark.full
def test_the_engine_step_has_no_full_device_sync_and_our_loop_reads_nothing(
    tmp_path: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path
) -> None:
    """DeepSpeed's throughput timer synchronised the device twice a step (start of forward, end of step)
    until ``deepspeed_config`` turned it off; the loop's own calls (masker, guard, meter) read nothing back.
    What DeepSpeed's ZeRO-2 optimizer still reads each step (the grad-norm checks of clipping) is listed; its
    bf16 overflow check, off unless ``deepspeed.bf16_skip_nonfinite``, reads and issues ops per parameter."""
    rows, ops = census(tmp_path, tiny_teacher_dir, tiny_dataset_dir)
    assert rows[-1].split()[-1] == "total" and int(rows[-1].split()[0]) > 0
    assert not [row for row in rows if "accelerator.synchronize" in row]
    assert not [row for row in rows if "has_overflow" in row]
    ours = [row for row in rows if "loop:" in row and "padding_mask (host tensors)" not in row]
    assert ours == []
    # every op of the step, by phase and issuer: ZeRO-2's per-parameter gradient hooks run in the backward
    assert ops[-1].split()[-1] == "total"
    assert [row for row in ops if "engine.backward" in row and "reduce_independent_p_g_buckets" in row]
    assert not [row for row in ops if "has_inf_or_nan" in row]

    rows, ops = census(tmp_path, tiny_teacher_dir, tiny_dataset_dir, "deepspeed.bf16_skip_nonfinite=true")
    assert [row for row in rows if "engine.step" in row and "has_overflow" in row]
    assert [row for row in ops if "engine.step" in row and "has_inf_or_nan" in row]


def test_an_op_with_none_of_our_frames_above_it_is_the_autograd_threads() -> None:
    """On CUDA autograd runs the backward on a thread of its own: the op's stack ends without leaving torch.
    The second GPU campaign's bare steps failed on it (``None.f_code``) where the CPU census never goes."""
    from benchmarks import host_reads

    assert host_reads.issuer(None) == "autograd engine thread (backward)"
    assert host_reads.issuer(sys._getframe()).startswith("tests/test_benchmark_host_reads.py ")
