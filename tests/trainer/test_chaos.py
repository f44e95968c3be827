"""Chaos resume: a 2-rank run SIGKILLed at seeded random moments, relaunched each time with the same command,
ends bitwise where an uninterrupted run ends.

The driver (:func:`chaos_run`) draws, from a seeded generator, what to kill and when:

* ``rank``: a training rank, a random time into the steps after the relaunch's first logged step;
* ``save``: a training rank while a checkpoint is being written (its step directory exists, ``latest``
  does not name it yet); counted as a torn save only when the kill left that directory behind;
* ``worker``: a rank's data-loader worker, while it is reading ahead (the rank then fails on its own).

After every kill it checks that the checkpoint ``latest`` names is complete (every file DeepSpeed writes
for both ranks, each an intact archive), and relaunches. At the end the final checkpoint's weights and
optimizer state, tensor by tensor, and the exported student, byte by byte, equal the uninterrupted run's.
"""

from __future__ import annotations

import collections
import contextlib
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
from helpers import check_latest_is_complete, console_log, latest_step, launch_run, record_fault, records

REPO = Path(__file__).resolve().parents[2]
# Each kill costs a relaunch (~20 s on 2 cores, most of it the launcher's start), and a kill moves the run on by
# one to three steps: three kills and 24 steps leave the last launch part of the run to finish. A kill of a rank or
# a data-loader worker that lands while a checkpoint is being written counts as "save" (the moment that matters):
# which kinds land is the seed's draw, so the test asserts that a save was torn, not that every kind came up.
MAX_STEPS = 24
SETTINGS = [
    f"max_steps={MAX_STEPS}",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=2",
    "eval.every_steps=12",
    "logging.every_steps=1",
]
KILLS = 3
SEED = 54
RUN_TIMEOUT = 300


def start(teacher: Path, data: Path, out: Path) -> subprocess.Popen:
    return launch_run("configs/tiny-cpu.yaml", out, f"teacher={teacher}", f"data={data}", *SETTINGS)


def ranks_of(launcher: psutil.Process) -> list[psutil.Process]:
    """The training ranks under a launcher (not their data-loader workers, forks with the same command line);
    processes that come and go meanwhile are skipped."""
    ranks = []
    for p in launcher.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "--local_rank=" in " ".join(p.cmdline()) and "deepspeed.launcher" in " ".join(p.parent().cmdline()):
                ranks.append(p)
    return ranks


def workers_of(rank: psutil.Process) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return [p for p in rank.children() if p.cmdline() == rank.cmdline()]
    return []


def last_logged_step(out: Path) -> int:
    return max((r["step"] for r in records(out) if "train/loss" in r), default=0)


