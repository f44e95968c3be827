"""Registered checkpoints (``mlflow.register_checkpoints``): students in the registry while a run trains.

The quick tests check the parts alone: the config's rules, the snapshot that hands a checkpoint over,
which saves are due, and the registry look-ups that keep versions unique and aliases moving forward
(against the real ``mlflow server``). The two launches run the tiny CPU distillation through the real
launcher on two ranks: one with the server up (a version per due save, tagged, pullable after its
checkpoint was deleted; a relaunch of the finished run adds nothing), one that starts while the server
is down, is SIGKILLed and relaunched, and loses the server mid-run in its relaunch (every due save registered
exactly once, in step order; every metric logged while the server was down reaches the run). On the team's
server (PostgreSQL, S3, basic auth), a training loop registers real checkpoints while the database stops and
the store becomes unreachable (docs/mlflow-server.md, "Faults under load").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from conftest import REGISTERED_EXPERIMENT, REGISTERED_MODEL, Launch, assert_metrics_reached_mlflow, registered_settings
from helpers import RunStatuses, failed_attempts, record_fault

from common.atomic import OutOfSpace
from common.config import ConfigError
from trainer.tracking.checkpoints import (
    QUEUE_DIR,
    REQUEST,
    STARTING,
    WORKER_LOG,
    CheckpointRegistrar,
    pending_snapshots,
    remove_snapshot,
    snapshot,
    start_worker,
)
from trainer.tracking.config import MlflowConfig
from trainer.tracking.registry import advance_alias, registered_version


# ------------------------------------------------------------------------------------------ the parts
@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"register_checkpoints": True}, "mlflow.register_checkpoints"),  # no register_as
        ({"register_as": "s", "register_checkpoints": -1}, "mlflow.register_checkpoints"),
        ({"register_as": "s", "checkpoint_alias": "following"}, "mlflow.checkpoint_alias"),  # not registering
        ({"register_as": "s", "register_checkpoints": 2, "checkpoint_alias": "Latest"}, "mlflow.checkpoint_alias"),
        ({"register_as": "s", "register_checkpoints": True, "checkpoint_alias": "v3"}, "mlflow.checkpoint_alias"),
    ],
)
def test_config_names_the_bad_key(settings, key):
    with pytest.raises(ConfigError, match=key):
        MlflowConfig(**settings).validate()


def test_every_kth_save():
    assert MlflowConfig(register_as="s", register_checkpoints=True).checkpoint_every == 1
    assert MlflowConfig(register_as="s", register_checkpoints=3).checkpoint_every == 3
    assert MlflowConfig(register_as="s").checkpoint_every == 0


def fake_checkpoint(root: Path, step: int) -> Path:
    path = root / "checkpoints" / f"step-{step:08d}"
    (path / "hf").mkdir(parents=True)
    (path / "mp_rank_00_model_states.pt").write_bytes(os.urandom(4096))
    (path / "hf" / "config.json").write_text("{}")
    return path


def test_a_snapshot_keeps_the_checkpoint_bytes_after_the_checkpoint_is_deleted(tmp_path):
    checkpoint = fake_checkpoint(tmp_path, 30)
    weights = (checkpoint / "mp_rank_00_model_states.pt").read_bytes()
    queue = tmp_path / QUEUE_DIR
    (queue / ".step-00000030.tmp").mkdir(parents=True)  # what a snapshot killed half way left
    made = snapshot(checkpoint, queue, {"step": 30, "eval/loss": 1.5})
    copy = made / "mp_rank_00_model_states.pt"
    assert os.stat(copy).st_ino == os.stat(checkpoint / "mp_rank_00_model_states.pt").st_ino  # linked, not copied
    for path in sorted(checkpoint.rglob("*"), reverse=True):  # what checkpoint.keep_last does
        path.rmdir() if path.is_dir() else path.unlink()
    checkpoint.rmdir()
    assert copy.read_bytes() == weights and (made / "hf" / "config.json").is_file()
    assert json.loads((made / REQUEST).read_text()) == {"step": 30, "eval/loss": 1.5}
    assert [p.name for p in queue.iterdir()] == ["step-00000030"]  # the leftover replaced, nothing else

    # Oldest first; a snapshot being removed (renamed first) is not pending any more.
    for step in (120, 60, 90):
        snapshot(fake_checkpoint(tmp_path, step), queue, {"step": step})
    assert [p.name for p in pending_snapshots(queue)] == [f"step-{s:08d}" for s in (30, 60, 90, 120)]
    remove_snapshot(queue / "step-00000060")
    assert [p.name for p in pending_snapshots(queue)] == [f"step-{s:08d}" for s in (30, 90, 120)]
    assert not any(p.name.startswith(".") for p in queue.iterdir())


def test_a_snapshot_without_room_or_on_a_read_only_disk_fails_in_one_line_and_leaves_none(tmp_path):
    """On a real filesystem, full and then remounted read-only (we are root: file modes would not stop us)."""
    from helpers import fill, small_tmpfs

    with small_tmpfs(tmp_path / "disk", 4) as disk:
        checkpoint, queue = fake_checkpoint(disk, 30), disk / QUEUE_DIR
        said = f"writing the registration snapshot of step-00000030 into {queue}: "
        then = "; step-00000030 itself is saved: relaunch to resume from it and register it"
        ballast = fill(disk, leave_bytes=0)
        with pytest.raises(OutOfSpace) as full:
            snapshot(checkpoint, queue, {"step": 30})
        assert str(full.value).endswith(f"it needs more room, 0 bytes are free there{then}")
        assert str(full.value).startswith(f"[Errno 28] {said}") and list(queue.iterdir()) == []
        ballast.unlink()
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with pytest.raises(PermissionError) as refused:
            snapshot(checkpoint, queue, {"step": 30})
        tmp = queue / ".step-00000030.tmp"
        assert (
            str(refused.value) == f"[Errno 30] {said}read-only file system ({tmp}): make it writable by this user{then}"
        )
        assert list(queue.iterdir()) == []


class NoRunYet:
    """A tracker whose MLflow run does not exist (yet): the registrar queues and waits, registering nothing."""

    run_id = None
    created = False
    tracking_uri = "http://127.0.0.1:9"


def test_the_registrars_worker_starts_and_forks_take_turns(tmp_path):
    """A process forked while the registrar starts its worker kept Popen's start-up pipe open for its whole life: a
    rank's data-loader worker, forked by the main thread meanwhile, held the registrar in Popen (and its lock) until
    training ended, and the end of training waited on that lock for ever (a killed run's relaunch, under load). A fork
    waits for a start in flight, and a start for a fork in flight (STARTING, taken by os.fork's hooks)."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    children: list = []
    forking = threading.Thread(target=lambda: children.append(fork.Process(target=time.sleep, args=(0,))) or
                               children[0].start())  # fmt: skip
    with STARTING:  # a start in flight
        forking.start()
        forking.join(0.5)
        assert forking.is_alive() and (not children or children[0].pid is None)  # the fork waits for it
    forking.join(30)
    children[0].join(30)
    assert children[0].exitcode == 0

    started: list[subprocess.Popen] = []
    with (tmp_path / "out.log").open("w") as out:
        starting = threading.Thread(target=lambda: started.append(start_worker(["true"], out, dict(os.environ))))
        with STARTING:  # a fork in flight (what os.fork's hook holds while it forks)
            starting.start()
            starting.join(0.5)
            assert starting.is_alive() and not started  # the start waits for it
        starting.join(30)
    assert started[0].wait(timeout=30) == 0


def test_due_saves_are_queued_and_the_last_step_is_left_to_the_end_of_training(tmp_path, capsys):
    cfg = MlflowConfig(register_as="s", register_checkpoints=2, retry_initial_s=0.1)
    registrar = CheckpointRegistrar(cfg, tmp_path, NoRunYet(), save_every_steps=10, max_steps=60)
    for step in (10, 20, 30, 40, 50, 60):  # K=2: every other save; 60 is the last step
        registrar.submit(fake_checkpoint(tmp_path, step), {"step": step})
    assert [p.name for p in pending_snapshots(tmp_path / QUEUE_DIR)] == ["step-00000020", "step-00000040"]
    registrar.close(0.5)  # no run, nothing registered: the end says what is left and how to register it
    err = capsys.readouterr().err
    assert f"Their snapshots stay in {tmp_path / QUEUE_DIR}" in err
    assert "python -m trainer register-checkpoints" in err and "--name s" in err
    assert not registrar.thread.is_alive()


TIMED_OUT = (  # what a worker's client says when the server's SQLite lock wait outlasts its request timeout
    "API request to endpoint /api/2.0/mlflow/model-versions/create failed with exception "
    "HTTPConnectionPool(host='127.0.0.1', port=5000): Read timed out. (read timeout=15)"
)


@pytest.mark.parametrize("through", ["server", "local file", "timeout"])
def test_a_registration_the_database_refused_is_one_line_naming_the_cause_and_the_fix(
    through, tmp_path, monkeypatch, capsys
):
    """SQLite refuses a write that waited past its busy timeout as 'database is locked' (docs/mlflow-server.md
    measures from which load): a server answers 503, which reaches the worker without the body (its client makes
    one attempt per request); a store on a local file says it itself. Either way the worker prints one line that
    names the cause (SQLite's one writer) and the fix (PostgreSQL), and exits to be retried (not as refused); the
    registrar's warning, which quotes the worker's last line, quotes all of it."""
    from mlflow.exceptions import MlflowException

    from trainer.commands import register_checkpoints
    from trainer.tracking.checkpoints import last_line

    def refuse(*args, **kwargs):
        raise MlflowException({"server": SERVER_503, "local file": LOCAL_LOCKED, "timeout": TIMED_OUT}[through])

    snapshot(fake_checkpoint(tmp_path, 10), tmp_path / QUEUE_DIR, {"step": 10})
    monkeypatch.setattr(register_checkpoints, "register_snapshot", refuse)
    rc = register_checkpoints.main([str(tmp_path / QUEUE_DIR), "--name", "s", "--run-id", "r", "--tracking-uri", "x"])
    said = capsys.readouterr().err.strip()
    assert rc == 1  # retried by the registrar, like an outage: not REFUSED
    assert "\n" not in said and "INSERT" not in said and "HTTPConnectionPool" not in said
    assert said.startswith("error: registering the student of step 10: ")
    named = {"server": "503", "local file": "SQLite database is locked", "timeout": "did not answer within"}
    assert named[through] in said
    for part in ("one writer at a time", "PostgreSQL", "launch/mlflow-server.sh", "docs/mlflow-server.md"):
        assert part in said
    (tmp_path / WORKER_LOG).write_text(f"...\n{said}\n")
    assert last_line(tmp_path / WORKER_LOG) == said  # the registrar's warning quotes it whole


# What a register-checkpoints worker got while another connection held the SQLite file of its server locked
SERVER_503 = (
    "API request to http://127.0.0.1:44091/api/2.0/mlflow/model-versions/search failed with exception "
    "HTTPConnectionPool(host='127.0.0.1', port=44091): Max retries exceeded with url: "
    "/api/2.0/mlflow/model-versions/search?filter=name+%3D+%27m%27+and+tags.run_id+%3D+%27b8f2105ebc634669b81157b"
    "dd6b6ce6a%27+and+tags.step+%3D+%272%27&max_results=10000 (Caused by ResponseError('too many 503 error "
    "responses'))"
)
# SQLAlchemy's error, as a store on a local SQLite file raises it
LOCAL_LOCKED = (
    "(sqlite3.OperationalError) database is locked\n[SQL: INSERT INTO model_versions (name, version, "
    "creation_time, last_updated_time, description, user_id, current_stage, source, storage_location, run_id, "
    "run_link, status, status_message) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)]\n(Background on this "
    "error at: https://sqlalche.me/e/20/e3q8)"
)


def test_a_version_is_found_by_run_and_step_and_an_alias_only_moves_forward(mlflow_server):
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server.uri)
    name = "forward-only"
    client.create_registered_model(name)
    versions = {
        (run, step): client.create_model_version(name, "s3://nowhere/student", tags={"run_id": run, "step": str(step)})
        for run, step in (("r1", 10), ("r1", 20), ("r2", 5))
    }
    assert registered_version(client, name, "r1", "20").version == versions["r1", 20].version
    assert registered_version(client, name, "r1", "30") is None
    assert registered_version(client, name, "r2", "10") is None

    assert advance_alias(client, name, "following", versions["r1", 20])
    assert not advance_alias(client, name, "following", versions["r1", 10])  # a late registration of step 10
    assert client.get_model_version_by_alias(name, "following").version == versions["r1", 20].version
    assert advance_alias(client, name, "following", versions["r2", 5])  # another run's: moves
    assert client.get_model_version_by_alias(name, "following").version == versions["r2", 5].version


# --------------------------------------------------------------------------------- through the launcher
def versions_by_step(client, name: str) -> dict[int, list]:
    found: dict[int, list] = {}
    for version in client.search_model_versions(f"name = '{name}'"):
        found.setdefault(int(version.tags["step"]), []).append(version)
    return found


@pytest.mark.full
@pytest.mark.integration
@pytest.mark.parametrize("registry_server", ["sqlite", "team"], indirect=True)
def test_each_due_checkpoint_becomes_a_tagged_version_and_the_newest_is_latest(
    registry_server, registered_run, trainer_cli, tiny_teacher_dir, tiny_dataset_dir, tmp_path, monkeypatch, request
):
    """``registered_run`` (tracking/conftest.py): 12 steps, a checkpoint and a registered version every 3; tracked
    by a SQLite server with local artifacts, and by a team's (PostgreSQL, S3, basic auth: launch/mlflow-server.sh).
    The relaunch of the finished run (a whole launch) runs on the SQLite server only: on the team's, the store's
    part of it, the look-up of the run's version by run and step, is asked directly."""
    from mlflow import MlflowClient
    from transformers import AutoModelForMaskedLM

    from trainer.commands.export import export

    for variable, value in registry_server.client_env.items():  # the team's server: its service account
        monkeypatch.setenv(variable, value)
    uri, name, run = registry_server.uri, REGISTERED_MODEL, registered_run
    client = MlflowClient(uri)
    (tracked,) = client.search_runs([client.get_experiment_by_name(REGISTERED_EXPERIMENT).experiment_id])
    assert tracked.info.status == "FINISHED"
    found = versions_by_step(client, name)
    assert sorted(found) == [3, 6, 9, 12] and all(len(v) == 1 for v in found.values())
    by_step = {step: versions[0] for step, versions in found.items()}
    assert [int(by_step[s].version) for s in (3, 6, 9, 12)] == sorted(int(v.version) for v in by_step.values())
    evals = {r["step"]: r for r in run.records() if "eval/student_mlm_loss" in r}
    for step in (3, 6, 9):
        tags = by_step[step].tags
        assert tags["kind"] == "checkpoint" and by_step[step].run_id == tracked.info.run_id
        assert (tags["samples"], tags["tokens"]) == (str(step * 8), str(step * 8 * 64))
        assert tags["eval_step"] == str(step)
        assert tags["eval/student_mlm_loss"] == f"{evals[step]['eval/student_mlm_loss']:.6g}"
        assert tags["teacher"] == tracked.data.tags["teacher"]
    assert by_step[12].tags["kind"] == "final"
    assert client.get_model_version_by_alias(name, "candidate").version == by_step[12].version
    assert client.get_model_version_by_alias(name, "following").version == by_step[12].version

    # models:/NAME@latest is the newest: the final student.
    def pull(uri_: str) -> dict[str, torch.Tensor]:
        dest = tmp_path / f"pulled-{len(list(tmp_path.glob('pulled-*')))}"
        done = trainer_cli("pull", uri_, str(dest), "--tracking-uri", uri)
        assert done.returncode == 0, done.stderr[-3000:]
        return AutoModelForMaskedLM.from_pretrained(dest).state_dict()

    def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    final = AutoModelForMaskedLM.from_pretrained(run.output_dir / "student").state_dict()
    assert same(pull(f"models:/{name}@latest"), final)
    if registry_server.artifacts.startswith("s3://"):  # the team's: the students' bytes are in the object store
        bucket, prefix = registry_server.artifacts.removeprefix("s3://").split("/", 1)
        listed = request.getfixturevalue("moto_server").client().get_paginator("list_objects_v2")
        keys = [o["Key"] for page in listed.paginate(Bucket=bucket, Prefix=prefix) for o in page.get("Contents", [])]
        assert sum(key.endswith(".safetensors") for key in keys) >= 4, keys
    # Step 9's checkpoint is still on disk (keep_last 2): its version holds exactly its student.
    checkpoints = run.output_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000009", "step-00000012"]
    step9 = AutoModelForMaskedLM.from_pretrained(export(checkpoints / "step-00000009", tmp_path / "s9")).state_dict()
    assert same(pull(f"models:/{name}/{by_step[9].version}"), step9)
    # Step 3's was deleted long ago; its version stays complete, and is another student.
    assert not same(pull(f"models:/{name}/{by_step[3].version}"), step9)
    assert not (run.output_dir / QUEUE_DIR).exists() or not pending_snapshots(run.output_dir / QUEUE_DIR)

    # A relaunch finds the version of the run's last step (the look-up that keeps it from registering it again) ...
    assert registered_version(client, name, tracked.info.run_id, "12").version == by_step[12].version
    if registry_server.app_name == "basic-auth":
        return  # ... and what it does with it is the same on any store: the SQLite server's relaunch shows it.
    # The finished run relaunched: it resumes at its last step and registers nothing new.
    again = Launch(
        tiny_teacher_dir,
        tiny_dataset_dir,
        run.output_dir,
        registered_settings(registry_server),
        registry_server.client_env,
    )
    assert "resumed from step 12" in again.wait()
    assert {s: len(v) for s, v in versions_by_step(client, name).items()} == {3: 1, 6: 1, 9: 1, 12: 1}


def rank_processes(launcher_pid: int) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(launcher_pid).children(recursive=True)
        if any(a.startswith("--local_rank=") for a in p.cmdline())
        and "deepspeed.launcher.launch" in " ".join(p.parent().cmdline())
    ]


