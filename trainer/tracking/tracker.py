"""MLflow run tracking that can never crash or stall a training job.

The training loop only ever appends to an in-memory queue (:meth:`Tracker.log_metrics`); one
background thread owns every call to MLflow. It creates (or resumes) the run, logs the params,
tags and artifacts, samples the node's system metrics, and sends the queued metrics in batches.
When the server is unreachable it warns once, keeps everything queued and retries with
exponential backoff, so a run that starts while the server is down is created late and the
metrics logged during an outage arrive when the server is back (with their original
timestamps). MLflow's own HTTP client would retry each request for minutes; the tracker turns
that off and retries itself. ``metrics.jsonl`` (written by the loop) stays the local record.

Only global rank 0 records the run. With more than one node, local rank 0 of every other node
adds its system metrics (``system/<node>/...``) to the same run, whose id rank 0 broadcasts.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.config import flatten, to_dict
from trainer.config import MlflowConfig, TrainConfig

log = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
REPO = Path(__file__).resolve().parents[2]
BATCH = 1000  # MLflow's limit of metrics per log_batch request
PARAM_BATCH = 100  # ... and of params


def resolve_tracking_uri(cfg: MlflowConfig) -> str:
    """``mlflow.tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else the embedded SQLite store."""
    return cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def limit_http_retries(cfg: MlflowConfig) -> None:
    """Make one MLflow HTTP request fail fast (unless the user chose otherwise): we retry ourselves."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(cfg.request_timeout_s))


@dataclass
class RunSpec:
    """What a run records once, when it is created or resumed."""

    experiment: str
    run_name: str | None = None
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    files: list[tuple[str, Path]] = field(default_factory=list)  # (artifact directory in the run, local file)
    texts: dict[str, str] = field(default_factory=dict)  # artifact path in the run -> content


