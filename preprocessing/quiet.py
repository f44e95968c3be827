"""What the pipeline prints: Beam's known-harmless lines silenced, this package's progress shown.

:func:`quiet_beam_logging` runs in the driver before Beam is first imported, since one of the
harmless lines is logged at import; :func:`show_progress_on_worker` runs once in each worker.
"""

from __future__ import annotations

import logging
import re
import sys

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