def console_steps(log_path: Path, max_steps: int) -> list[int]:
    """The steps a launch's rank 0 has printed so far (``step N/MAX | ...``: a train or an eval record)."""
    return [int(step) for step in re.findall(rf"^step (\d+)/{max_steps} \|", log_path.read_text(), re.MULTILINE)]


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.mark.full
@pytest.mark.integration
def test_registrations_survive_a_server_outage_and_a_killed_run_without_duplicates(
    mlflow_server, launch_tiny_distillation
):
    """Two outages of the tracking server, training going on through each. The first launch starts while the server
    is down: its run is created late, its due saves queue and are registered once the server is back; rank 0 is then
    SIGKILLed with saves still queued or in flight. The relaunch resumes into the same run and loses the server
    mid-run: its metrics wait in memory and reach the run once the server is back, the console warning once, and
    saying so. In the end every due save is one version, in step order, and the run is FINISHED. (The mid-run outage
    was a launch and a relaunch of its own in test_end_to_end; here it costs one more server restart.)"""
    from mlflow import MlflowClient

    uri, name = mlflow_server.uri, "outage-student"
    settings = ["checkpoint.every_steps=3", "checkpoint.keep_last=1", "eval.every_steps=6", "logging.every_steps=1",
                f"mlflow.tracking_uri={uri}", "mlflow.experiment=registered-outage", f"mlflow.register_as={name}",
                "mlflow.register_checkpoints=4", "mlflow.retry_max_s=2"]  # fmt: skip
    # A save due every 12 steps: while the registry's worker starts (on idle CPU only, the ranks busy), the run trains
    # on for a hundred steps or more, and each due save queued meanwhile is a version the relaunch registers at its end
    # (about a second each): 12, not 6, halves them.
    client = MlflowClient(uri)
    mlflow_server.stop()
    try:  # The run starts with the registry down, not waiting for it: its due saves (every 12 steps) queue up.
        run = launch_tiny_distillation("max_steps=5000", *settings, "mlflow.start_timeout_s=0")  # killed before its end
        queue = run.output_dir / QUEUE_DIR
        deadline = time.monotonic() + 300
        while len(pending_snapshots(queue)) < 2:
            assert run.process.poll() is None, run.log_path.read_text()[-6000:]
            assert time.monotonic() < deadline, "no checkpoints were queued"
            time.sleep(0.2)
    finally:
        mlflow_server.start()
    # The registry is back while the run trains: what was queued is registered, oldest first.
    deadline = time.monotonic() + 300
    while not {12, 24} <= set(versions_by_step(client, name)):
        assert run.process.poll() is None, run.log_path.read_text()[-6000:]
        assert time.monotonic() < deadline, (run.output_dir / "registering.log").read_text()[-4000:]
        time.sleep(0.5)
    # The run, created late, holds every step logged so far, also those logged before it existed.
    (tracked,) = client.search_runs([client.get_experiment_by_name("registered-outage").experiment_id])
    run_id, sent = tracked.info.run_id, max(r["step"] for r in run.records())

    def steps_on_server() -> set[int]:
        return {m.step for m in client.get_metric_history(run_id, "train/loss")}

    wait_for(lambda: set(range(1, sent + 1)) <= steps_on_server(), 120, f"steps up to {sent} not on the server")

    # SIGKILL rank 0 (the registrar's process) with saves still queued or in flight; relaunch to a near end.
    rank0 = [p for p in rank_processes(run.process.pid) if "--local_rank=0" in p.cmdline()]
    assert len(rank0) == 1
    os.kill(rank0[0].pid, signal.SIGKILL)
    assert run.process.wait(timeout=120) != 0
    assert "unreachable" in run.log_path.read_text()  # (the relaunch writes the same console file)
    killed_records = run.records()  # sent or not (the relaunch cuts metrics.jsonl back to its resume step)
    # Killed, the run stays RUNNING: logging the checkpoints' models into it never marked it finished.
    assert client.get_run(run_id).info.status == "RUNNING"
    killed_at = int((run.output_dir / "checkpoints" / "latest").read_text().split("-")[1])
    # Two more due saves in the relaunch, and steps enough to train on through its outage: they cost next to no
    # time, as its end waits for the server's restart anyway.
    end = killed_at + 25
    # The relaunch waits for the run at its start (mlflow.start_timeout_s's default): it trains into the resumed run.
    resumed = launch_tiny_distillation(f"max_steps={end}", *settings)

    def trained() -> list[int]:  # the relaunch's steps so far; it trains on
        assert resumed.process.poll() is None, resumed.log_path.read_text()[-6000:]
        return console_steps(resumed.log_path, end)

    try:  # Once it has trained a step, the server goes away: a mid-run outage.
        deadline = time.monotonic() + 600
        while not trained():
            assert time.monotonic() < deadline, "the relaunch trained no step"
            time.sleep(0.2)
        mlflow_server.stop()
        down_after = max(trained())
        # Training goes on without the server: three more steps at least.
        while max(trained()) < down_after + 3:
            time.sleep(0.2)
        logged_while_down = sorted({s for s in console_steps(resumed.log_path, end) if s > down_after})
    finally:
        mlflow_server.start()  # same port, SQLite file and artifact directory
    log = resumed.wait()
    assert f"resumed from step {killed_at}" in log
    assert log.count(f"tracking server {uri} unreachable") == 1  # warned once, not once per step
    assert "reachable again" in log

    found = versions_by_step(client, name)
    due = [step for step in range(12, end, 12)]
    assert sorted(found) == [*due, end], (found.keys(), killed_at)
    assert all(len(versions) == 1 for versions in found.values()), {s: len(v) for s, v in found.items()}
    in_order = [int(found[step][0].version) for step in sorted(found)]
    assert in_order == sorted(in_order)  # registered in step order, the final student last
    assert client.get_model_version_by_alias(name, "latest").tags["step"] == str(end)
    assert not pending_snapshots(queue)
    (again,) = client.search_runs([client.get_experiment_by_name("registered-outage").experiment_id])
    assert again.info.run_id == run_id and again.info.status == "FINISHED"

    # Every value the relaunch logged reached the run, those logged while the server was down too; besides them the
    # run holds only values the killed launch logged: every step up to `sent`, and what it sent after that before it
    # died (a SIGKILL loses what was still in memory: metrics.jsonl keeps it), exactly (assert_metrics_reached_mlflow).
    relaunched = [r for r in run.records() if r["step"] > killed_at]
    assert max(r["step"] for r in relaunched) == end
    assert_metrics_reached_mlflow(client, run_id, relaunched, killed=killed_records)
    on_server = steps_on_server()
    assert set(logged_while_down) <= on_server and len(logged_while_down) >= 3
    assert set(range(1, sent + 1)) | set(range(killed_at + 1, end + 1)) <= on_server <= set(range(1, end + 1))


