"""Fixtures for the MLflow tests: a real ``mlflow server`` on 127.0.0.1, a tiny student to register.

The server runs in its own process group so that stopping it also stops the processes it
forks; its SQLite file and artifact directory outlive a stop, so a restart on the same port
continues the same store (what the outage test needs). ``team_mlflow_server`` is a team's deployment:
PostgreSQL, artifacts in S3 (moto's server), users in the basic-auth app's own PostgreSQL database.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers import S3_CREDENTIALS, MlflowServer, MotoServer, PostgresServer, TcpProxy, free_port, tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> MlflowServer:
    """One real ``mlflow server`` (SQLite + local artifacts) for the session; tests that stop it restart it."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres() -> PostgresServer:
    """A real PostgreSQL server on 127.0.0.1 for the session, removed at its end."""
    missing = PostgresServer.available()
    if missing:
        pytest.skip(missing)
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.remove()


TEAM_USER = ("sweep", "sweep-password-1234")  # the team's service account on team_mlflow_server


@pytest.fixture(scope="session")
def team_s3(moto_server: MotoServer) -> TcpProxy:
    """The team server's way to its S3 store: a TCP proxy in front of moto's server, which a test cuts
    (``down()``, ``restore()``) to make the store unreachable, as a network or a store that fails does."""
    return TcpProxy(moto_server.port)


@pytest.fixture(scope="session")
def team_mlflow_server(
    postgres: PostgresServer, moto_server: MotoServer, team_s3: TcpProxy, tmp_path_factory: pytest.TempPathFactory
) -> MlflowServer:
    """launch/mlflow-server.sh as docs/mlflow-server.md deploys it for a team: runs and registry on PostgreSQL,
    artifacts proxied to ``s3://team-mlflow/artifacts`` (a real S3 server: moto's, reached through ``team_s3``),
    the basic-auth app with its users in a second PostgreSQL database, two workers; clients sign in as TEAM_USER
    (``client_env``)."""
    moto_server.client().create_bucket(Bucket="team-mlflow")
    server = MlflowServer(
        tmp_path_factory.mktemp("team-mlflow"),
        backend=postgres.create_database("mlflow"),
        artifacts="s3://team-mlflow/artifacts",
        app_name="basic-auth",
        auth_db=postgres.create_database("mlflow_auth"),
        env={**S3_CREDENTIALS, "MLFLOW_S3_ENDPOINT_URL": team_s3.url},
        workers=2,
    )
    server.start()
    try:
        server.add_client_user(*TEAM_USER, cheap_hash=True)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def registry_server(request: pytest.FixtureRequest) -> MlflowServer:
    """The server ``registered_run`` is tracked by: ``sqlite`` (``mlflow_server``) or ``team``
    (``team_mlflow_server``), as the test chooses with ``parametrize("registry_server", [...], indirect=True)``."""
    return request.getfixturevalue({"sqlite": "mlflow_server", "team": "team_mlflow_server"}[request.param])


