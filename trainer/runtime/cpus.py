"""How many CPUs this process may keep busy: its affinity mask, capped by its cgroup's CPU quota.

``os.cpu_count()`` counts the machine's CPUs, and PyTorch starts as many threads as the CPUs the affinity
mask allows. In a container the process may be allowed less: a CPU quota (a Kubernetes pod's CPU limit,
``docker --cpus``, a cgroup a scheduler made) gives a group of processes so much CPU time per period,
however many threads they start. Past the quota the kernel stops the whole group until the next period,
and a parallel matrix product, which waits for its slowest thread at every step, can run many times
slower than on as many threads as the quota allows. The commands that size their thread pools ask here.

Both cgroup versions are read: v2's ``cpu.max`` ("QUOTA PERIOD", or "max PERIOD" for none) and v1's
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1 for none), in the process's own cgroup and every one above
it (a parent's limit binds its children), where ``/proc/self/cgroup`` names them; the smallest limit wins.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


def usable_cpus(cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int:
    """The CPUs this process may use at once: the affinity mask's count, capped by the cgroup quota
    rounded up (a quota of 1.5 CPUs: 2 threads), and at least 1."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit(cgroup_root, self_cgroup)
    return max(1, min(allowed, math.ceil(limit)) if limit is not None else allowed)


def cgroup_cpu_limit(cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> float | None:
    """The CPU quota binding this process, in CPUs (quota / period), or None where no cgroup sets one."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:  # not Linux, or no /proc
        return None
    limits = []
    for line in lines:
        if line.count(":") < 2:  # "ID:CONTROLLERS:PATH"; nothing else is a cgroup line
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: one hierarchy, the cpu controller's files in each group
            limits += [v2_limit(group / "cpu.max") for group in groups(cgroup_root, path)]
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's own hierarchy
            for mount in (cgroup_root / controllers, cgroup_root / "cpu"):
                if mount.is_dir():
                    limits += [v1_limit(group) for group in groups(mount, path)]
                    break
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def groups(mount: Path, path: str) -> list[Path]:
    """The process's cgroup directory under ``mount`` and each one above it, up to the mount itself. Inside
    a container the named path may not exist (the container sees its own group as the root): the mount alone."""
    parts = Path(path.strip("/")).parts
    if ".." in parts or not mount.joinpath(*parts).is_dir():
        return [mount]
    return [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def v2_limit(cpu_max: Path) -> float | None:
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def v1_limit(group: Path) -> float | None:
    try:
        quota = int((group / "cpu.cfs_quota_us").read_text())
        period = int((group / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def describe() -> str:
    """One line for a run's record: what the machine reports and what a command here will use."""
    import torch

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return (
        f"cpus: os.cpu_count {os.cpu_count()} | affinity {affinity} | cgroup quota {cgroup_cpu_limit()} CPUs"
        f" | usable {usable_cpus()} | torch threads by default {torch.get_num_threads()}"
    )


if __name__ == "__main__":  # python -m trainer.runtime.cpus: the GPU scripts' versions.txt records it
    print(describe())
