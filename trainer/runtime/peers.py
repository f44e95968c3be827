"""A watch on the other ranks, so that a node that dies or freezes stops the whole run within a bound.

A collective knows nothing of its peers' health: when a node vanishes without closing its connections (power
lost, kernel hung, network cut) the ranks left wait inside the collective until the process group's timeout
(gloo: DEEPSPEED_TIMEOUT, 10 minutes; NCCL: its watchdog), then fail with a transport error that names no
rank. Raising that timeout's bound is not the fix: a rank also waits legitimately for minutes (rank 0
converting a checkpoint to its universal form, exporting, registering).

So every rank runs :class:`PeerWatch`, a daemon thread that, every ``interval_s``, bumps its own heartbeat
counter in the rendezvous store (torch's TCPStore, served by rank 0) and reads every other rank's. Counters,
not clocks: each rank times how long a peer's counter has not moved on its own monotonic clock, so nodes
need no synchronised time. A rank busy in a long computation still beats (the thread runs while the main
thread computes or waits); a dead or frozen process does not. When a peer's counter has not moved for
``timeout_s`` (``deepspeed.peer_timeout_s``), or the store itself (rank 0's process) has not answered for that
long, the watch logs one line naming the rank and its node and ends the process with :data:`EXIT_PEER_LOST`;
the launcher then stops the rest of its node. Every node stops within about ``timeout_s + interval_s`` of the
loss, and a relaunch of every node resumes from the last complete checkpoint (``runtime.checkpoint``).

The watch talks to the store over its own client connection with a short timeout, so a frozen rank 0 (whose
store no longer answers) cannot block it.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

EXIT_PEER_LOST = 75  # EX_TEMPFAIL: relaunching is the cure
KEY = "encoder-distill/heartbeat/{rank}"
TRANSPORT_WORDS = ("gloo", "NCCL", "Connection closed", "Connection reset", "Broken pipe")  # a collective's failure
DONE = "done"


class PeerWatch:
    """Heartbeats through the store at ``host:port``; see the module docstring. ``local_size``: the ranks per
    node (the launcher numbers ranks node by node), to name a lost rank's node."""

    def __init__(
        self, rank: int, world_size: int, local_size: int, host: str, port: int, timeout_s: float, interval_s: float
    ) -> None:
        self.rank, self.world_size, self.local_size = rank, world_size, local_size
        self.host, self.port = host, port
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.stopped = threading.Event()
        self.answered = time.monotonic()  # when the store last answered a whole round
        self.seen: dict[int, tuple[str | None, float]] = {  # each peer's counter, and when it last moved
            r: (None, self.answered) for r in range(world_size) if r != rank
        }
        self.judge = threading.Thread(target=self.run, name="peer-watch", daemon=True)
        self.io = threading.Thread(target=self.exchange, name="peer-watch-io", daemon=True)

    @classmethod
    def for_this_rank(cls, timeout_s: float) -> PeerWatch | None:
        """The watch for this process's rank, from the launcher's variables; None in a world of one."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return None
        return cls(
            rank=int(os.environ["RANK"]),
            world_size=world_size,
            local_size=int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", world_size))),
            host=os.environ["MASTER_ADDR"],
            port=int(os.environ["MASTER_PORT"]),
            timeout_s=timeout_s,
            interval_s=min(5.0, timeout_s / 6),
        )

    def start(self) -> PeerWatch:
        self.answered = time.monotonic()
        self.seen = {peer: (None, self.answered) for peer in self.seen}
        self.io.start()
        self.judge.start()
        self.explain_collective_failures()
        return self

    def explain_collective_failures(self) -> None:
        """A peer killed outright (its connections closed) fails the collective at once, with the transport's
        error naming an address, not a rank: an uncaught collective error then waits a couple of heartbeats to
        see whose counter stopped, and says so in the one line of :meth:`lost` instead of a traceback."""
        previous = sys.excepthook

        def hook(kind: type[BaseException], err: BaseException, tb: Any) -> None:
            if isinstance(err, RuntimeError) and any(word in str(err) for word in TRANSPORT_WORDS):
                log.warning("rank %d: a collective failed; listening for the rank that stopped answering", self.rank)
                silent = self.silent_peers()
                if silent:
                    names = ", ".join(self.where(peer) for peer in silent)
                    first = str(err).splitlines()[0][:200]
                    self.lost(f"{names} stopped answering: a collective failed ({type(err).__name__}: {first})")
            previous(kind, err, tb)

        sys.excepthook = hook

    def silent_peers(self) -> list[int]:
        """The peers not heard from over the next two heartbeats (rank 0 if the store stopped answering): a live
        peer's counter moves every interval, a dead one's last beat is at least an interval plus a second old
        by the end of the wait, even when that beat was only read during it."""
        answered = self.answered
        time.sleep(2 * self.interval_s + 2)
        now = time.monotonic()
        silent = [
            p for p, (counter, moved) in self.seen.items() if counter != DONE and now - moved > self.interval_s + 1
        ]
        if self.answered == answered and self.rank != 0:  # no round completed at all: the store (rank 0) is gone
            return [0]
        return silent

    def stop(self) -> None:
        """This rank is done: its last beat says so (``done``), so that ranks still at work (rank 0 exporting
        and registering) do not take its silence for a loss."""
        self.stopped.set()
        self.judge.join(timeout=2 * self.interval_s)
        self.io.join(timeout=2 * self.interval_s)

    def where(self, rank: int) -> str:
        return f"rank {rank} (node {rank // self.local_size})"

    def lost(self, what: str) -> None:
        """One line, then the process ends: the launcher takes the node's other ranks down with it."""
        log.error(
            "rank %d: %s; stopping this rank (deepspeed.peer_timeout_s=%g). Relaunch every node with the same "
            "command to resume from the last complete checkpoint.",
            self.rank,
            what,
            self.timeout_s,
        )
        logging.shutdown()
        os._exit(EXIT_PEER_LOST)

    def run(self) -> None:
        """The judge: every interval, from what the exchange thread last saw, is a peer (or the store) silent for
        longer than the timeout? Kept apart from the store I/O because a store whose process froze can block a
        client call forever, whatever its timeout says."""
        while not self.stopped.wait(self.interval_s):
            now = time.monotonic()
            if now - self.answered > self.timeout_s:
                self.lost(
                    f"the rendezvous store at {self.host}:{self.port} ({self.where(0)}'s process) has not answered "
                    f"for {now - self.answered:.0f} s: rank 0's node died or froze"
                )
            for peer, (counter, moved) in list(self.seen.items()):
                if counter != DONE and now - moved > self.timeout_s:
                    self.lost(f"{self.where(peer)} has not answered for {now - moved:.0f} s: its node died or froze")

    def exchange(self) -> None:
        """The store I/O: bump this rank's counter, read the others'; at the end, say ``done``."""
        timeout = datetime.timedelta(seconds=max(1.0, self.interval_s))
        store = None
        beats = 0
        while not self.stopped.wait(self.interval_s):
            try:
                if store is None:
                    store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout)
                beats += 1
                store.set(KEY.format(rank=self.rank), str(beats))
                now = time.monotonic()
                for peer, (counter, _) in list(self.seen.items()):
                    key = KEY.format(rank=peer)
                    value = store.get(key).decode() if store.check([key]) else None
                    if value != counter:
                        self.seen[peer] = (value, now)
                self.answered = time.monotonic()
            except Exception:  # any store failure: the judge times the silence
                store = None  # reconnect next time
        if store is not None:
            with contextlib.suppress(Exception):
                store.set(KEY.format(rank=self.rank), DONE)