class Tracker:
    """One MLflow run, fed from the training loop without ever blocking it.

    ``spec`` given: this process records the run (creating it, or resuming ``run_id``).
    ``spec`` None: a follower that only adds this node's system metrics to the existing ``run_id``.
    """

    def __init__(
        self, cfg: MlflowConfig, *, spec: RunSpec | None, run_id: str | None = None, task: str = "fill-mask"
    ) -> None:
        self.cfg = cfg
        self.spec = spec
        self.run_id = run_id
        self.task = task  # the pipeline task the registered model serves
        self.tracking_uri = resolve_tracking_uri(cfg)
        self.node = os.environ.get("MLFLOW_SYSTEM_METRICS_NODE_ID") or socket.gethostname()
        self.last_step = 0
        self.active = cfg.tracks and (spec is not None or run_id is not None)
        if not self.active:
            return
        limit_http_retries(cfg)
        self.client: Any = None  # made in the background thread: opening a SQLite store can take seconds
        self.inbox: collections.deque = collections.deque()  # (key, value, time ms, step): the loop appends,
        # the thread pops (both atomic, no lock)
        self.pending: list[Any] = []  # mlflow Metric objects not yet sent, oldest first (thread only)
        self.system: list[tuple[int, int, dict[str, float]]] = []  # (sample index, time ms, values) (thread only)
        self.system_step = 0  # step of this node's first system sample in this process (known after setup)
        self.samples_taken = 0
        self.monitors = system_monitors() if cfg.system_metrics else []
        self.setup: list[Callable[[], None]] = self.setup_steps()
        self.outage_since: float | None = None
        self.wakeup = threading.Event()
        self.first_attempt = threading.Event()
        self.finishing = threading.Event()
        self.deadline = float("inf")
        self.thread = threading.Thread(target=self.work, name="mlflow-tracker", daemon=True)
        self.thread.start()
        atexit.register(self.close_at_exit)

    @classmethod
    def start(
        cls,
        cfg: TrainConfig,
        *,
        rank: int,
        world_size: int,
        resume_run_id: str | None,
        config_path: str | None = None,
        deepspeed_config: dict[str, Any] | None = None,
    ) -> Tracker:
        """The tracker for a training process. Collective when torch.distributed is initialised:
        every rank calls it (rank 0 shares the run id so other nodes can add system metrics).

        ``resume_run_id`` (from the checkpoint) continues that run; ``config_path`` and the
        effective ``deepspeed_config`` are logged as artifacts."""
        mlflow_cfg = cfg.mlflow
        tracker = cls(mlflow_cfg, spec=None)  # inert until this rank has something to record
        if not mlflow_cfg.tracks:
            return tracker
        if rank == 0:
            spec = training_run_spec(cfg, config_path, deepspeed_config or {}, world_size)
            tracker = cls(mlflow_cfg, spec=spec, run_id=resume_run_id)
            # Wait (bounded) for the run to exist, so that its id reaches the first checkpoint.
            if not tracker.first_attempt.wait(mlflow_cfg.start_timeout_s):
                log.warning(
                    "MLflow: no answer from %s yet; training starts, tracking goes on in the background",
                    tracker.tracking_uri,
                )
        run_id = broadcast_from_rank0(tracker.run_id, world_size)
        if rank != 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0 and mlflow_cfg.system_metrics and run_id:
            tracker = cls(mlflow_cfg, spec=None, run_id=run_id)
        return tracker

    # ----------------------------------------------------------------------------------- the loop's side
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queue ``metrics`` at ``step``; returns at once, whatever the server's state."""
        if not self.active or self.spec is None:
            return
        now_ms = int(time.time() * 1000)
        self.last_step = max(self.last_step, step)
        for key, value in metrics.items():
            try:  # plain tuples: the loop never waits for an MLflow import
                self.inbox.append((key, float(value), now_ms, int(step)))
            except (TypeError, ValueError):
                log.debug("MLflow: metric %s=%r is not a number, not logged", key, value)
        self.wakeup.set()

    def finish(self, student_dir: Path | None, final_metrics: dict[str, float], *, status: str = "FINISHED") -> None:
        """Deliver what is queued (waiting at most ``finish_timeout_s``), close the run and, when
        ``mlflow.register_as`` is set, register ``student_dir`` as a new version of that model."""
        self.close(self.cfg.finish_timeout_s, final_metrics)
        if student_dir is not None and self.spec is not None and self.cfg.register_as and status == "FINISHED":
            self.register(Path(student_dir))
        self.terminate(status)

    def close_at_exit(self) -> None:
        """The process is exiting without finish() (training raised): deliver briefly, mark the run FAILED."""
        if self.active and not self.finishing.is_set():
            self.close(min(self.cfg.finish_timeout_s, 10.0), {})
            self.terminate("FAILED")

    def close(self, timeout: float, final_metrics: dict[str, float]) -> None:
        """Stop the background thread once what is queued is delivered, or after ``timeout`` seconds."""
        if not self.active or self.finishing.is_set():
            return
        if final_metrics:
            self.log_metrics(final_metrics, self.last_step)
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

    def terminate(self, status: str) -> None:
        if self.spec is None or self.run_id is None or self.setup:
            return
        try:
            self.client.set_terminated(self.run_id, status)
        except Exception as err:
            log.warning("MLflow: could not mark run %s %s: %s", self.run_id, status, err)

    def register(self, student_dir: Path) -> None:
        """Register the exported student (retrying); on failure, say how to do it later."""
        from trainer.tracking.registry import register_command, register_student

        try:
            if self.run_id is None or self.setup:
                raise RuntimeError(f"the MLflow run was never created at {self.tracking_uri}")
            register_student(
                student_dir,
                name=self.cfg.register_as,
                alias=self.cfg.alias,
                run_id=self.run_id,
                tracking_uri=self.tracking_uri,
                task=self.task,
                attempts=self.cfg.register_attempts,
                backoff_s=self.cfg.retry_initial_s,
            )
        except Exception as err:
            command = register_command(
                student_dir,
                name=self.cfg.register_as,
                alias=self.cfg.alias,
                run_id=self.run_id,
                tracking_uri=self.tracking_uri,
                task=self.task,
            )
            log.error("MLflow: registering the student failed: %s", err)
            print(f"The model stays in {student_dir}. Register it later with:\n  {command}", file=sys.stderr)

    # ------------------------------------------------------------------------------ the background thread
    def work(self) -> None:
        backoff = self.cfg.retry_initial_s
        next_sample = time.monotonic()
        while True:
            finishing = self.finishing.is_set()  # read before the sync: what finish() queued is in it
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
                # New metrics just wait in the queue; finish() cuts the wait short.
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
                    step()
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
                    self.client.log_batch(self.run_id, metrics=batch)
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

    # ---------------------------------------------------------------------------------------- run setup
    def setup_steps(self) -> list[Callable[[], None]]:
        if self.spec is None:
            return [self.find_system_step]
        return [self.open_run, self.log_params, self.log_artifacts, self.find_system_step]

    def open_run(self) -> None:
        """Resume ``run_id`` if given (and known to this server), else create the run."""
        from mlflow.entities import RunTag
        from mlflow.exceptions import MlflowException

        spec = self.spec
        if self.run_id is not None:
            try:
                self.client.get_run(self.run_id)
            except MlflowException as err:
                if not permanent(err):
                    raise
                log.warning(
                    "MLflow: run %s to resume is unknown at %s; starting a new run", self.run_id, self.tracking_uri
                )
                self.run_id = None
            else:
                self.client.update_run(self.run_id, status="RUNNING")
                self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in spec.tags.items()])
                return
        experiment = self.client.get_experiment_by_name(spec.experiment)
        if experiment is None:
            location = local_artifact_location(self.tracking_uri, spec.experiment)
            experiment_id = self.client.create_experiment(spec.experiment, artifact_location=location)
        else:
            experiment_id = experiment.experiment_id
        run = self.client.create_run(experiment_id, run_name=spec.run_name, tags=spec.tags)
        self.run_id = run.info.run_id
        log.info("MLflow: run %s in experiment %r at %s", self.run_id, spec.experiment, self.tracking_uri)

    def log_params(self) -> None:
        """Log the params; on resume only the new ones (MLflow refuses to change a param)."""
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in self.spec.params.items() if k in existing and existing[k] != v)
        if changed:
            log.warning("MLflow: resumed run %s keeps its original values of %s", self.run_id, ", ".join(changed))
        params = [Param(k, v) for k, v in self.spec.params.items() if k not in existing]
        for i in range(0, len(params), PARAM_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + PARAM_BATCH])

    def log_artifacts(self) -> None:
        for directory, path in self.spec.files:
            self.client.log_artifact(self.run_id, str(path), artifact_path=directory)
        for artifact, text in self.spec.texts.items():
            self.client.log_text(self.run_id, text, artifact)

    # ----------------------------------------------------------------------------------- system metrics
    def find_system_step(self) -> None:
        """Continue this node's system-metric steps after those of an earlier (resumed) process."""
        prefix = f"system/{self.node}/"
        steps = [m.step for m in self.client.get_run(self.run_id).data._metric_objs if m.key.startswith(prefix)]
        self.system_step = max(steps) + 1 if steps else 0

    def sample_system(self) -> None:
        values: dict[str, float] = {}
        for monitor in self.monitors:
            try:
                monitor.collect_metrics()
                values.update(monitor.aggregate_metrics())
            except Exception as err:  # a flaky sensor must not end the tracker
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