# ------------------------------------------------------------------------ faults under load, on the team's server
@pytest.mark.full
@pytest.mark.integration
def test_registrations_under_faults_wait_retry_and_land_once_each_in_order_while_training_never_waits(
    team_mlflow_server, postgres, team_s3, tiny_checkpoint_dir, tmp_path, monkeypatch
):
    """The faults of the retired benchmarks/registry_load.py at a test's size: a training loop hands a real checkpoint
    to the registrar every 10 steps on the team's server. PostgreSQL is stopped before the first is due and started
    once a registration has failed on it; then S3 is unreachable (``team_s3`` refuses every connection) until a
    registration has failed on that. Every due step becomes one version, tagged, in step order; the loop spends a
    negligible share of its time inside the registrar; the run reads RUNNING while it trains and FINISHED once it
    ends."""
    from mlflow import MlflowClient

    server, name, due = team_mlflow_server, "faulted-student", (10, 20)
    # The workers at the normal policy, not SCHED_IDLE: on this machine other jobs keep both cores busy, and an
    # idle-time worker would not run before the end of training (test_registry_auth's starved registration).
    monkeypatch.setattr("trainer.tracking.checkpoints.yield_to_training", lambda pid: None)
    for key, value in server.client_env.items():
        monkeypatch.setenv(key, value)  # the registrar's workers sign in as the team's account
    client = MlflowClient(server.uri)
    run_id = client.create_run(client.create_experiment("registry-faults")).info.run_id
    statuses = RunStatuses(server.backend)
    statuses.watch(run_id)
    cfg = MlflowConfig(register_as=name, register_checkpoints=True, checkpoint_alias="following",
                       retry_initial_s=0.5, retry_max_s=2.0)  # fmt: skip
    run = SimpleNamespace(run_id=run_id, created=True, tracking_uri=server.uri)
    registrar = CheckpointRegistrar(cfg, tmp_path, run, save_every_steps=10, max_steps=10**6)
    log = tmp_path / WORKER_LOG
    failed: dict[str, int] = {}
    injector_error: list[BaseException] = []

    def inject() -> None:  # PostgreSQL is down already (below); each fault lasts until a registration failed on it
        try:
            wait_for(lambda: failed_attempts(log) >= 1, 120, "no registration failed while PostgreSQL was down")
            failed["PostgreSQL stopped"] = failed_attempts(log)
            postgres.start()
            team_s3.down()
            wait_for(lambda: failed_attempts(log) > failed["PostgreSQL stopped"], 120, "none failed without S3")
            failed["S3 unreachable"] = failed_attempts(log) - failed["PostgreSQL stopped"]
        except BaseException as err:
            injector_error.append(err)
        finally:  # the session's team server goes on serving other tests
            if not postgres.running:
                postgres.start()
            team_s3.restore()

    postgres.stop()
    injector = threading.Thread(target=inject)
    injector.start()
    weights, x = torch.randn(256, 256) / 16, torch.randn(64, 256)
    step, inside, started = 0, 0.0, time.perf_counter()
    while step < due[-1] or injector.is_alive():  # training: it goes on as long as the faults last
        step += 1
        x = torch.tanh(x @ weights)  # the step's work on the host; then it waits for the device
        time.sleep(0.02)
        if step in due:
            made = tmp_path / "checkpoints" / f"step-{step:08d}"
            shutil.copytree(tiny_checkpoint_dir, made, copy_function=os.link)  # the trainer's save
            handed = time.perf_counter()
            registrar.submit(made, {"step": step, "samples": 8 * step})
            inside += time.perf_counter() - handed
    training_s = time.perf_counter() - started
    injector.join()
    assert not injector_error, injector_error
    registrar.close(300)  # the end of training: waits for the queue
    statuses.unwatch(run_id)
    client.set_terminated(run_id)
    statuses.stop()

    found = versions_by_step(client, name)
    worker_log = log.read_text()[-4000:]
    assert {step: len(versions) for step, versions in found.items()} == dict.fromkeys(due, 1), worker_log
    in_order = [int(found[step][0].version) for step in due]
    assert in_order == sorted(in_order)
    assert all(found[s][0].tags["kind"] == "checkpoint" and found[s][0].tags["samples"] == str(8 * s) for s in due)
    assert client.get_model_version_by_alias(name, "following").tags["step"] == str(due[-1])
    assert not pending_snapshots(tmp_path / QUEUE_DIR)
    assert failed["PostgreSQL stopped"] >= 1 and failed["S3 unreachable"] >= 1  # waited, retried
    share = inside / training_s
    assert share < 0.01, (inside, training_s)  # a submit is a snapshot of hard links: milliseconds
    assert statuses.seen[run_id] == {"RUNNING"}
    assert client.get_run(run_id).info.status == "FINISHED"
    record_fault(
        "registry-faults-under-load",
        fault="the team's registry while a run trains (PostgreSQL, S3, basic auth): PostgreSQL stopped, then S3 "
        "unreachable, each until a registration failed on it",
        injected=2,
        kinds={"PostgreSQL stopped": 1, "S3 unreachable": 1},
        outcome=f"{len(due)} due checkpoints registered once each, tagged, in step order, after "
        f"{failed_attempts(log)} failed attempts retried; the loop's time inside the registrar {share:.3%} of "
        f"{training_s:.0f} s of training; the run RUNNING while it trained, FINISHED at its end",
        data_lost=0,
        stop_s=None,
        recovery_s=None,
        steps_redone=None,
    )
