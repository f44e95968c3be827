"""``python -m trainer register-checkpoints QUEUE --name NAME --run-id RUN_ID``: register queued checkpoints.

``QUEUE`` is a run's ``OUTPUT_DIR/registering``: snapshots of checkpoints that
``mlflow.register_checkpoints`` queued (:mod:`trainer.tracking.checkpoints`). Each, oldest first, is
exported as a student and registered as a version of NAME in run RUN_ID, tagged with its step, samples,
tokens and evaluation metrics; ``--alias`` moves forward to it; then the snapshot is removed. A
snapshot whose version exists already (a registration finished just before a kill) is only removed.
Stops at the first failure (exit 1), so that versions appear in step order.

Training runs this in the background; the end of a run whose registry was down runs it for you later.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from trainer.commands.export import export
from trainer.tracking.checkpoints import REFUSED, REQUEST, pending_snapshots, remove_snapshot
from trainer.tracking.config import MlflowConfig, limit_http_retries, resolve_tracking_uri
from trainer.tracking.registry import (
    advance_alias,
    database_refused,
    refusal,
    register_student,
    registered_version,
)

log = logging.getLogger(__name__)


def register_snapshot(snapshot: Path, *, name: str, run_id: str, alias: str | None, tracking_uri: str) -> Any:
    """Export ``snapshot``'s student and register it (unless its step's version exists); returns the version."""
    import mlflow

    request = json.loads((snapshot / REQUEST).read_text(encoding="utf-8"))
    tags = {key: str(value) for key, value in request.items() if not isinstance(value, float)}
    tags.update({key: f"{value:.6g}" for key, value in request.items() if isinstance(value, float)})
    tags.update(kind="checkpoint", run_id=run_id)
    client = mlflow.MlflowClient(tracking_uri)
    version = registered_version(client, name, run_id, tags["step"])
    if version is not None:  # registered before a kill: only the alias may still have to move
        if alias:
            advance_alias(client, name, alias, version)
        return version
    with tempfile.TemporaryDirectory(dir=snapshot.parent, prefix=".export-") as tmp:
        student = export(snapshot, Path(tmp) / "student")
        return register_student(
            student,
            name=name,
            alias=None,
            run_id=run_id,
            tracking_uri=tracking_uri,
            attempts=1,  # the training process retries the whole queue, with backoff
            tags=tags,
            run_metrics=False,
            follow_alias=alias,
        )


def die_with(parent_pid: int) -> None:
    """Linux: be sent SIGTERM when the training process that started this one dies (a SIGKILLed rank must not
    leave a registration running beside its relaunch's)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # it died before the line above
        sys.exit(1)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer register-checkpoints", description=__doc__.splitlines()[0])
    parser.add_argument("queue", type=Path, help="a run's OUTPUT_DIR/registering")
    parser.add_argument("--name", required=True, help="registered model name (mlflow.register_as)")
    parser.add_argument("--run-id", required=True, help="the training run")
    parser.add_argument("--alias", help="moved forward to each new version (mlflow.checkpoint_alias)")
    parser.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")
    parser.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)  # set by the training process
    ns = parser.parse_args(argv)
    if ns.parent_pid is not None:
        die_with(ns.parent_pid)
    cfg = MlflowConfig(tracking_uri=ns.tracking_uri)
    limit_http_retries(cfg)
    tracking_uri = resolve_tracking_uri(cfg)
    for snapshot in pending_snapshots(ns.queue):
        step = json.loads((snapshot / REQUEST).read_text(encoding="utf-8"))["step"]
        try:
            version = register_snapshot(
                snapshot, name=ns.name, run_id=ns.run_id, alias=ns.alias, tracking_uri=tracking_uri
            )
        except Exception as err:
            refused = refusal(err, ns.name)
            if refused is not None:  # retrying cannot help: the registrar stops trying for this run
                print(f"error: registering the student of step {step}: {refused}", file=sys.stderr)
                return REFUSED
            said = database_refused(err) or f"{type(err).__name__}: {err}"  # the registrar warns with this line
            print(f"error: registering the student of step {step}: {said}", file=sys.stderr)
            return 1
        remove_snapshot(snapshot)
        print(f"registered the student of step {step} as {ns.name} version {version.version}", flush=True)
    return 0
