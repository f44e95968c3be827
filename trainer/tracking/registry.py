"""The registry of students: each exported student becomes a version of a registered MLflow model.

A student directory (Hugging Face weights, config, tokenizer) is logged with MLflow's
``transformers`` flavor, so ``mlflow.transformers.load_model("models:/NAME@ALIAS")`` gives a
ready fill-mask pipeline and ``python -m trainer pull`` gives back a plain Hugging Face directory.
The version is tagged with what a downstream team asks first (teacher, dataset, step,
evaluation metrics), all read from the training run, and gets an alias such as ``candidate``;
promoting it later is moving another alias (``champion``) to it.

    python -m trainer register STUDENT_DIR --name NAME [--alias ALIAS] [--run-id RUN_ID] [--tracking-uri URI]
    python -m trainer promote NAME VERSION ALIAS [--tracking-uri URI]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.config import ConfigError
from trainer.tracking.config import (
    MlflowConfig,
    check_access,
    credentials_holder,
    limit_http_retries,
    resolve_tracking_uri,
)
from trainer.tracking.delivery import permanent

if TYPE_CHECKING:
    from trainer.tracking.tracker import NullTracker, Tracker

log = logging.getLogger(__name__)

RUN_TAGS = ("teacher", "dataset", "dataset_fingerprint", "tokenizer_fingerprint", "git_commit")


def register_student(
    model_dir: Path,
    *,
    name: str,
    alias: str | None,
    run_id: str | None,
    tracking_uri: str,
    task: str = "fill-mask",
    attempts: int = 3,
    backoff_s: float = 1.0,
    tags: dict[str, str] | None = None,
    run_metrics: bool = True,
    follow_alias: str | None = None,
) -> Any:
    """Log ``model_dir`` as an MLflow model (in run ``run_id`` when given), register it as a new
    version of ``name`` tagged from the run, point ``alias`` at it; returns the ModelVersion.

    ``tags`` add to (and win over) the run's; ``run_metrics=False`` leaves out the run's last step and
    evaluation metrics (a checkpoint's student gives its own). A student whose run and ``step`` a version
    of ``name`` already has is not registered again, that version is returned: a relaunch of a finished
    run, or a registration retried after a kill, adds no duplicate. ``follow_alias`` moves only forward
    (:func:`advance_alias`). Each step is retried up to ``attempts`` times; a step that succeeded is not redone.
    """
    import mlflow
    from transformers import pipeline

    check_model_dir(model_dir)
    tags = dict(tags or {})
    mlflow.set_tracking_uri(tracking_uri)
    client = mlflow.MlflowClient(tracking_uri)
    model = pipeline(task, model=str(model_dir), tokenizer=str(model_dir))
    model_uri = version = None
    for attempt in itertools.count(1):
        try:
            if version is None and run_id and "step" in tags:
                version = registered_version(client, name, run_id, tags["step"])
            if version is None and model_uri is None:
                tags = {**(version_tags(client, run_id, metrics=run_metrics) if run_id else {}), **tags}
                model_uri = log_student(model, client, run_id, name, task, tags)
            if version is None:
                version = mlflow.register_model(model_uri, name, tags=tags)
            if alias:
                client.set_registered_model_alias(name, alias, version.version)
            if follow_alias:
                advance_alias(client, name, follow_alias, version)
            log.info("MLflow: registered %s version %s%s", name, version.version, f" as @{alias}" if alias else "")
            return version
        except Exception as err:
            if attempt == attempts or permanent(err):  # a refusal (no permission, a bad request) stays one
                raise
            wait = backoff_s * 2 ** (attempt - 1)
            log.warning("MLflow: registering, attempt %d/%d failed (%s); retry in %.0fs", attempt, attempts, err, wait)
            time.sleep(wait)


def log_student(model: Any, client: Any, run_id: str | None, name: str, task: str, tags: dict[str, str]) -> str:
    """Log the pipeline ``model`` as an MLflow model, in run ``run_id`` when given; returns its URI.

    The run is resumed for this and left in the state it was in (RUNNING while it trains, FINISHED
    after), even when logging fails: an upload must neither finish a training run nor mark it FAILED
    (as ``with start_run`` would)."""
    import mlflow

    status = client.get_run(run_id).info.status if run_id else None
    if run_id:
        mlflow.start_run(run_id=run_id)
    try:
        info = mlflow.transformers.log_model(
            model,
            name="student",
            task=task,
            model_card=model_card(name, task, tags),
            pip_requirements=pip_requirements(),
            tags=tags,
            step=int(tags.get("step", 0)),
        )
    finally:
        if run_id:  # one request: ending, then setting it back, let a reader see a training run FINISHED between
            mlflow.end_run(status=status)
    return info.model_uri


def registered_version(client: Any, name: str, run_id: str, step: str) -> Any:
    """The version of ``name`` registered from run ``run_id`` at ``step``, or None."""
    query = f"name = '{name}' and tags.run_id = '{run_id}' and tags.step = '{step}'"
    found = client.search_model_versions(query)
    if found:
        log.info("MLflow: %s version %s is the student of step %s already", name, found[0].version, step)
    return found[0] if found else None


def advance_alias(client: Any, name: str, alias: str, version: Any) -> bool:
    """Point ``alias`` at ``version``, unless it names a later step of the same run already (a registration
    retried late must not move a follower back); returns whether it moved."""
    from mlflow.exceptions import MlflowException

    try:
        current = client.get_model_version_by_alias(name, alias)
    except MlflowException:  # no such alias yet
        current = None
    same_run = current is not None and current.tags.get("run_id") == version.tags.get("run_id")
    if same_run and int(current.tags.get("step", -1)) > int(version.tags.get("step", -1)):
        return False
    client.set_registered_model_alias(name, alias, version.version)
    return True


def check_model_dir(model_dir: Path) -> None:
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"{model_dir}: not a Hugging Face model directory (no config.json)")


def version_tags(client: Any, run_id: str, *, metrics: bool = True) -> dict[str, str]:
    """Teacher, dataset and code of the run; with ``metrics``, its last step and evaluation metrics too."""
    run = client.get_run(run_id)
    tags = {key: run.data.tags[key] for key in RUN_TAGS if key in run.data.tags}
    training = [m for m in run.data._metric_objs if not m.key.startswith("system/")] if metrics else []
    if training:
        tags["step"] = str(max(m.step for m in training))
    for metric in training:
        if metric.key.startswith("eval"):
            tags[metric.key] = f"{metric.value:.6g}"
    tags["run_id"] = run_id
    return tags


def model_card(name: str, task: str, tags: dict[str, str]) -> Any:
    """A model card from the run (instead of MLflow looking one up on the Hugging Face hub)."""
    from huggingface_hub import ModelCard

    facts = "\n".join(f"- {key}: {value}" for key, value in sorted(tags.items()))
    return ModelCard(
        f"---\nlibrary_name: transformers\npipeline_tag: {task}\ntags: [distillation]\n---\n\n"
        f"# {name}\n\nA student encoder distilled with encoder-distill.\n\n{facts}\n"
    )


def pip_requirements() -> list[str]:
    """Pinned from this environment (MLflow would otherwise infer them in a slow subprocess)."""
    import torch
    import transformers

    return [f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}"]


def register_or_explain(
    model_dir: Path,
    cfg: MlflowConfig,
    run: Tracker | NullTracker,
    *,
    task: str = "fill-mask",
    tags: dict[str, str] | None = None,
) -> None:
    """At the end of a finished run: register ``model_dir`` as ``mlflow.register_as`` (retrying), if set, with
    the run's alias, and ``mlflow.checkpoint_alias`` moved to it too. On failure the model stays where it is and
    the error and the one command to register it later are printed."""
    if not cfg.register_as:
        return
    target = {"name": cfg.register_as, "alias": cfg.alias, "run_id": run.run_id, "tracking_uri": run.tracking_uri}
    try:
        if not run.created:
            raise RuntimeError(f"the MLflow run was never created at {run.tracking_uri}")
        register_student(
            model_dir,
            **target,
            task=task,
            attempts=cfg.register_attempts,
            backoff_s=cfg.retry_initial_s,
            tags=tags,
            follow_alias=cfg.checkpoint_alias,
        )
    except Exception as err:
        command = register_command(model_dir, **target, task=task)
        explained = refusal(err, cfg.register_as) or database_refused(err)
        log.error("MLflow: %s", explained or f"registering the student failed: {err}")
        print(f"The model stays in {model_dir}. Register it later with:\n  {command}", file=sys.stderr)


def refusal(err: Exception, name: str) -> str | None:
    """One sentence for a registry that refused this user (HTTP 401 or 403), naming the user and the model and
    the permission it takes; None for any other error. MLflow's basic-auth app asks EDIT on a registered model
    both to add a version and to move an alias (``@production``): READ, the usual default, allows neither."""
    from mlflow.exceptions import MlflowException

    if not isinstance(err, MlflowException) or err.get_http_status_code() not in (401, 403):
        return None
    who = credentials_holder()
    if err.get_http_status_code() == 401:
        return f"the registry refused the credentials of {who} (HTTP 401) while registering {name!r}"
    return (
        f"{who} may not register versions of {name!r} or move its aliases (HTTP 403 {err.error_code}): "
        "ask the model's owner or an admin for EDIT on it"
    )


SQLITE_LOCKED = "database is locked"  # SQLite's answer to a write that waited past its busy timeout for the lock
SERVER_503 = "too many 503 error responses"  # a server's HTTP 503 to MLflow's client making one attempt a request
READ_TIMEOUT = "Read timed out"  # requests' words for a server that did not answer within the client's timeout


def database_refused(err: Exception) -> str | None:
    """One line for a registration that the registry's database refused, naming the likely cause and the fix;
    None for any other error. SQLite lets one writer at a time hold the whole file, and a write that waited past
    its busy timeout (MLflow's: 20 s) fails with ``database is locked``: under concurrent registrations (a
    sweep's runs on one server) that is the backend's limit, not an outage; the fix is a server on PostgreSQL
    (docs/mlflow-server.md measures the load from which SQLite refuses). A store on a local SQLite file says
    so itself. Through a server it arrives as HTTP 503 (MLflow's server answers 503 for any database error that
    may pass: SQLite's lock, a PostgreSQL restart), and MLflow's client, making one attempt per request
    (:func:`~trainer.tracking.config.limit_http_retries`), drops the body that names the error: the line then
    says where to read which (the server's log). With the default ``mlflow.request_timeout_s`` (15 s) the client
    gives up before SQLite's 20 s lock wait ends, so a read timeout gets the same line, hedged."""
    said = str(err)
    if SQLITE_LOCKED in said:
        cause = "the registry's SQLite database is locked"
    elif SERVER_503 in said:
        cause = "the MLflow server answered 503, its database refused (on SQLite: 'database is locked', see its log)"
    elif READ_TIMEOUT in said:  # the lock wait (20 s) outlasts the default request timeout (15 s): no 503 arrives
        cause = (
            "the MLflow server did not answer within mlflow.request_timeout_s (busy, or on SQLite waiting for its lock)"
        )
    else:
        return None
    return (  # one line, short enough for the registrar's warning (it quotes a worker's last 300 characters)
        f"{cause}; SQLite takes one writer at a time; a team's server belongs on PostgreSQL: "
        "launch/mlflow-server.sh, docs/mlflow-server.md"
    )


def register_command(
    model_dir: Path, *, name: str, alias: str | None, run_id: str | None, tracking_uri: str, task: str = "fill-mask"
) -> str:
    """The one command that registers ``model_dir`` later, as the end of training would have."""
    args = ["python", "-m", "trainer", "register", str(model_dir), "--name", name]
    if alias:
        args += ["--alias", alias]
    if run_id:
        args += ["--run-id", run_id]
    if task != "fill-mask":
        args += ["--task", task]
    args += ["--tracking-uri", tracking_uri]
    return shlex.join(args)


def promote(name: str, version: str, alias: str, tracking_uri: str) -> None:
    """Point ``alias`` at ``version`` of ``name`` (moving it from whichever version had it)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    client.get_model_version(name, version)  # a clear error when the version does not exist
    client.set_registered_model_alias(name, alias, version)
    log.info("MLflow: %s@%s -> version %s", name, alias, version)


def main(argv: list[str]) -> int:
    """``register`` and ``promote``; ``argv[0]`` is the command name."""
    command, args = argv[0], argv[1:]
    parser = argparse.ArgumentParser(prog=f"python -m trainer {command}")
    parser.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")
    if command == "register":
        parser.add_argument("student_dir", type=Path, help="exported Hugging Face student directory")
        parser.add_argument("--name", required=True, help="registered model name")
        parser.add_argument("--alias", help="alias for the new version, e.g. candidate")
        parser.add_argument("--run-id", help="the training run (its tags and eval metrics tag the version)")
        parser.add_argument("--task", default="fill-mask", help="pipeline task (text-classification for fine-tunes)")
    else:
        parser.add_argument("name")
        parser.add_argument("version")
        parser.add_argument("alias")
    ns = parser.parse_args(args)
    cfg = MlflowConfig(tracking_uri=ns.tracking_uri)
    limit_http_retries(cfg)
    check_access(cfg, way_out=None)  # wrong credentials: one line, before the student is read
    tracking_uri = resolve_tracking_uri(cfg)
    from mlflow.exceptions import MlflowException

    try:
        if command == "promote":
            promote(ns.name, ns.version, ns.alias, tracking_uri)
            print(f"{ns.name}@{ns.alias} -> version {ns.version}")
            return 0
        version = register_student(
            ns.student_dir, name=ns.name, alias=ns.alias, run_id=ns.run_id, tracking_uri=tracking_uri, task=ns.task
        )
    except MlflowException as err:
        print(f"error: {command}: {refusal(err, ns.name) or database_refused(err) or err.message}", file=sys.stderr)
        return 1
    print(f"registered {ns.name} version {version.version}" + (f" as @{ns.alias}" if ns.alias else ""))
    return 0
