"""Progress a multi-GB job reports while it runs: per file on the workers, per stage on the driver.

Beam's metrics reach the driver only when a runner says so (the local runner: at the end of the
run), so the workers leave *markers* instead: one-byte files under ``OUTPUT/.work/progress/STAGE/``
whose names carry the counts (``read/<file id>-<bytes on disk read>-<documents>``,
``tokenize/<bucket>-<documents>-<tokens>``, ``plan/<split>-<shards>``,
``write/<split>-<shard>-<sequences>``). The driver lists them every ``progress_seconds``
(:class:`StageWatch`) and prints one line per stage that moved, with a rate and an ETA against the
input's size. Listing needs no reads and works on every filesystem the run can write to (local,
NFS, gs://, s3://), whichever runner and however many workers. The markers go with the work
directory when the manifest is published.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from apache_beam.io.filesystems import FileSystems

from preprocessing.faults import BLOCK
from preprocessing.manifest import WORK_DIR
from preprocessing.shards import write_file

log = logging.getLogger("preprocessing")
STAGES = ("read", "tokenize", "plan", "write")


class Markers:
    """The progress markers of one run's output directory."""

    def __init__(self, output: str):
        self.root = FileSystems.join(output, WORK_DIR, "progress")

    def mark(self, stage: str, *fields: object) -> None:
        """Leave ``STAGE/f1-f2-...``; a marker is a name, so writing it is one small create. It holds one byte:
        an object store's multipart upload of nothing is refused (S3: MalformedXML)."""
        path = FileSystems.join(self.root, stage, "-".join(str(f) for f in fields))
        write_file(path, [b"\n"], BLOCK)  # a full disk says a block: what the file takes

    def read(self, stage: str) -> list[list[str]]:
        """Every marker of a stage as its fields (nothing when the directory is not there yet, or gone)."""
        try:
            found = FileSystems.match([FileSystems.join(self.root, stage, "*")])[0].metadata_list
        except Exception:  # a missing directory is 'no progress yet' (some filesystems raise)
            return []
        return [m.path.rstrip("/").rsplit("/", 1)[-1].split("-") for m in found]


def file_id(path: str) -> str:
    """A short stable name for an input file in marker names (paths hold '/' and '-')."""
    return hashlib.sha1(path.encode("utf-8")).hexdigest()[:16]


class FileProgress:
    """While one file is read, every ``interval`` seconds: a log line on the worker saying how far into
    the file (on disk) the reader is, and a read marker the driver adds up (:class:`StageWatch`), so a
    multi-GB file shows its progress long before its summary line."""

    def __init__(self, path: str, on_disk: int, counts: Counter, interval: float, markers: Markers | None = None):
        self.path, self.on_disk, self.counts, self.interval, self.markers = path, on_disk, counts, interval, markers
        self.started = self.last = time.monotonic()

    def __call__(self, position: int) -> None:
        now = time.monotonic()
        if now - self.last < self.interval:
            return
        self.last = now
        if self.markers is not None:
            self.markers.mark("read", file_id(self.path), position, self.counts["documents.read"])
        log.info(
            "reading %s: %.0f%% of its %.1f MB on disk, %d documents so far (%.1f MB/s of text)",
            self.path,
            100 * position / max(self.on_disk, 1),
            self.on_disk / 1e6,
            self.counts["documents.read"],
            self.counts["input_bytes"] / 1e6 / max(now - self.started, 1e-9),
        )

    def done(self) -> None:
        """The file is read to its end."""
        if self.markers is not None:
            self.markers.mark("read", file_id(self.path), self.on_disk, self.counts["documents.read"])


@dataclass
class StageState:
    """What the driver last saw of one stage."""

    seen: frozenset[tuple[str, ...]] = frozenset()
    started: float | None = None