def saving(out: Path) -> bool:
    """A checkpoint is being written: a step directory newer than the one ``latest`` names."""
    latest = latest_step(out) or 0
    steps = [int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*") if p.is_dir()]
    return any(step > latest for step in steps)


@dataclass
class Kill:
    """One launch of the chaos run and the kill that ended it. ``hit``: ``save`` only when the kill left a
    checkpoint half-written (a step directory ``latest`` does not name), ``rank`` for a rank killed anywhere
    else, ``worker``, or ``finished`` when the run ended first. ``back_s``: from the launch to its first step
    past what earlier launches had logged (the recovery from the kill before it); ``stop_s``: from the kill
    to the launcher's exit; ``redone``: the steps logged before the kill that a relaunch repeats."""

    hit: str
    back_s: float
    stop_s: float = 0.0
    redone: int = 0


def kill_once(launch: Callable[[], subprocess.Popen], out: Path, rng: random.Random, kind: str, timeout: float) -> Kill:
    """Launch, wait for the moment ``kind`` asks for, SIGKILL, and wait for the launcher to stop."""
    launched = time.monotonic()
    proc = launch()
    launcher = psutil.Process(proc.pid)
    resumed_past = last_logged_step(out)  # what earlier launches logged: this one must get beyond it
    deadline = time.monotonic() + timeout
    delay, which = rng.uniform(0.0, 1.0), rng.randrange(2)  # drawn up front: the same draws whatever the timing
    while len(ranks := ranks_of(launcher)) < 2 or last_logged_step(out) <= resumed_past:
        if proc.poll() is not None:
            return Kill("finished", time.monotonic() - launched)
        assert time.monotonic() < deadline, "the relaunch did not get past its resume point"
        time.sleep(0.005)
    back_s = time.monotonic() - launched
    if kind == "none":  # the last launch: let it finish
        return Kill("finished" if proc.wait(timeout=timeout) == 0 else "failed", back_s)
    rank = sorted(ranks, key=lambda p: p.pid)[which]
    victim = workers_of(rank)[:1] if kind == "worker" else [rank]
    if kind == "save":  # poll the filesystem only: a save of this tiny model takes tens of milliseconds
        while not saving(out) and proc.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint save came"
            time.sleep(0.001)
    else:
        time.sleep(delay)
    if proc.poll() is not None or not victim:
        return Kill("finished" if proc.wait() == 0 else kind, back_s)
    with contextlib.suppress(psutil.NoSuchProcess):  # it ended on its own just now
        victim[0].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    if proc.wait(timeout=120) == 0:
        return Kill("finished", back_s)
    hit = "save" if saving(out) else "worker" if kind == "worker" else "rank"
    return Kill(hit, back_s, time.monotonic() - killed, last_logged_step(out) - (latest_step(out) or 0))


def chaos_run(teacher: Path, data: Path, out: Path, kills: int, seed: int) -> list[Kill]:
    """Kill and relaunch until ``kills`` kills have landed, then let the run finish; returns the launches, the
    last one (``finished``) included. Every kind comes round in turn."""
    rng = random.Random(seed)
    kinds = ["rank", "save", "worker"]
    launches: list[Kill] = []
    while len(launches) < kills:
        kind = kinds[len(launches) % len(kinds)]
        launches.append(kill_once(lambda: start(teacher, data, out), out, rng, kind, RUN_TIMEOUT))
        assert launches[-1].hit != "finished", f"the run finished after {launches}: too few steps for {kills} kills"
        check_latest_is_complete(out)
    launches.append(kill_once(lambda: start(teacher, data, out), out, rng, "none", RUN_TIMEOUT))
    assert launches[-1].hit == "finished", console_log(out).read_text()[-4000:]
    return launches


def tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor in a DeepSpeed checkpoint file, by its path in the nested state."""
    state = torch.load(path, map_location="cpu", weights_only=False)  # DeepSpeed's own file, written by this run
    found: dict[str, torch.Tensor] = {}

    def walk(value: object, key: str) -> None:
        if isinstance(value, torch.Tensor):
            found[key] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}/{k}")
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(v, f"{key}/{i}")

    walk(state, "")
    return found


@pytest.mark.full
@pytest.mark.integration
def test_sigkills_at_random_moments_end_bitwise_where_an_uninterrupted_run_ends(
    tmp_path: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path
) -> None:
    reference = tmp_path / "reference" / "run"
    proc = start(tiny_teacher_dir, tiny_dataset_dir, reference)
    assert proc.wait(timeout=RUN_TIMEOUT) == 0, console_log(reference).read_text()[-4000:]

    out = tmp_path / "chaos" / "run"
    launches = chaos_run(tiny_teacher_dir, tiny_dataset_dir, out, KILLS, SEED)
    landed = [launch.hit for launch in launches[:-1]]
    assert len(landed) == KILLS and "save" in landed  # a save torn at least once
    log = console_log(out).read_text()
    assert log.count("resumed from step") >= KILLS - 1  # a kill before the first save restarts from step 0

    final = f"step-{MAX_STEPS:08d}"
    files = sorted(p.name for p in (reference / "checkpoints" / final).glob("*.pt"))
    assert files == sorted(p.name for p in (out / "checkpoints" / final).glob("*.pt"))
    for name in files:
        expected, got = tensors(reference / "checkpoints" / final / name), tensors(out / "checkpoints" / final / name)
        assert expected.keys() == got.keys(), name
        for key in expected:
            assert torch.equal(expected[key], got[key]), f"{name}{key}"
    student = "student/model.safetensors"
    assert (out / student).read_bytes() == (reference / student).read_bytes()
    recoveries = [launch.back_s for launch in launches[1:]]
    record_fault(
        "chaos-sigkill",
        fault="SIGKILL at seeded random moments (2 CPU ranks, one node)",
        injected=len(landed),
        kinds=dict(collections.Counter(landed)),
        outcome="relaunched with the same command each time; final weights, optimizer state and student bitwise "
        "equal to the uninterrupted run's; `latest` named a complete checkpoint after every kill",
        data_lost=0,
        stop_s=max(launch.stop_s for launch in launches[:-1]),
        recovery_s=[min(recoveries), max(recoveries)],
        steps_redone=[min(k.redone for k in launches[:-1]), max(k.redone for k in launches[:-1])],
    )
