"""What the pipeline prints: Beam's known-harmless lines silenced, this package's progress shown.

:func:`quiet_beam_logging` runs in the driver before Beam is first imported, since one of the
harmless lines is logged at import; :func:`show_progress_on_worker` runs once in each worker;
:func:`holding_beam_errors` holds Beam's error records back while the pipeline runs.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from common.cli import LOG_FORMAT

# Each message is harmless for this pipeline; a record is dropped only when it contains one of them.
HARMLESS_BEAM_MESSAGES = re.compile(
    "|".join(
        [
            # Beam's BigQuery client without google-apitools (a dependency of this project since the
            # line was also printed by every worker); kept for environments that lack it.
            r"apitools not found, and bigquery client libraries are not available",
            # A DirectRunner worker finds no staged main session; this pipeline stages none (its code is a package).
            r"No semi_persistent_directory found",
        ]
    )
)


class DropHarmless(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not HARMLESS_BEAM_MESSAGES.search(record.getMessage())


def quiet_beam_logging() -> None:
    """Filters on the two loggers those lines reach this process through, and Beam's INFO chatter
    (such as its notice, at import, that BigQuery storage reads are unavailable) off."""
    logging.getLogger().addFilter(DropHarmless())  # the apitools line is logged on the root logger
    # DirectRunner workers' log records, relayed by the job service as "Worker: ... message: ...".
    logging.getLogger("apache_beam.runners.portability.local_job_service").addFilter(DropHarmless())
    logging.getLogger("apache_beam").setLevel(logging.WARNING)


def show_progress_on_worker() -> None:
    """This package's log lines (per-file and per-split progress, counted skips) to the worker's stderr.

    A Beam worker hands its log records to the runner; the DirectRunner relays them as raw protobuf
    text under its own logger, which :func:`quiet_beam_logging` keeps at WARNING. So each worker
    prints this package's lines itself, in the driver's format, and does not also hand them on
    (which would print its warnings twice). On a cluster runner the worker's stderr is its log.
    Idempotent: a worker runs ``setup`` once per DoFn instance.
    """
    if not isinstance(sys.stderr, _FaultTracebacksDropped):
        sys.stderr = _FaultTracebacksDropped(sys.stderr)
    log = logging.getLogger("preprocessing")
    if not any(isinstance(h, _WorkerProgress) for h in log.handlers):
        handler = _WorkerProgress(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        log.addHandler(handler)
        if log.level == logging.NOTSET:  # runners that apply no sdk_harness_log_level_overrides
            log.setLevel(logging.INFO)
        log.propagate = False


class _WorkerProgress(logging.StreamHandler):
    """Marks the handler :func:`show_progress_on_worker` installed, so it is installed once."""


class _FaultTracebacksDropped:
    """A worker's stderr, less the traceback Beam's worker prints there (``print(traceback, file=sys.stderr)``,
    sdk_worker.py) when a work item failed on an I/O fault this package named (:mod:`preprocessing.faults`): the
    driver prints that fault in one line. Beam still logs the traceback (held back by :func:`holding_beam_errors`
    in the driver; a cluster runner's worker log keeps it); any other traceback passes."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.dropped = False

    def write(self, text: str) -> int:
        from preprocessing.faults import FAULT_TEXT  # imports Beam: not before quiet_beam_logging in the driver

        if text.startswith("Traceback (most recent call last)") and FAULT_TEXT.search(text):
            self.dropped = True
            return len(text)
        if self.dropped and text == "\n":  # print's line end after it
            self.dropped = False
            return len(text)
        self.dropped = False
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, ...: the stream's own
        return getattr(self.stream, name)


class _Hold(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("apache_beam") and record.levelno >= logging.ERROR:
            self.held.append(record)
            return False
        return True


@contextmanager
def holding_beam_errors() -> Iterator[None]:
    """Within the block (the pipeline's run), Beam's ERROR records are held back from the terminal: a failed work
    item's traceback, which the worker logs and the DirectRunner relays (some 60 lines each, twice), then the
    runner raises. A run that fails says why in one line instead (``pipeline.run``); one that succeeds prints
    what was held (a work item that failed and was retried) when the block ends."""
    hold = _Hold()
    handlers = logging.getLogger().handlers
    for handler in handlers:
        handler.addFilter(hold)
    try:
        yield
    except BaseException:
        hold.held.clear()
        raise
    finally:
        for handler in handlers:
            handler.removeFilter(hold)
        for record in hold.held:
            logging.getLogger(record.name).handle(record)
