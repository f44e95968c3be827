"""A wrong rendezvous address fails in seconds, saying so, instead of hanging silently until the
process-group timeout, 10 minutes under DeepSpeed (``trainer/runtime/rendezvous.py``).

The helpers run against real sockets and a real resolver; the launches are real ranks started the
ways a cluster starts them, alone, so that rank 0 is never there: by the DeepSpeed launcher from a
hostfile with ``--no_ssh`` (one node of two), and with torch.distributed's environment alone as
``launch/slurm.sbatch``'s ``srun`` does.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from deepspeed.constants import default_pg_timeout
from helpers import console_log, free_port, launch_run

from common.config import ConfigError
from trainer.runtime.rendezvous import (
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    check_master_addr,
    log_interval,
    logged_while_waiting,
    master_address,
    rendezvous_timeout,
    wait_for_rank_zero,
)

REPO = Path(__file__).resolve().parents[2]
NO_SUCH_HOST = "no-such-host.invalid"  # RFC 6761: .invalid never resolves
LAUNCH_TIMEOUT = 180  # the old behaviour waited 10 minutes; these launches take 10-20 s (40 s on a loaded machine)
QUICK = 90  # seconds: "at once", however loaded the machine; the imports before the check take most of it


# ------------------------------------------------------------------ the helpers
def test_the_rendezvous_timeout_is_generous_by_default_and_set_in_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert rendezvous_timeout() == DEFAULT_TIMEOUT_S == default_pg_timeout.total_seconds()  # as long as the join
    if "DEEPSPEED_TIMEOUT" not in os.environ:
        assert DEFAULT_TIMEOUT_S == 600
    monkeypatch.setenv(TIMEOUT_ENV, " 1200 ")
    assert rendezvous_timeout() == 1200
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert rendezvous_timeout() == 2.5
    for bad in ("ten", "0", "-5", "inf", "nan"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(ConfigError, match=rf"{TIMEOUT_ENV}='{bad}': must be a positive number of seconds"):
            rendezvous_timeout()


def test_a_wait_logs_every_30_s_and_at_least_once_before_a_short_timeout() -> None:
    assert log_interval(600) == 30 and log_interval(60) == 30
    assert log_interval(5) == 2.5


def test_master_address_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "node-a")
    monkeypatch.setenv("MASTER_PORT", "29611")
    assert master_address() == ("node-a", 29611)
    monkeypatch.setenv("MASTER_PORT", "70000")
    with pytest.raises(ConfigError, match=r"MASTER_PORT='70000' is not a port number"):
        master_address()
    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(ConfigError, match=r"MASTER_ADDR is not set: .*--master_addr"):
        master_address()


def test_a_master_addr_that_does_not_resolve_is_refused_in_one_line() -> None:
    check_master_addr("127.0.0.1", 29611)
    check_master_addr("localhost", 29611)
    with pytest.raises(ConfigError) as err:
        check_master_addr(NO_SUCH_HOST, 29611)
    message = str(err.value)
    assert message.startswith(f"MASTER_ADDR={NO_SUCH_HOST} does not resolve to an address")
    assert "--master_addr" in message and "hostfile" in message and "Slurm" in message and "\n" not in message


def test_waiting_for_rank_zero_returns_as_soon_as_it_listens(caplog: pytest.LogCaptureFixture) -> None:
    """Rank 0 comes up 4.5 s late: the wait (an 8 s timeout, so a line every 4 s) logs once and returns."""
    port = free_port()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def rank_zero_comes_up_late() -> None:
        time.sleep(4.5)
        listener.bind(("127.0.0.1", port))
        listener.listen()

    late = threading.Thread(target=rank_zero_comes_up_late)
    late.start()
    try:
        with caplog.at_level(logging.WARNING, logger="trainer.runtime.rendezvous"):
            waited = wait_for_rank_zero("127.0.0.1", port, rank=3, timeout_s=8)
    finally:
        late.join()
        listener.close()
    assert 4.4 < waited < 7
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert re.fullmatch(
        rf"rank 3: waiting for rank 0 at 127\.0\.0\.1:{port} for \d s \(no answer yet: Connection refused; "
        rf"giving up after 8 s, {TIMEOUT_ENV}\)",
        lines[0],
    )


def test_waiting_for_rank_zero_gives_up_after_the_timeout(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()  # nothing listens there
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="trainer.runtime.rendezvous"), pytest.raises(ConfigError) as err:
        wait_for_rank_zero("127.0.0.1", port, rank=1, timeout_s=2)
    assert 2 <= time.monotonic() - started < 4
    assert str(err.value).startswith(
        f"rank 1: rank 0 did not answer at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) within 2 s (Connection refused)"
    )
    assert TIMEOUT_ENV in str(err.value)
    assert [r.getMessage().split(" for ")[0] for r in caplog.records] == ["rank 1: waiting"]


def test_logged_while_waiting_speaks_only_while_the_call_blocks(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="trainer.runtime.rendezvous"):
        with logged_while_waiting("rank 2: waiting for the barrier", every_s=0.1, level=logging.INFO):
            pass  # a call that returns at once: nothing may be logged
        assert caplog.records == []
        with logged_while_waiting("rank 2: waiting for the barrier", every_s=0.1, level=logging.INFO):
            time.sleep(0.35)
        time.sleep(0.2)  # nothing after the call returned
    lines = [r.getMessage() for r in caplog.records]
    assert 2 <= len(lines) <= 4
    assert all(re.fullmatch(r"rank 2: waiting for the barrier for 0 s", line) for line in lines)


# ------------------------------------------------------------------ real ranks, started alone
def run_one_node_of_two(
    teacher: Path, data: Path, out: Path, node_rank: int, master_addr: str, master_port: int, env: dict[str, str]
) -> tuple[int, str, float]:
    """``deepspeed --hostfile H --no_ssh --node_rank N --master_addr A --master_port P launch/run.sh ...``
    for one of two nodes of one rank each, as on a cluster without ssh; (exit code, console, seconds)."""
    hostfile = out.parent / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    launcher = (
        "--hostfile",
        str(hostfile),
        "--no_ssh",
        f"--node_rank={node_rank}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port}",
    )
    started = time.monotonic()
    proc = launch_run("configs/tiny-cpu.yaml", out, f"teacher={teacher}", f"data={data}", launcher=launcher, env=env)
    try:
        rc = proc.wait(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:  # the hang this guards against: end the launcher and its rank, then fail
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        raise
    return rc, console_log(out).read_text(), time.monotonic() - started


def run_rank_from_environment(
    teacher: Path, data: Path, out: Path, rank: int, master_addr: str, master_port: int, env: dict[str, str]
) -> tuple[int, str, float]:
    """Training's rank ``rank`` of two as a task of ``launch/slurm.sbatch`` (:func:`start_rank_from_environment`)."""
    args = ["configs/tiny-cpu.yaml", f"teacher={teacher}", f"data={data}", f"output_dir={out}"]
    return start_rank_from_environment(args, rank, master_addr, master_port, env)


