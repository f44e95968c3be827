"""Meeting rank 0 at MASTER_ADDR:MASTER_PORT without hanging silently on a wrong address.

torch.distributed's rendezvous retries in silence until the process-group timeout (DeepSpeed's
``DEEPSPEED_TIMEOUT``, 10 minutes by default; torch's own 30): a MASTER_ADDR that does not resolve,
or a host where nothing listens on MASTER_PORT, keeps every rank of a cluster allocation waiting
that long and then ends in a stack trace. Before a launch that was given its address (several
nodes, an explicit ``--master_port``, Slurm) hands over to torch, every rank checks that
MASTER_ADDR resolves (:func:`check_master_addr`: a :class:`ConfigError` at once if it does not),
and every rank but 0 waits until something accepts a TCP connection there
(:func:`wait_for_rank_zero`): a plain connect, retried, logged while it waits, given up after the
rendezvous timeout (:func:`rendezvous_timeout`). Rank 0 binds the store itself and needs no probe.
The join proper stays torch's; the probe only tells a rank that rank 0 is there before it does.

The rendezvous timeout is an environment variable, not a config key, because it belongs to the
launch (how far apart a cluster starts its nodes), not to the recipe: the same YAML runs on one
machine and on sixty-four, and ``train``, ``task-distill`` and ``finetune`` (three config classes)
all rendezvous the same way. It is read before the join, beside MASTER_ADDR and MASTER_PORT.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator

from deepspeed.constants import default_pg_timeout

from common.config import ConfigError

log = logging.getLogger(__name__)

TIMEOUT_ENV = "ENCODER_DISTILL_RENDEZVOUS_TIMEOUT"
# Ranks that a scheduler, pdsh or a person starts on several nodes can legitimately come up minutes apart.
# By default a rank waits as long as DeepSpeed's join itself would (DEEPSPEED_TIMEOUT, 10 minutes unless
# set; torchrun's c10d rendezvous also waits 600 s for its nodes): no training launch that used to meet
# gives up sooner, it only says what it waits for, and says it clearly when it gives up.
DEFAULT_TIMEOUT_S = default_pg_timeout.total_seconds()
LOG_EVERY_S = 30.0
CONNECT_ATTEMPT_S = 5.0  # one connect; a host that drops packets answers nothing, not "refused"
RETRY_PAUSE_S = 1.0
WHERE_RANK_ZERO_IS = (
    "give its name or IP, as every node reaches it, with `deepspeed --master_addr HOST` (with ssh and no "
    "--master_addr the launcher asks the hostfile's first host); under Slurm, launch/slurm.sbatch sets it "
    "to the allocation's first node"
)


def rendezvous_timeout() -> float:
    """Seconds a rank other than 0 waits for rank 0 to answer: ``$ENCODER_DISTILL_RENDEZVOUS_TIMEOUT``, else
    DeepSpeed's process-group timeout (``DEEPSPEED_TIMEOUT`` minutes, 10 unless set).

    A value that is not a positive number of seconds is a :class:`ConfigError` naming the variable.
    """
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(
            f"{TIMEOUT_ENV}={text!r}: must be a positive number of seconds (default {DEFAULT_TIMEOUT_S:g})"
        )
    return seconds


def log_interval(timeout_s: float) -> float:
    """How often a wait of at most ``timeout_s`` logs: every 30 s, or twice over a shorter timeout, so
    that a wait always says what it waits for before it gives up."""
    return min(LOG_EVERY_S, timeout_s / 2)


def master_address() -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT from the environment the launcher set; a :class:`ConfigError` if
    either is missing or the port is not a port number."""
    addr = os.environ.get("MASTER_ADDR", "").strip()
    if not addr:
        raise ConfigError(f"MASTER_ADDR is not set: it must name rank 0's node; {WHERE_RANK_ZERO_IS}")
    text = os.environ.get("MASTER_PORT", "").strip()
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(
            f"MASTER_PORT={text!r} is not a port number: give one every node can open, "
            "e.g. `deepspeed --master_port 29611`"
        )
    return addr, int(text)


