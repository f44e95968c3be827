"""Beam's known-harmless log lines, silenced where they are logged; every other Beam line still shows.

:func:`quiet_beam_logging` runs before Beam is first imported, since one of them is logged at import.
"""

from __future__ import annotations

import logging
import re

# Each message is harmless for this pipeline; a record is dropped only when it contains one of them.
HARMLESS_BEAM_MESSAGES = re.compile(
    "|".join(
        [
            # Beam's BigQuery client, imported with Beam, lacks google-apitools; this pipeline reads no BigQuery.
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
