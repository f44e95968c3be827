"""A shared registry with permissions: a real ``mlflow server --app-name basic-auth`` on 127.0.0.1, users made by
its admin, credentials in MLflow's usual variables (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD).

* Wrong credentials fail the launch before any weight is loaded, and ``pull``, in one line naming the user.
* Alice trains, registers ``shared-student@production`` (she created the model: she manages it), and pulls it.
* Bob (the server's default permission: READ) trains into his own experiment; the registry refuses his version
  and the alias: one line naming him and the model, no retries, and his run still finishes with its
  checkpoints and exported student. Alice's version keeps ``@production``, also against ``promote``.
* Once an admin grants Bob EDIT on the model, his ``promote`` moves ``@production`` (what docs/mlflow.md says
  EDIT allows).
* (fast tier) the refusal line names whom the credentials speak for: a user, a token's holder, nobody.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Launch
from helpers import REPO, MlflowServer, record_fault

pytestmark = pytest.mark.integration
NAME = "shared-student"
USERS = {"alice": "alice-password-1234", "bob": "bob-password-1234"}


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> MlflowServer:
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-auth"), app_name="basic-auth")
    server.start()
    for user, password in USERS.items():
        server.add_user(user, password, cheap_hash=True)
    yield server
    server.stop()


def credentials(user: str, password: str | None = None) -> dict[str, str]:
    """What a client signing in as ``user`` sets (their own password unless ``password``)."""
    return {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password or USERS[user]}


def as_user(monkeypatch: pytest.MonkeyPatch, user: str, password: str | None = None) -> None:
    for variable, value in credentials(user, password).items():
        monkeypatch.setenv(variable, value)


def settings(uri: str, experiment: str) -> list[str]:
    return ["max_steps=4", "checkpoint.every_steps=2", "eval.every_steps=4", f"mlflow.tracking_uri={uri}",
            f"mlflow.experiment={experiment}", f"mlflow.register_as={NAME}", "mlflow.alias=production",
            "mlflow.register_checkpoints=true",
            # Off: a basic-auth server hashes the password on every request (about 0.7 s each on 2 cores), and a
            # logged model fetches the history of every metric, system ones included. Tested elsewhere.
            "mlflow.system_metrics=false"]  # fmt: skip


@pytest.mark.parametrize(
    ("credentials", "named"),
    [
        ({"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": "not-her-password"}, "user 'alice'"),
        ({"MLFLOW_TRACKING_TOKEN": "not-a-token"}, "the holder of MLFLOW_TRACKING_TOKEN"),
        ({}, "anonymous requests (no MLFLOW_TRACKING_USERNAME or MLFLOW_TRACKING_TOKEN)"),
    ],
    ids=["password", "token", "none"],
)
def test_refused_credentials_are_named_as_mlflow_sent_them(
    auth_server: MlflowServer, monkeypatch: pytest.MonkeyPatch, credentials: dict[str, str], named: str
) -> None:
    from common.config import ConfigError
    from trainer.tracking.config import MlflowConfig, check_access

    for variable in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in credentials.items():
        monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as refused:
        check_access(MlflowConfig(tracking_uri=auth_server.uri))
    assert str(refused.value).startswith(
        f"mlflow: the tracking server at {auth_server.uri} refused the credentials of {named} (HTTP 401): "
    )
    as_user(monkeypatch, "alice")
    check_access(MlflowConfig(tracking_uri=auth_server.uri))  # her own password: let in


@pytest.mark.full
def test_a_shared_registry_lets_its_users_in_where_they_belong_and_nowhere_else(
    auth_server: MlflowServer,
    tiny_teacher_dir: Path,
    tiny_dataset_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    trainer_cli,
) -> None:
    from mlflow import MlflowClient

    uri = auth_server.uri

    # The three launches run at once (each mostly waits on its own imports and registrations): wrong credentials,
    # alice's and bob's. Alice creates the model first, so that it is hers (MANAGE) before bob's run asks.
    as_user(monkeypatch, "alice")
    client = MlflowClient(uri)
    client.create_registered_model(NAME)
    wrong = Launch(tiny_teacher_dir, tiny_dataset_dir, tmp_path / "wrong", settings(uri, "alice-runs"),
                   credentials("alice", "not-her-password"))  # fmt: skip
    alice = Launch(tiny_teacher_dir, tiny_dataset_dir, tmp_path / "alice", settings(uri, "alice-runs"),
                   credentials("alice"))  # fmt: skip
    bob = Launch(tiny_teacher_dir, tiny_dataset_dir, tmp_path / "bob", settings(uri, "bob-runs"), credentials("bob"))

    # Wrong credentials: refused before the teacher's weights are read, one line naming the user.
    assert wrong.process.wait(timeout=300) != 0
    log = wrong.log_path.read_text()
    bad_credentials = f"error: mlflow: the tracking server at {uri} refused the credentials of user 'alice' (HTTP 401)"
    assert log.count(bad_credentials) == 1, log[-3000:]  # said by rank 0; rank 1 exits with it, quietly
    assert "Traceback" not in log and "frame #" not in log, log[-3000:]
    assert "Loading weights" not in log and not (tmp_path / "wrong" / "metrics.jsonl").exists()

    # Alice: trains, registers (checkpoints and the final student), pulls.
    alice.wait()
    production = client.get_model_version_by_alias(NAME, "production")
    assert production.tags["kind"] == "final"
    pulled = trainer_cli("pull", f"models:/{NAME}@production", str(tmp_path / "pulled"), "--tracking-uri", uri)
    assert pulled.returncode == 0, pulled.stderr[-3000:]
    assert (tmp_path / "pulled" / "model.safetensors").is_file()
    versions = {v.version for v in client.search_model_versions(f"name='{NAME}'")}
    as_user(monkeypatch, "alice", "not-her-password")
    pulled = trainer_cli("pull", f"models:/{NAME}@production", str(tmp_path / "not-pulled"), "--tracking-uri", uri)
    assert pulled.returncode == 2 and pulled.stderr.splitlines()[-1].startswith(bad_credentials), pulled.stderr
    assert "Traceback" not in pulled.stderr and not (tmp_path / "not-pulled").exists()

    # Bob: READ on alice's model. His run finishes; the registry refuses him once per path, in one line each.
    log = bob.wait()
    refused = f"user 'bob' may not register versions of '{NAME}' or move its aliases (HTTP 403"
    assert log.count(refused) >= 1, log[-4000:]
    assert "no more checkpoints are registered in this run" in log  # the checkpoints' registrar gave up at once
    assert "attempt 2/" not in log  # a refusal is not retried like an outage
    assert (tmp_path / "bob" / "student" / "model.safetensors").is_file()
    assert (tmp_path / "bob" / "checkpoints" / "latest").is_file()
    as_user(monkeypatch, "alice")
    assert {v.version for v in client.search_model_versions(f"name='{NAME}'")} == versions
    assert client.get_model_version_by_alias(NAME, "production").version == production.version

    # Bob cannot move @production by hand either; once an admin grants him EDIT on the model, he can.
    as_user(monkeypatch, "bob")
    earlier = min(versions - {production.version}, key=int)  # one of alice's checkpoint versions
    promote = ("promote", NAME, earlier, "production", "--tracking-uri", uri)
    refused_promote = trainer_cli(*promote)
    assert refused_promote.returncode == 1, refused_promote.stderr[-3000:]
    assert refused_promote.stderr.splitlines()[-1] == (
        f"error: promote: {refused} PERMISSION_DENIED): ask the model's owner or an admin for EDIT on it"
    )
    assert client.get_model_version_by_alias(NAME, "production").version == production.version
    auth_server.grant("bob", NAME, "EDIT")
    promoted = trainer_cli(*promote)
    assert promoted.returncode == 0, promoted.stderr[-3000:]
    assert client.get_model_version_by_alias(NAME, "production").version == earlier
    record_fault(
        "registry-permissions",
        fault="a shared registry (mlflow basic-auth): wrong credentials, and a user without permission on the model",
        injected=2,
        kinds={"HTTP 401 at launch": 1, "HTTP 403 on register and alias": 1},
        outcome="wrong credentials: one line, stopped before any weight was read; no permission: one line per "
        "path, no retries, the run finished with its checkpoints and student; @production unmoved",
        data_lost=0,
        stop_s=None,
        recovery_s=None,
        steps_redone=None,
    )


@pytest.mark.full
@pytest.mark.parametrize("may_raise_priority", [True, False], ids=["privileged", "unprivileged"])
def test_a_registration_starved_by_a_busy_node_runs_once_training_ends(
    auth_server: MlflowServer, tmp_path: Path, may_raise_priority: bool
) -> None:
    """While training runs, a registration worker gets only idle CPU time, which a busy node has none of; at the
    end of training it must get the CPU like any process, raised where the user may and restarted where not
    (tests/tracking/starved_registration.py says how). The registry refuses the credentials, so a worker that
    runs at all ends in a second with one line, and the registrar stops: without that end-of-training step the
    worker would get no CPU until the deadline and say nothing."""
    root = os.geteuid() == 0
    if may_raise_priority and not root:
        pytest.skip("raising a process out of SCHED_IDLE needs CAP_SYS_NICE; this user has none")
    script = REPO / "tests" / "tracking" / "starved_registration.py"
    command = [sys.executable, str(script), str(tmp_path), auth_server.uri, "150"]
    if not may_raise_priority and root:
        if shutil.which("setpriv") is None:
            pytest.skip("needs util-linux's setpriv to run without CAP_SYS_NICE")
        # root less CAP_SYS_NICE: what an unprivileged user may do to priorities
        command = ["setpriv", "--bounding-set", "-sys_nice", *command]
    env = {**os.environ, "MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": "not-her-password"}
    env["PYTHONPATH"] = str(REPO)  # this checkout's registrar, whatever the environment has installed
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])

    during = result["during"]
    assert during["worker_running"] and during["policy"] == result["idle_policy"], during  # yielding, as it should
    assert "error" not in during["log"], during  # and, beside a busy loop, getting nowhere
    refused = "error: registering the student of step 10: the registry refused the credentials of user 'alice'"
    assert result["log"].count(refused) == 1, result["log"][-3000:]
    assert result["closed_after_s"] < 120, result  # the worker ran once training ended, not at the deadline (150 s)
    assert result["left"] == ["step-00000010"]  # refused: the snapshot stays, with the command to register it
    assert "register-checkpoints" in done.stderr
