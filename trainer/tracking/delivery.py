"""Getting metrics to an MLflow run without ever blocking or crashing the process that logs them.

The training loop only appends to an in-memory queue (:meth:`Delivery.put`); one background
thread owns every call to MLflow. It first runs the run's setup steps (create or resume the run,
log its params and artifacts: :mod:`trainer.tracking.tracker` says which), then samples the
node's system metrics and sends the queued metrics in batches. When the server is unreachable it
warns once, keeps everything queued and retries with exponential backoff, so a run that starts
while the server is down is created late and the metrics logged during an outage arrive when the
server is back (with their original timestamps). MLflow's own HTTP client would retry each
request for minutes; the caller turns that off (:func:`trainer.tracking.config.limit_http_retries`)
and this thread retries instead.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from trainer.tracking.config import MlflowConfig

log = logging.getLogger(__name__)

BATCH = 1000  # MLflow's limit of metrics per log_batch request


class Delivery:
    """The queue of one run's metrics and the thread that sends them (and this node's system metrics).

    ``setup``: steps that each take the MLflow client, run once and in order before any metric is
    sent; a step is retried until it succeeds, or skipped when the server refuses it (4xx).
    ``run_id``: the run to send to, read once the setup is done (a setup step may create the run).
    """

    def __init__(
        self,
        cfg: MlflowConfig,
        tracking_uri: str,
        *,
        setup: list[Callable[[Any], None]],
        run_id: Callable[[], str | None],
    ) -> None:
        self.cfg = cfg
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.node = os.environ.get("MLFLOW_SYSTEM_METRICS_NODE_ID") or socket.gethostname()
        self.client: Any = None  # made in the background thread: opening a SQLite store can take seconds
        self.inbox: collections.deque = collections.deque()  # (key, value, time ms, step): the loop appends,
        # the thread pops (both atomic, no lock)
        self.pending: list[Any] = []  # mlflow Metric objects not yet sent, oldest first (thread only)
        self.system: list[tuple[int, int, dict[str, float]]] = []  # (sample index, time ms, values) (thread only)
        self.system_step = 0  # step of this node's first system sample in this process (known after setup)
        self.samples_taken = 0
        self.monitors = system_monitors() if cfg.system_metrics else []
        self.setup: list[Callable[[Any], None]] = [*setup, self.find_system_step]
        self.outage_since: float | None = None
        self.wakeup = threading.Event()
        self.first_attempt = threading.Event()
        self.finishing = threading.Event()
        self.deadline = float("inf")
        self.thread = threading.Thread(target=self.work, name="mlflow-tracker", daemon=True)
        self.thread.start()

    @property
    def set_up(self) -> bool:
        """Whether every setup step went through (or was refused and skipped)."""
        return not self.setup

    @property
    def closed(self) -> bool:
        return self.finishing.is_set()

    # ----------------------------------------------------------------------------------- the loop's side
    def put(self, metrics: dict[str, float], step: int) -> None:
        """Queue ``metrics`` at ``step``; returns at once, whatever the server's state."""
        now_ms = int(time.time() * 1000)
        for key, value in metrics.items():
            try:  # plain tuples: the loop never waits for an MLflow import
                self.inbox.append((key, float(value), now_ms, int(step)))
            except (TypeError, ValueError):
                log.debug("MLflow: metric %s=%r is not a number, not logged", key, value)
        self.wakeup.set()

    def close(self, timeout: float) -> None:
        """Stop the thread once what is queued is delivered, or after ``timeout`` seconds."""
        if self.closed:
            return
        self.deadline = time.monotonic() + timeout
        self.finishing.set()
        self.wakeup.set()
        self.thread.join(timeout + self.cfg.request_timeout_s)
        left = len(self.inbox) + len(self.pending) + len(self.system)
        if left or self.setup:
            what = f"{left} metric records" + (" and the run's setup" if self.setup else "")
            log.warning(
                "MLflow: %s could not be delivered to %s in %.0fs; metrics.jsonl in the output directory keeps the "
                "training metrics",
                what,
                self.tracking_uri,
                timeout,
            )

    # ------------------------------------------------------------------------------ the background thread
    def work(self) -> None:
        backoff = self.cfg.retry_initial_s
        next_sample = time.monotonic()
        while True:
            finishing = self.finishing.is_set()  # read before the sync: what close() queued is in it
            if self.monitors and (finishing or time.monotonic() >= next_sample):
                self.sample_system()
                next_sample = time.monotonic() + self.cfg.system_metrics_interval_s
            if finishing:
                self.monitors = []  # that was the last sample
            ok = self.try_sync()
            self.first_attempt.set()
            if finishing and (ok or time.monotonic() >= self.deadline):
                return
            if ok:
                backoff = self.cfg.retry_initial_s
                timeout = max(0.0, next_sample - time.monotonic()) if self.monitors else None
                self.wakeup.wait(timeout)
                self.wakeup.clear()
            elif not finishing:
                # New metrics just wait in the queue; close() cuts the wait short.
                if self.finishing.wait(backoff):
                    backoff = self.cfg.retry_initial_s
                else:
                    backoff = min(2 * backoff, self.cfg.retry_max_s)
            else:
                time.sleep(min(backoff, max(0.0, self.deadline - time.monotonic())))
                backoff = min(2 * backoff, self.cfg.retry_max_s)

    def try_sync(self) -> bool:
        """One attempt to bring the server up to date; True when nothing is left to send."""
        try:
            if self.client is None:
                from mlflow import MlflowClient

                self.client = MlflowClient(self.tracking_uri)
            while self.setup:
                step = self.setup[0]
                try:
                    step(self.client)
                except Exception as err:
                    if not permanent(err):
                        raise
                    log.warning("MLflow: %s failed and is skipped: %s", step.__name__, err)
                self.setup.pop(0)
            from mlflow.entities import Metric

            self.send_system()
            while self.inbox:
                self.pending.append(Metric(*self.inbox.popleft()))
            while self.pending:
                batch = self.pending[:BATCH]
                try:
                    self.client.log_batch(self.run_id(), metrics=batch)
                except Exception as err:
                    if not permanent(err):
                        raise
                    log.warning(
                        "MLflow: rejected %d metric values (dropped; metrics.jsonl keeps them): %s", len(batch), err
                    )
                del self.pending[: len(batch)]
        except Exception as err:
            if self.outage_since is None:
                self.outage_since = time.monotonic()
                log.warning(
                    "MLflow: tracking server %s unreachable (%s); training goes on, metrics are kept and "
                    "retried in the background",
                    self.tracking_uri,
                    short(err),
                )
            return False
        if self.outage_since is not None:
            log.warning(
                "MLflow: %s reachable again after %.0fs; buffered metrics delivered",
                self.tracking_uri,
                time.monotonic() - self.outage_since,
            )
            self.outage_since = None
        return True

    # ----------------------------------------------------------------------------------- system metrics
    def find_system_step(self, client: Any) -> None:
        """Continue this node's system-metric steps after those of an earlier (resumed) process."""
        prefix = f"system/{self.node}/"
        steps = [m.step for m in client.get_run(self.run_id()).data._metric_objs if m.key.startswith(prefix)]
        self.system_step = max(steps) + 1 if steps else 0

    def sample_system(self) -> None:
        values: dict[str, float] = {}
        for monitor in self.monitors:
            try:
                monitor.collect_metrics()
                values.update(monitor.aggregate_metrics())
            except Exception as err:  # a flaky sensor must not end the thread
                log.debug("MLflow: system metrics from %s failed: %s", type(monitor).__name__, err)
            finally:
                monitor.clear_metrics()
        self.system.append((self.samples_taken, int(time.time() * 1000), values))
        self.samples_taken += 1

    def send_system(self) -> None:
        """Turn system samples into metrics once their steps are known (after setup)."""
        from mlflow.entities import Metric

        for index, timestamp, values in self.system:
            step = self.system_step + index
            self.pending.extend(Metric(f"system/{self.node}/{k}", float(v), timestamp, step) for k, v in values.items())
        self.system.clear()


def system_monitors() -> list[Any]:
    """MLflow's CPU/memory, disk, network and (when NVML or ROCm is there) GPU monitors."""
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor
    from mlflow.system_metrics.metrics.rocm_monitor import ROCMMonitor

    monitors: list[Any] = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    for gpu in (GPUMonitor, ROCMMonitor):
        try:
            monitors.append(gpu())
            break
        except Exception:  # no NVIDIA/AMD GPU or library on this node
            continue
    return monitors


def permanent(err: Exception) -> bool:
    """A request the server understood and refused (4xx): retrying cannot help."""
    from mlflow.exceptions import MlflowException

    if not isinstance(err, MlflowException):
        return False
    status = err.get_http_status_code()
    return 400 <= status < 500 and status not in (408, 429)


def short(err: Exception) -> str:
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    return text[:300]
