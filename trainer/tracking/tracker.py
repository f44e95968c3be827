"""One MLflow run, from creation (or resumption) to its final status, and which tracker a process gets.

A run records, once, what its :class:`RunSpec` says (experiment, name, params, tags, artifacts),
then metrics as the loop logs them; :class:`~trainer.tracking.delivery.Delivery` sends all of it
from a background thread, so that no call here ever blocks or crashes training (``finish`` waits,
for a bounded time). ``metrics.jsonl`` (written by the loop) stays the local record.

Only global rank 0 records the run. With more than one node, local rank 0 of every other node
adds its system metrics (``system/<node>/...``) to the same run, whose id rank 0 broadcasts.
Every other process, and every process when tracking is off, gets a :class:`NullTracker`.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import ConfigError
from trainer.tracking.config import MlflowConfig, check_access, limit_http_retries, resolve_tracking_uri
from trainer.tracking.delivery import Delivery, permanent

log = logging.getLogger(__name__)

PARAM_BATCH = 100  # MLflow's limit of params per log_batch request


@dataclass
class RunSpec:
    """What a run records once, when it is created or resumed."""

    experiment: str
    run_name: str | None = None
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    files: list[tuple[str, Path]] = field(default_factory=list)  # (artifact directory in the run, local file)
    texts: dict[str, str] = field(default_factory=dict)  # artifact path in the run -> content


def start_tracker(
    cfg: MlflowConfig,
    *,
    rank: int,
    world_size: int,
    resume_run_id: str | None,
    run_spec: Callable[[], RunSpec],
) -> Tracker | NullTracker:
    """The tracker of a training process. Collective when torch.distributed is initialised and
    tracking is on: every rank calls it (rank 0 shares the run id so other nodes can add system metrics).

    Rank 0 records the run ``run_spec()`` describes (called on rank 0 only), continuing
    ``resume_run_id`` (from the checkpoint) when given."""
    if not cfg.tracks:
        return NullTracker(cfg)
    tracker: Tracker | NullTracker = NullTracker(cfg)
    if rank == 0:
        tracker = Tracker(cfg, spec=run_spec(), run_id=resume_run_id)
        # Wait (bounded) for the run to exist, so that its id reaches the first checkpoint.
        if not tracker.delivery.first_attempt.wait(cfg.start_timeout_s):
            log.warning(
                "MLflow: no answer from %s yet; training starts, tracking goes on in the background",
                tracker.tracking_uri,
            )
    run_id = broadcast_from_rank0(tracker.run_id, world_size)
    if rank != 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0 and cfg.system_metrics and run_id:
        return Tracker(cfg, spec=None, run_id=run_id)
    return tracker


def open_tracker(cfg: MlflowConfig, spec: RunSpec) -> Tracker | NullTracker:
    """The tracker of a run that one process records alone (fine-tuning); it does not wait for the server."""
    return Tracker(cfg, spec=spec) if cfg.tracks else NullTracker(cfg)


class Tracker:
    """One MLflow run, fed from the training loop without ever blocking it.

    ``spec`` given: this process records the run (creating it, or resuming ``run_id``).
    ``spec`` None: a follower that only adds this node's system metrics to the existing ``run_id``.
    ``parent`` given: the run is nested under the parent's (MLflow's ``mlflow.parentRunId`` tag), also when
    the parent's run does not exist yet (the server was late or down): the tag is set in the background
    once it does (:meth:`nest`).
    """

    def __init__(
        self, cfg: MlflowConfig, *, spec: RunSpec | None, run_id: str | None = None, parent: Tracker | None = None
    ) -> None:
        self.cfg = cfg
        self.spec = spec
        self.run_id = run_id
        self.parent = parent
        self.tracking_uri = resolve_tracking_uri(cfg)
        self.last_step = 0
        limit_http_retries(cfg)
        setup = [] if spec is None else [self.open_run, self.nest, self.log_params, self.log_artifacts]
        self.delivery = Delivery(cfg, self.tracking_uri, setup=setup, run_id=lambda: self.run_id)
        atexit.register(self.close_at_exit)

    @property
    def created(self) -> bool:
        """Whether the run exists with its params, tags and artifacts (its setup went through)."""
        return self.run_id is not None and self.delivery.set_up

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queue ``metrics`` at ``step``; returns at once, whatever the server's state."""
        if self.spec is None:  # a follower adds system metrics only
            return
        self.last_step = max(self.last_step, step)
        self.delivery.put(metrics, step)

    def finish(self, final_metrics: dict[str, float], *, status: str = "FINISHED") -> None:
        """Deliver what is queued (waiting at most ``finish_timeout_s``), then mark the run ``status``."""
        if not self.delivery.closed and final_metrics:
            self.log_metrics(final_metrics, self.last_step)
        self.delivery.close(self.cfg.finish_timeout_s)
        self.terminate(status)

    def close_at_exit(self) -> None:
        """The process is exiting without finish() (training raised): deliver briefly, mark the run FAILED."""
        if not self.delivery.closed:
            self.delivery.close(min(self.cfg.finish_timeout_s, 10.0))
            self.terminate("FAILED")

    def terminate(self, status: str) -> None:
        if self.spec is None or not self.created:
            return
        try:
            self.delivery.client.set_terminated(self.run_id, status)
        except Exception as err:
            log.warning("MLflow: could not mark run %s %s: %s", self.run_id, status, err)

    # ---------------------------------------------------------------- setup steps, run by the delivery thread
    def open_run(self, client: Any) -> None:
        """Resume ``run_id`` if given (and known to this server), else create the run."""
        from mlflow.entities import RunTag
        from mlflow.exceptions import MlflowException

        spec = self.spec
        if self.run_id is not None:
            try:
                client.get_run(self.run_id)
            except MlflowException as err:
                if not permanent(err):
                    raise
                log.warning(
                    "MLflow: run %s to resume is unknown at %s; starting a new run", self.run_id, self.tracking_uri
                )
                self.run_id = None
            else:
                client.update_run(self.run_id, status="RUNNING")
                client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in spec.tags.items()])
                return
        experiment = client.get_experiment_by_name(spec.experiment)
        if experiment is None:
            location = local_artifact_location(self.tracking_uri, spec.experiment)
            try:
                experiment_id = client.create_experiment(spec.experiment, artifact_location=location)
            except MlflowException as err:
                # Created since the lookup by another run starting at once (task distillation's parent and
                # stage, the ablation's parallel jobs): a permanent refusal, which skipped this run.
                if err.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                experiment_id = client.get_experiment_by_name(spec.experiment).experiment_id
        else:
            experiment_id = experiment.experiment_id
        run = client.create_run(experiment_id, run_name=spec.run_name, tags=spec.tags)
        self.run_id = run.info.run_id
        log.info("MLflow: run %s in experiment %r at %s", self.run_id, spec.experiment, self.tracking_uri)

    def nest(self, client: Any) -> None:
        """Tag the run with its parent's id, once the parent's run exists: the parent's own thread creates
        it, perhaps after this one (a server late or down delays both). Waits here, in the background,
        while the parent's setup is still trying, at most one backoff interval and one request; a parent
        whose creation was refused, or still missing then, leaves the run where it is, not nested."""
        if self.parent is None or self.run_id is None:  # no parent, or this run's creation was refused
            return
        from mlflow.entities import RunTag

        parent, deadline = self.parent, time.monotonic() + self.cfg.retry_max_s + self.cfg.request_timeout_s
        while parent.run_id is None and not parent.delivery.set_up and time.monotonic() < deadline:
            time.sleep(0.1)
        if parent.run_id is None:
            log.warning("MLflow: run %s is not nested: its parent run does not exist", self.run_id)
            return
        client.log_batch(self.run_id, tags=[RunTag("mlflow.parentRunId", parent.run_id)])

    def log_params(self, client: Any) -> None:
        """Log the params; on resume only the new ones (MLflow refuses to change a param)."""
        from mlflow.entities import Param

        existing = client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in self.spec.params.items() if k in existing and existing[k] != v)
        if changed:
            log.warning("MLflow: resumed run %s keeps its original values of %s", self.run_id, ", ".join(changed))
        params = [Param(k, v) for k, v in self.spec.params.items() if k not in existing]
        for i in range(0, len(params), PARAM_BATCH):
            client.log_batch(self.run_id, params=params[i : i + PARAM_BATCH])

    def log_artifacts(self, client: Any) -> None:
        for directory, path in self.spec.files:
            client.log_artifact(self.run_id, str(path), artifact_path=directory)
        for artifact, text in self.spec.texts.items():
            client.log_text(self.run_id, text, artifact)