def check_master_addr(addr: str, port: int) -> None:
    """Fail at once, with one line saying how to fix it, if ``addr`` (MASTER_ADDR) does not resolve.

    torch would retry the lookup in silence until the process-group timeout. A temporary DNS failure
    (EAI_AGAIN) passes: the waits after this one retry it.
    """
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        if err.errno == socket.EAI_AGAIN:
            return
        raise ConfigError(
            f"MASTER_ADDR={addr} does not resolve to an address ({err.strerror}): it must name rank 0's node; "
            f"{WHERE_RANK_ZERO_IS}"
        ) from None


def wait_for_rank_zero(addr: str, port: int, rank: int, timeout_s: float) -> float:
    """Return once something accepts a TCP connection at ``addr:port``; the seconds that took.

    Connects and closes again, once a second, logging ``rank N: waiting for rank 0 at ADDR:PORT for
    S s (no answer yet: REASON; ...)`` every :func:`log_interval`; after ``timeout_s`` a
    :class:`ConfigError` says what was tried and what to check. The connection is a bare TCP
    connect, which torch's store accepts and forgets: the join that follows is torch's own.
    """
    start = time.monotonic()
    next_log = start + log_interval(timeout_s)
    while True:
        now = time.monotonic()
        left = start + timeout_s - now
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(CONNECT_ATTEMPT_S, left))):
                return time.monotonic() - start
        except OSError as err:  # refused, unreachable, timed out, a name that does not resolve (yet)
            reason = err.strerror or str(err) or type(err).__name__
        now = time.monotonic()
        waited = now - start
        if waited >= timeout_s:
            raise ConfigError(
                f"rank {rank}: rank 0 did not answer at {addr}:{port} (MASTER_ADDR:MASTER_PORT) within "
                f"{timeout_s:g} s ({reason}): check that rank 0's node was started, that MASTER_ADDR names it "
                "and every node was given the same MASTER_PORT (`deepspeed --master_addr HOST --master_port PORT`; "
                "under Slurm the allocation's first node and the job's port), and that no firewall blocks the port; "
                f"{TIMEOUT_ENV}=SECONDS waits longer for nodes that start later"
            ) from None
        if now >= next_log:
            log.warning(
                "rank %d: waiting for rank 0 at %s:%d for %.0f s (no answer yet: %s; giving up after %.0f s, %s)",
                rank,
                addr,
                port,
                waited,
                reason,
                timeout_s,
                TIMEOUT_ENV,
            )
            next_log += log_interval(timeout_s)
        time.sleep(max(0.0, min(RETRY_PAUSE_S, start + timeout_s - now)))


def reach_rank_zero(rank: int) -> tuple[str, int]:
    """Before joining the group at MASTER_ADDR:MASTER_PORT: every rank checks the address resolves, every
    rank but 0 waits (logging) until rank 0 answers there, at most :func:`rendezvous_timeout`.

    Returns the address and port. Raises :class:`ConfigError` with one line for the user.
    """
    addr, port = master_address()
    timeout_s = rendezvous_timeout()  # read on every rank, so that a bad value fails on all of them alike
    check_master_addr(addr, port)
    if rank != 0:
        waited = wait_for_rank_zero(addr, port, rank, timeout_s)
        if waited >= log_interval(timeout_s):
            log.info("rank %d: rank 0 answered at %s:%d after %.0f s", rank, addr, port, waited)
    return addr, port


@contextlib.contextmanager
def joining_at_rank_zero(rank: int, world_size: int) -> Iterator[None]:
    """Around a launch's join (``init_process_group``, given its address): :func:`reach_rank_zero` first, then
    the join logs every 30 s while ranks are missing."""
    addr, port = reach_rank_zero(rank)  # a wrong address fails in one line instead of hanging
    with logged_while_waiting(f"rank {rank}: waiting for all {world_size} ranks to join at {addr}:{port}"):
        yield


@contextlib.contextmanager
def logged_while_waiting(what: str, every_s: float = LOG_EVERY_S, level: int = logging.WARNING) -> Iterator[None]:
    """Log ``WHAT for N s`` every ``every_s`` seconds while the body runs (a blocking call that says
    nothing while it waits: a join, a barrier); nothing if it returns sooner.

    A daemon thread does the logging, so the body is torch's own call, untouched, with its own timeout.
    """
    done = threading.Event()
    start = time.monotonic()

    def report() -> None:
        while not done.wait(every_s):
            log.log(level, "%s for %.0f s", what, time.monotonic() - start)

    reporter = threading.Thread(target=report, name="waiting-log", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()