@pytest.fixture(scope="session")
def tiny_student_dir(tmp_path_factory: pytest.TempPathFactory, bert_tokenizer_dir: Path) -> Path:
    """A tiny BertForMaskedLM with the real bert-base-uncased tokenizer, saved like an exported student."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    tokenizer = AutoTokenizer.from_pretrained(bert_tokenizer_dir)
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    model = BertForMaskedLM(config)
    out = tmp_path_factory.mktemp("student")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tiny_teacher_dir: Path, tiny_dataset_dir: Path, tmp_path_factory) -> Path:
    """One real DeepSpeed checkpoint of the tiny CPU distillation (``helpers.tiny_checkpoint``), for tests that
    hand checkpoints to a registrar themselves."""
    return tiny_checkpoint(tmp_path_factory.mktemp("checkpointed") / "run", tiny_teacher_dir, tiny_dataset_dir)


@pytest.fixture
def dead_tracking_uri() -> str:
    """An HTTP tracking URI on which nothing listens."""
    return f"http://127.0.0.1:{free_port()}"


class Launch:
    """``deepspeed --num_gpus 2 launch/run.sh configs/tiny-cpu.yaml ...`` on two CPU ranks, in the background."""

    def __init__(
        self, teacher: Path, data: Path, output_dir: Path, overrides: list[str], env: dict[str, str] | None = None
    ) -> None:
        deepspeed = Path(sys.executable).parent / "deepspeed"
        self.output_dir = output_dir
        self.log_path = output_dir.parent / f"{output_dir.name}.log"
        self.overrides = [f"teacher={teacher}", f"data={data}", f"output_dir={output_dir}", *overrides]
        cmd = [str(deepspeed), "--num_gpus", "2", "launch/run.sh"]
        cmd += ["configs/tiny-cpu.yaml", *self.overrides]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        env.pop("MLFLOW_TRACKING_URI", None)  # the overrides name the server
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 600) -> str:
        """Wait for the launcher to exit successfully; returns its output."""
        rc = self.process.wait(timeout=timeout)
        log = self.log_path.read_text()
        assert rc == 0, f"launcher exited with {rc}:\n{log[-6000:]}"
        return log

    def records(self) -> list[dict]:
        """``metrics.jsonl`` so far (the loop's own record, independent of MLflow)."""
        path = self.output_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def assert_metrics_reached_mlflow(client, run_id: str, records: list[dict], *, killed: Sequence[dict] = ()) -> None:
    """Every value of ``records`` (metrics.jsonl) is in the run's history, at its step, exactly, and nothing else is
    there, but for values of ``killed``: the records of an earlier launch of the run, SIGKILLed. Those reached the
    server or not, as far as it had sent them before it died (the loop writes a record to metrics.jsonl before it
    hands it to the tracker, whose queue is in memory); its steps after the checkpoint the relaunch resumed from are
    redone, so the server holds two values at such a step when the killed launch had sent its own."""
    keys = {key for record in records for key in record if key != "step"}
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/samples"} <= keys
    assert any(key.startswith("eval/") for key in keys)
    for key in keys:
        expected = {(r["step"], r[key]) for r in records if key in r}
        allowed = expected | {(r["step"], r[key]) for r in killed if key in r}
        got = {(m.step, m.value) for m in client.get_metric_history(run_id, key)}
        assert expected <= got <= allowed, (key, sorted(expected - got), sorted(got - allowed))


@pytest.fixture
def launch_tiny_distillation(tiny_teacher_dir: Path, tiny_dataset_dir: Path, tmp_path: Path):
    """Start the tiny CPU distillation through the real launcher with extra ``key=value`` overrides."""
    return lambda *overrides: Launch(tiny_teacher_dir, tiny_dataset_dir, tmp_path / "run", list(overrides))


# The one tracked and registered launch that test_end_to_end and test_registered_checkpoints both read.
REGISTERED_MODEL = "tiny-student"
REGISTERED_EXPERIMENT = "e2e"


def registered_settings(server: MlflowServer) -> list[str]:
    """Every third step a checkpoint, an evaluation and a registered version (alias ``following``); the final
    student registered as ``@candidate``; system metrics every second. The end of training waits up to 600 s for the
    checkpoints' versions (it returns as soon as they are in): on a 2-core machine that other jobs keep busy, 120 s
    was too short for one registration. On the basic-auth server, system metrics are off: the app hashes the
    password on every request (~0.7 s of CPU each), so a sample a second from each rank would keep the test's two
    cores busy for the server alone; the SQLite server's run covers them."""
    uri = server.uri
    settings = ["max_steps=12", "checkpoint.every_steps=3", "checkpoint.keep_last=2", "eval.every_steps=3",
                "logging.every_steps=1", f"mlflow.tracking_uri={uri}", f"mlflow.experiment={REGISTERED_EXPERIMENT}",
                f"mlflow.register_as={REGISTERED_MODEL}", "mlflow.alias=candidate", "mlflow.register_checkpoints=true",
                "mlflow.checkpoint_alias=following", "mlflow.system_metrics_interval_s=1",
                "mlflow.finish_timeout_s=600"]  # fmt: skip
    if server.app_name == "basic-auth":
        settings.append("mlflow.system_metrics=false")
    return settings


@pytest.fixture(scope="session")
def registered_run(
    registry_server: MlflowServer, tiny_teacher_dir: Path, tiny_dataset_dir: Path, tmp_path_factory
) -> Launch:
    """The tiny CPU distillation through the real launcher, finished, tracked by ``registry_server`` with its due
    checkpoints and final student registered (:func:`registered_settings`). One launch per server for the
    session: the tracking, promotion, pull and fine-tune of test_end_to_end and the versions per checkpoint of
    test_registered_checkpoints read the same run."""
    out = tmp_path_factory.mktemp("registered") / "run"
    settings = registered_settings(registry_server)
    run = Launch(tiny_teacher_dir, tiny_dataset_dir, out, settings, registry_server.client_env)
    run.wait(timeout=1200)  # its end waits up to 600 s for the registry (registered_settings)
    return run


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The tests' models are tiny: one thread is fastest, and spares a busy 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def trainer_cli():
    """``python -m trainer ARGS`` in a fresh process, as a user runs it; returns the CompletedProcess."""

    def run(*args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "trainer", *args]
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    return run