class NullTracker:
    """The tracker of a process that records nothing (tracking off, or a rank that adds nothing to
    the run): the same calls, doing nothing. No thread, no MLflow import, nothing written."""

    run_id: str | None = None
    created = False

    def __init__(self, cfg: MlflowConfig) -> None:
        self.tracking_uri = resolve_tracking_uri(cfg)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Nothing to record."""

    def finish(self, final_metrics: dict[str, float], *, status: str = "FINISHED") -> None:
        """Nothing to deliver."""


def local_artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """With a local SQLite store, artifacts go next to the database file (``DIR/mlruns/EXPERIMENT``),
    not under whatever directory the run was started from; a server decides for itself (None)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    database = Path(tracking_uri.removeprefix("sqlite:///")).resolve()
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in experiment)
    return (database.parent / "mlruns" / name).as_uri()


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


def check_access_on_rank0(cfg: MlflowConfig, is_main: bool, world_size: int) -> None:
    """Wrong MLflow credentials stop every rank here, before any weight is loaded, in one line: rank 0 asks the
    server (:func:`~trainer.tracking.config.check_access`: one request per run, not one per rank)."""
    checked_on_rank0(lambda: check_access(cfg), is_main, world_size)


def checked_on_rank0(check: Callable[[], None], is_main: bool, world_size: int) -> None:
    """``check()`` on rank 0 alone, and every rank stops if it raises a ConfigError: rank 0 raises it (its one
    line); the others exit with the same status, 2, without repeating it. Left to go on alone, they would die
    in their next collective, in a transport's stack trace."""
    refused: ConfigError | None = None
    if is_main:
        try:
            check()
        except ConfigError as err:
            refused = err
    if broadcast_from_rank0(None if refused is None else str(refused), world_size) is None:
        return
    if refused is not None:
        raise refused
    raise SystemExit(2)  # a ConfigError's status (common.cli.run_cli): rank 0 says why