def start_rank_from_environment(
    args: list[str], rank: int, master_addr: str, master_port: int, env: dict[str, str]
) -> tuple[int, str, float]:
    """``python -u launch/run.sh ARGS`` with RANK, WORLD_SIZE=2, MASTER_ADDR, MASTER_PORT in the environment,
    as each task of ``launch/slurm.sbatch`` starts; (exit code, console, seconds)."""
    world = {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": master_addr}
    world["MASTER_PORT"] = str(master_port)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **world, **env}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-u", "launch/run.sh", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started


LAUNCHES = {"deepspeed-hostfile-no-ssh": run_one_node_of_two, "slurm-style-environment": run_rank_from_environment}


@pytest.mark.full
@pytest.mark.integration
@pytest.mark.parametrize(("how", "rank"), [("deepspeed-hostfile-no-ssh", 1), ("slurm-style-environment", 0)])
def test_a_master_addr_that_does_not_resolve_fails_at_once_saying_how_to_fix_it(
    tmp_path: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path, how: str, rank: int
) -> None:
    """Before this check every rank, rank 0 included, retried the lookup silently until the process-group timeout."""
    rc, console, seconds = LAUNCHES[how](
        tiny_teacher_dir, tiny_dataset_dir, tmp_path / "run", rank, NO_SUCH_HOST, free_port(), {}
    )
    assert rc != 0, console[-3000:]
    assert f"error: MASTER_ADDR={NO_SUCH_HOST} does not resolve to an address" in console, console[-3000:]
    assert "--master_addr" in console
    assert "waiting for" not in console  # it never started to wait
    assert seconds < QUICK, f"took {seconds:.0f} s"


@pytest.mark.full
@pytest.mark.integration
@pytest.mark.parametrize("how", LAUNCHES)
def test_a_rank_that_cannot_reach_rank_zero_logs_while_it_waits_and_gives_up(
    tmp_path: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path, how: str
) -> None:
    """Rank 1 of two against 127.0.0.1 and a port where nothing listens, with a 5 s rendezvous timeout."""
    port = free_port()
    rc, console, seconds = LAUNCHES[how](
        tiny_teacher_dir, tiny_dataset_dir, tmp_path / "run", 1, "127.0.0.1", port, {TIMEOUT_ENV: "5"}
    )
    assert rc != 0, console[-3000:]
    waiting = re.findall(rf"rank 1: waiting for rank 0 at 127\.0\.0\.1:{port} for \d+ s \(no answer yet: ", console)
    assert len(waiting) == 1, console[-3000:]  # every 2.5 s (half the timeout) until it gives up at 5 s
    error = f"error: rank 1: rank 0 did not answer at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) within 5 s"
    assert error in console, console[-3000:]
    assert seconds < QUICK, f"took {seconds:.0f} s"


@pytest.mark.integration
def test_task_distill_ranks_check_and_wait_for_rank_zero_like_training(tmp_path: Path) -> None:
    """``task-distill`` and ``finetune`` join through ``runtime.ranks.init_ranks``, before they read a model or
    data (so none is needed here): the same check, the same logged wait, the same error."""
    port = free_port()
    args = ["task-distill", "teacher=unused", "student=unused", "data=unused", f"output_dir={tmp_path / 'run'}"]
    rc, console, seconds = start_rank_from_environment(args, 1, "127.0.0.1", port, {TIMEOUT_ENV: "3"})
    assert rc != 0, console[-3000:]
    assert re.search(rf"rank 1: waiting for rank 0 at 127\.0\.0\.1:{port} for \d+ s \(no answer yet: ", console)
    assert f"error: rank 1: rank 0 did not answer at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) within 3 s" in console
    assert seconds < QUICK, f"took {seconds:.0f} s"