def duration(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m" if whole >= 3600 else f"{whole // 60}m{whole % 60:02d}s"


def rate_and_eta(done: float, total: float, seconds: float, unit: str) -> str:
    """``3.1 MB/s, ETA 4m10s`` from the work done of a total since the stage began."""
    if seconds <= 0 or done <= 0:
        return "ETA unknown"
    rate = done / seconds
    eta = f"ETA {duration((total - done) / rate)}" if total > done else "done"
    return f"{rate:,.1f} {unit}/s, {eta}"


class StageWatch:
    """The driver's progress lines: every ``interval`` seconds, one line for each stage whose markers
    changed since the last look, or, when none did, for the stage in progress (so a long stage still
    shows that the job lives).

    The figures are against the input: reading counts bytes on disk of ``input_bytes``; tokenizing
    counts hash buckets, each an equal share of the input (``plan.num_buckets`` of them, an upper
    bound when a small corpus leaves some empty); writing counts shards of those planned.
    """

    def __init__(
        self,
        output: str,
        files: int,
        input_bytes: int,
        buckets: int,
        interval: float,
        emit: Callable[[str], None] | None = None,
    ):
        self.markers = Markers(output)
        self.files, self.input_bytes, self.buckets, self.interval = files, input_bytes, buckets, interval
        self.emit = emit or (lambda line: log.info("%s", line))
        self.states = {stage: StageState() for stage in STAGES}
        self.started = time.monotonic()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="preprocessing-progress", daemon=True)

    def __enter__(self) -> StageWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join()

    def _loop(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                for line in self.lines():
                    self.emit(line)
            except Exception as err:  # progress must never stop the job it reports on
                log.debug("progress: could not list the markers: %s", err)

    def lines(self) -> list[str]:
        now = time.monotonic()
        moved = []
        for stage in STAGES:
            # What was seen stays seen: the markers go with the work directory at the very end.
            state = self.states[stage]
            seen = state.seen | {tuple(fields) for fields in self.markers.read(stage)}
            if seen != state.seen:
                state.seen = seen
                state.started = state.started or now  # a stage's clock starts at its first marker
                moved.append("write" if stage == "plan" else stage)
        writing = self.states["plan"].started or self.states["write"].started
        current = "write" if writing else "tokenize" if self.states["tokenize"].started else "read"
        render = {"read": self._reading, "tokenize": self._tokenizing, "write": self._writing}
        return [render[stage](now) for stage in dict.fromkeys(moved or [current])]

    def _reading(self, now: float) -> str:
        position: dict[str, int] = {}
        documents: dict[str, int] = {}
        for file, at, docs in self.states["read"].seen:
            position[file] = max(position.get(file, 0), int(at))
            documents[file] = max(documents.get(file, 0), int(docs))
        read_bytes = sum(position.values())
        seconds = now - self.started  # reading begins with the run
        rate = rate_and_eta(read_bytes / 1e6, self.input_bytes / 1e6, seconds, "MB")
        return (
            f"progress: read {read_bytes / 1e6:,.1f} of {self.input_bytes / 1e6:,.1f} MB on disk "
            f"({100 * read_bytes / max(self.input_bytes, 1):.0f}%), {len(position)} of {self.files} files begun, "
            f"{sum(documents.values()):,} documents; {rate}"
        )

    def _tokenizing(self, now: float) -> str:
        markers = self.states["tokenize"].seen
        buckets = {bucket for bucket, _, _ in markers}
        documents = sum(int(d) for _, d, _ in markers)
        tokens = sum(int(t) for _, _, t in markers)
        share = len(buckets) / max(self.buckets, 1)
        seconds = now - (self.states["tokenize"].started or now)
        megabytes = share * self.input_bytes / 1e6
        return (
            f"progress: tokenized {len(buckets)} of {self.buckets} hash buckets ({100 * share:.0f}% of the input), "
            f"{documents:,} documents, {tokens:,} tokens; "
            f"{rate_and_eta(megabytes, self.input_bytes / 1e6, seconds, 'MB of input')}"
        )

    def _writing(self, now: float) -> str:
        planned = sum(int(shards) for _, shards in self.states["plan"].seen)
        written = {(split, index): int(n) for split, index, n in self.states["write"].seen}
        sequences = sum(written.values())
        seconds = now - (self.states["plan"].started or self.states["write"].started or now)
        return (
            f"progress: wrote {len(written)} of {planned} shards ({100 * len(written) / max(planned, 1):.0f}%), "
            f"{sequences:,} sequences packed; {rate_and_eta(len(written), planned, seconds, 'shards')}"
        )
