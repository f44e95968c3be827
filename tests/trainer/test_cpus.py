"""trainer/runtime/cpus.py: the CPUs a process may keep busy, its affinity capped by a cgroup quota.

The cgroup trees here are files laid out as the kernel shows them (v2's ``cpu.max``, v1's
``cpu.cfs_quota_us`` and ``cpu.cfs_period_us``, ``/proc/self/cgroup``'s lines), in a temporary folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from trainer.evaluation import suite as evaluate_suite
from trainer.runtime.cpus import cgroup_cpu_limit, usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


def tree(tmp_path: Path, self_cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    (tmp_path / "self").write_text(self_cgroup)
    return root, tmp_path / "self"


def test_v2_the_smallest_quota_on_the_way_up_binds(tmp_path: Path) -> None:
    """A pod's limit (1.5 CPUs) binds the container below it, which sets none of its own."""
    root, me = tree(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        {"kubepods/pod1/ctr/cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "150000 100000\n"},
    )
    assert cgroup_cpu_limit(root, me) == 1.5
    assert usable_cpus(root, me) == min(AFFINITY, 2)  # 1.5 CPUs: two threads


def test_v2_inside_a_container_its_own_group_is_the_root(tmp_path: Path) -> None:
    """The named path does not exist in the container's view: the mount's own cpu.max is the container's."""
    root, me = tree(tmp_path, "0::/system.slice/docker-1.scope\n", {"cpu.max": "100000 100000\n"})
    assert cgroup_cpu_limit(root, me) == 1.0
    assert usable_cpus(root, me) == 1


def test_v1_quota_and_no_quota(tmp_path: Path) -> None:
    files = {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
    }
    root, me = tree(tmp_path, "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n", files)
    assert cgroup_cpu_limit(root, me) == 0.5
    assert usable_cpus(root, me) == 1  # at least one

    unlimited = tmp_path / "unlimited"
    unlimited.mkdir()
    root, me = tree(unlimited, "1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_limit(root, me) is None
    assert usable_cpus(root, me) == AFFINITY


def test_no_cgroup_or_a_quota_above_the_machine_leaves_the_affinity(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path, tmp_path / "missing") is None
    (tmp_path / "odd").write_text("not a cgroup line\n\n")
    assert cgroup_cpu_limit(tmp_path, tmp_path / "odd") is None
    root, me = tree(tmp_path, "0::/\n", {"cpu.max": f"{1000 * AFFINITY * 100000} 100000\n"})
    assert usable_cpus(root, me) == AFFINITY
    assert 1 <= usable_cpus() <= AFFINITY  # this machine's own


def test_a_one_process_suite_runs_no_more_threads_than_the_quota_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    """``jobs=1`` runs in this process: its PyTorch threads are cut to the usable CPUs (here a quota of 1)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(evaluate_suite, "usable_cpus", lambda: 1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cfg = evaluate_suite.SuiteConfig(models=["unused"], jobs=1)
        assert evaluate_suite.run_all(cfg, [], {}, {}, {}) == ([], 0)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