def local_artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """With a local SQLite store, artifacts go next to the database file (``DIR/mlruns/EXPERIMENT``),
    not under whatever directory the run was started from; a server decides for itself (None)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    database = Path(tracking_uri.removeprefix("sqlite:///")).resolve()
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in experiment)
    return (database.parent / "mlruns" / name).as_uri()


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


def broadcast_from_rank0(value: str | None, world_size: int) -> str | None:
    """Rank 0's value on every rank (a no-op in a single process)."""
    if world_size <= 1:
        return value
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# --------------------------------------------------------------------------------- the training run's record
def training_run_spec(
    cfg: TrainConfig, config_path: str | None, deepspeed_config: dict[str, Any], world_size: int
) -> RunSpec:
    """Params (the resolved config, flattened), tags and artifacts of a distillation run."""
    manifest_path = Path(cfg.data) / "manifest.json"
    manifest = read_json(manifest_path)
    zero = deepspeed_config.get("zero_optimization", {})
    commit = git_commit()
    tags = {
        "teacher": cfg.teacher,
        "dataset": str(cfg.data),
        "dataset_fingerprint": dataset_fingerprint(manifest) if manifest else "unknown",
        "tokenizer_fingerprint": manifest.get("tokenizer", {}).get("fingerprint", "unknown"),
        "world_size": str(world_size),
        "deepspeed_stage": str(zero.get("stage", 0)),
        "deepspeed_offload": str(zero.get("offload_optimizer", {}).get("device", "none")),
        "precision": cfg.deepspeed.precision,
        "git_commit": commit or "unknown",
    }
    if commit:
        tags["mlflow.source.git.commit"] = commit
    files = [("config", path) for path in config_chain(Path(config_path))] if config_path else []
    if manifest:
        files.append(("dataset", manifest_path))
    params = {key: str(value) for key, value in flatten(to_dict(cfg)).items()}
    params["world_size"] = str(world_size)
    return RunSpec(
        experiment=cfg.mlflow.experiment,
        run_name=cfg.mlflow.run_name,
        params=params,
        tags=tags,
        files=files,
        texts={
            "config/resolved.yaml": yaml.safe_dump(to_dict(cfg), sort_keys=False),
            "deepspeed/ds_config.json": json.dumps(deepspeed_config, indent=2),
        },
    )


def dataset_fingerprint(manifest: dict[str, Any]) -> str:
    """A hash of every shard's sha256 and the tokenizer: equal exactly when the training data is."""
    content = {"tokenizer": manifest.get("tokenizer", {}).get("fingerprint"), "splits": manifest.get("splits")}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def config_chain(path: Path) -> list[Path]:
    """The config file and the ``base:`` files it inherits from."""
    chain = []
    while path.is_file() and path not in chain:
        chain.append(path)
        base = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("base")
        if not isinstance(base, str):
            break
        path = (path.parent / base).resolve()
    return chain


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None
