"""The ``mlflow:`` config section and where it points: the tracking URI, how long one request may take."""

from __future__ import annotations

import dataclasses
import os
import re

from common.config import ConfigError, require

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


@dataclasses.dataclass
class MlflowConfig:
    """MLflow tracking and registry (``trainer/tracking/``, docs/mlflow.md).

    Tracking never stops training: while the server is unreachable, metrics wait in memory and
    a background thread retries with exponential backoff (``retry_initial_s`` doubling up to
    ``retry_max_s``); ``finish_timeout_s`` bounds how long the end of training waits for them.
    """

    enabled: bool = True  # false: no run in the default store (naming a tracking_uri or register_as tracks anyway)
    tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
    experiment: str = "distillation"
    run_name: str | None = None
    register_as: str | None = None  # registered model name for the exported student
    alias: str | None = None  # alias given to the new version, e.g. "candidate"
    # While training (trainer.tracking.checkpoints): false, or K = register every K-th checkpoint save's student
    # (true = every save) as a version of register_as, in the background. models:/NAME@latest is the newest.
    register_checkpoints: bool | int = False
    checkpoint_alias: str | None = None  # an alias moved to each checkpoint's version (and the final one), forward only
    system_metrics: bool = True  # CPU, memory, disk, network, GPU of every node, as system/<node>/...
    system_metrics_interval_s: float = 10.0
    request_timeout_s: int = 15  # one HTTP request to the server (MLFLOW_HTTP_REQUEST_TIMEOUT unless set)
    start_timeout_s: float = 30.0  # how long start waits for the run to exist (so its id reaches checkpoints)
    finish_timeout_s: float = 120.0  # how long the end of training waits for buffered metrics to reach MLflow
    retry_initial_s: float = 1.0
    retry_max_s: float = 30.0
    register_attempts: int = 3

    @property
    def tracks(self) -> bool:
        """Whether runs are tracked: a server or a model to register named explicitly wins over enabled=false
        (so ``mlflow.tracking_uri=URI`` works as written on a preset that disables the default store)."""
        return self.enabled or self.tracking_uri is not None or self.register_as is not None

    @property
    def checkpoint_every(self) -> int:
        """Every how many checkpoint saves a student is registered during training (0: never)."""
        every = self.register_checkpoints
        return int(every) if every is not True else 1

    def validate(self) -> None:
        require(bool(self.experiment), "mlflow.experiment", "must not be empty")
        require(self.alias is None or self.register_as is not None, "mlflow.alias", "needs mlflow.register_as")
        for key in ("alias", "checkpoint_alias"):
            alias = getattr(self, key)
            require(
                alias is None or (alias.lower() != "latest" and not re.fullmatch(r"[vV]\d+", alias)),
                f"mlflow.{key}",
                "'latest' and v<number> are reserved by MLflow (models:/NAME@latest is always the newest version)",
            )
        every = self.register_checkpoints
        require(every >= 0, "mlflow.register_checkpoints", "false, true (every save) or K >= 1 (every K-th save)")
        require(not every or self.register_as is not None, "mlflow.register_checkpoints", "needs mlflow.register_as")
        require(
            self.checkpoint_alias is None or bool(every), "mlflow.checkpoint_alias", "needs mlflow.register_checkpoints"
        )
        for key in ("system_metrics_interval_s", "request_timeout_s", "retry_initial_s", "retry_max_s"):
            require(getattr(self, key) > 0, f"mlflow.{key}", "must be > 0")
        for key in ("start_timeout_s", "finish_timeout_s"):
            require(getattr(self, key) >= 0, f"mlflow.{key}", "must be >= 0")
        require(self.register_attempts >= 1, "mlflow.register_attempts", "must be >= 1")


def resolve_tracking_uri(cfg: MlflowConfig) -> str:
    """``mlflow.tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else the embedded SQLite store."""
    return cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def limit_http_retries(cfg: MlflowConfig) -> None:
    """Make one MLflow HTTP request fail fast (unless the user chose otherwise): we retry ourselves."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(cfg.request_timeout_s))


def check_access(cfg: MlflowConfig, way_out: str | None = "mlflow.enabled=false") -> None:
    """Before any heavy work: does the tracking server accept this process's credentials (MLflow's usual
    ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` or ``MLFLOW_TRACKING_TOKEN``)? One request, no
    retry, at most ``mlflow.request_timeout_s``. A refusal (401, 403) is a ConfigError naming the user (and
    ``way_out``, the setting that does without the server, where the caller has one); a server that does not
    answer is left to the caller, whose own requests retry or fail as they would without this check."""
    uri = resolve_tracking_uri(cfg)
    if not cfg.tracks or not uri.startswith(("http://", "https://")):
        return
    from mlflow.tracking._tracking_service.utils import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        response = http_request(
            get_default_host_creds(uri),
            "/api/2.0/mlflow/experiments/search",
            "POST",
            json={"max_results": 1},
            max_retries=0,
            timeout=cfg.request_timeout_s,
            raise_on_status=False,
        )
    except Exception:  # unreachable or slow: not a refusal
        return
    if response.status_code in (401, 403):
        refusal = "refused the credentials of" if response.status_code == 401 else "does not let"
        raise ConfigError(
            f"mlflow: the tracking server at {uri} {refusal} {credentials_holder()} (HTTP {response.status_code}"
            + ("" if response.status_code == 401 else ": no permission to read experiments")
            + "): set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)"
            + (f", or {way_out}" if way_out else "")
        )


def credentials_holder() -> str:
    """Whom this process's MLflow requests speak for, as error lines name them: MLflow sends basic auth when
    both ``MLFLOW_TRACKING_USERNAME`` and ``MLFLOW_TRACKING_PASSWORD`` are set, else ``MLFLOW_TRACKING_TOKEN``
    as a bearer token, else nothing. A refusal that names the wrong identity sends its reader to the wrong fix."""
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    if user and os.environ.get("MLFLOW_TRACKING_PASSWORD"):
        return f"user {user!r}"
    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        return "the holder of MLFLOW_TRACKING_TOKEN"
    if user:
        return f"user {user!r} (no MLFLOW_TRACKING_PASSWORD)"
    return "anonymous requests (no MLFLOW_TRACKING_USERNAME or MLFLOW_TRACKING_TOKEN)"
