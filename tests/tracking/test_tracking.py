"""The Tracker against a real MLflow server, against no server at all, and with tracking off."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from common.config import flatten, load_config, to_dict
from trainer.commands.run_record import dataset_fingerprint, training_run_spec
from trainer.config import TrainConfig
from trainer.tracking.registry import register_or_explain
from trainer.tracking.tracker import NullTracker, Tracker, start_tracker

REPO = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, manifest: dict, **mlflow: object) -> tuple[Path, TrainConfig]:
    """A config file with a ``base:`` parent and a dataset manifest on disk."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"max_steps": 7, "logging": {"every_steps": 1}}))
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "base": "base.yaml",
                "teacher": "some/teacher",
                "data": str(data),
                "output_dir": str(tmp_path / "out"),
                "mlflow": mlflow,
            }
        )
    )
    return config, load_config(TrainConfig, config)


def start(
    cfg: TrainConfig,
    config_path: Path,
    *,
    rank: int = 0,
    world_size: int = 1,
    resume_run_id: str | None = None,
    deepspeed_config: dict | None = None,
) -> Tracker | NullTracker:
    """The tracker as ``train`` starts it."""
    return start_tracker(
        cfg.mlflow,
        rank=rank,
        world_size=world_size,
        resume_run_id=resume_run_id,
        run_spec=lambda: training_run_spec(cfg, str(config_path), deepspeed_config or {}, world_size),
    )


DS_CONFIG = {"zero_optimization": {"stage": 2}, "train_batch_size": 8}
MANIFEST = {
    "format_version": 1,
    "tokenizer": {"name_or_path": "t", "vocab_size": 10, "special_token_ids": {}, "fingerprint": "abc"},
    "splits": {"train": {"samples": 3, "tokens": 9, "shards": [{"path": "train/shard-000000.tar", "sha256": "f00"}]}},
}


@pytest.mark.integration
def test_run_records_config_metrics_tags_artifacts_and_resumes(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    config_path, cfg = write_config(
        tmp_path,
        MANIFEST,
        tracking_uri=mlflow_server.uri,
        experiment="tracking-test",
        run_name="first",
        system_metrics_interval_s=0.2,
    )
    tracker = start(cfg, config_path, world_size=2, deepspeed_config=DS_CONFIG)
    assert isinstance(tracker, Tracker)
    assert tracker.run_id is not None  # created during start: the first checkpoint can store it
    for step in range(1, 6):
        tracker.log_metrics({"loss": 10.0 / step, "lr": 1e-4 * step}, step)
    time.sleep(0.5)  # let a few system samples accumulate
    tracker.finish({"eval/mlm_accuracy": 0.25})

    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "first"
    assert client.get_experiment(run.info.experiment_id).name == "tracking-test"
    expected = {key: str(value) for key, value in flatten(to_dict(cfg)).items()}
    assert {k: run.data.params[k] for k in expected} == expected
    assert run.data.params["world_size"] == "2"
    tags = run.data.tags
    assert tags["teacher"] == "some/teacher"
    assert tags["dataset_fingerprint"] == dataset_fingerprint(MANIFEST)
    assert tags["tokenizer_fingerprint"] == "abc"
    assert tags["world_size"] == "2"
    assert tags["deepspeed_stage"] == "2"
    assert len(tags["git_commit"]) == 40
    history = client.get_metric_history(tracker.run_id, "loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(s, 10.0 / s) for s in range(1, 6)]
    assert run.data.metrics["eval/mlm_accuracy"] == 0.25
    node = tracker.delivery.node
    system = [key for key in run.data.metrics if key.startswith(f"system/{node}/")]
    assert f"system/{node}/cpu_utilization_percentage" in system
    assert f"system/{node}/system_memory_usage_megabytes" in system
    artifacts = {a.path for d in ("config", "deepspeed", "dataset") for a in client.list_artifacts(tracker.run_id, d)}
    assert artifacts == {
        "config/run.yaml",
        "config/base.yaml",
        "config/resolved.yaml",
        "deepspeed/ds_config.json",
        "dataset/manifest.json",
    }
    resolved = Path(client.download_artifacts(tracker.run_id, "config/resolved.yaml", str(tmp_path)))
    assert yaml.safe_load(resolved.read_text()) == to_dict(cfg)
    ds_config = Path(client.download_artifacts(tracker.run_id, "deepspeed/ds_config.json", str(tmp_path)))
    assert json.loads(ds_config.read_text()) == DS_CONFIG

    # A relaunch that resumes from a checkpoint appends to the same run, even with a changed max_steps.
    cfg.max_steps = 9
    resumed = start(cfg, config_path, world_size=2, resume_run_id=tracker.run_id)
    assert resumed.run_id == tracker.run_id
    resumed.log_metrics({"loss": 1.0}, 6)
    resumed.finish({})
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["max_steps"] == "7"  # MLflow params are immutable; the original stays
    assert sorted(m.step for m in client.get_metric_history(tracker.run_id, "loss")) == [1, 2, 3, 4, 5, 6]
    assert len(client.search_runs([run.info.experiment_id])) == 1


@pytest.mark.integration
def test_a_run_whose_new_experiment_another_run_created_meanwhile_is_created(mlflow_server, monkeypatch):
    """A run looks its experiment up, finds none, and another run starting at once creates it before this one
    does: the creation is refused (it exists), which skipped the run. Task distillation's parent and first stage
    did so when they did not wait for the server. The interleaving is made here, on the real server."""
    import mlflow
    from mlflow import MlflowClient

    from trainer.tracking.config import MlflowConfig
    from trainer.tracking.tracker import RunSpec

    uri = mlflow_server.uri

    class CreatedMeanwhile(MlflowClient):
        def get_experiment_by_name(self, name: str):
            found = super().get_experiment_by_name(name)
            if found is None:  # the other run, between this lookup and this run's creation
                MlflowClient(uri).create_experiment(name)
            return found

    monkeypatch.setattr(mlflow, "MlflowClient", CreatedMeanwhile)  # what the delivery thread connects with
    tracker = Tracker(MlflowConfig(tracking_uri=uri, system_metrics=False), spec=RunSpec(experiment="meanwhile"))
    tracker.finish({})
    client = MlflowClient(uri)
    assert tracker.run_id is not None
    assert client.get_run(tracker.run_id).info.experiment_id == client.get_experiment_by_name("meanwhile").experiment_id


@pytest.mark.full
def test_a_run_created_before_its_parent_run_is_nested_once_the_parent_exists(mlflow_server):
    """Task distillation opens its parent run and then a run per stage, each created by its own background
    thread. With the server down at the start, both are created when it is back, in either order: here the
    stage first (the parent reaches the server through a proxy that stays cut off until the stage's run
    exists). It is nested all the same, under the parent's id once that exists."""
    from helpers import TcpProxy
    from mlflow import MlflowClient

    from trainer.tracking.config import MlflowConfig
    from trainer.tracking.tracker import RunSpec

    proxy = TcpProxy(mlflow_server.port)
    proxy.down()
    mlflow_server.stop()
    try:
        late = MlflowConfig(tracking_uri=proxy.url, system_metrics=False, retry_initial_s=0.5, retry_max_s=0.5)
        soon = MlflowConfig(tracking_uri=mlflow_server.uri, system_metrics=False, retry_initial_s=0.2, retry_max_s=0.4)
        parent = Tracker(late, spec=RunSpec(experiment="nested-late", run_name="parent"))
        stage = Tracker(soon, spec=RunSpec(experiment="nested-late", run_name="stage"), parent=parent)
        assert parent.delivery.first_attempt.wait(30) and stage.delivery.first_attempt.wait(30)
        assert parent.run_id is None and stage.run_id is None  # nothing listens: neither run exists yet
    finally:
        mlflow_server.start()
    deadline = time.monotonic() + 60
    while stage.run_id is None:  # the stage's run is created first ...
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert parent.run_id is None
    proxy.restore()  # ... then the parent's, while the stage waits to be nested
    stage.log_metrics({"train/loss": 1.0}, 1)
    stage.finish({})
    parent.finish({})
    client = MlflowClient(mlflow_server.uri)
    parent_run, stage_run = client.get_run(parent.run_id), client.get_run(stage.run_id)
    assert stage_run.info.start_time < parent_run.info.start_time  # the stage's run was created first
    assert stage_run.data.tags["mlflow.parentRunId"] == parent.run_id
    assert "mlflow.parentRunId" not in parent_run.data.tags and stage_run.data.metrics["train/loss"] == 1.0


def test_dead_server_never_blocks_training(tmp_path, dead_tracking_uri, tiny_student_dir, capsys):
    """Nothing listens at the tracking URI: training calls return promptly, nothing raises, and the
    end of training prints the one command that registers the student later."""
    config_path, cfg = write_config(
        tmp_path,
        MANIFEST,
        tracking_uri=dead_tracking_uri,
        register_as="student",
        alias="candidate",
        finish_timeout_s=2.0,
        retry_initial_s=0.1,
    )
    began = time.monotonic()
    tracker = start(cfg, config_path)
    assert tracker.run_id is None
    for step in range(1, 2001):
        tracker.log_metrics({"loss": 1.0, "lr": 0.1}, step)
    tracker.finish({"eval/mlm_loss": 2.0})
    register_or_explain(tiny_student_dir, cfg.mlflow, tracker)  # what train does after finish
    # MLflow's default client would retry each request for ~4 minutes; the tracker gives up in ~2 s.
    assert time.monotonic() - began < 30
    err = capsys.readouterr().err
    command = f"python -m trainer register {tiny_student_dir} --name student --alias candidate"
    assert f"{command} --tracking-uri {dead_tracking_uri}\n" in err


def test_a_process_that_records_nothing_gets_a_null_tracker(tmp_path, monkeypatch):
    """Tracking off, or a rank other than 0 with no system metrics to add: a NullTracker. It starts no
    thread, never makes the run spec, and writes nothing (no mlflow.db, no mlruns/ in the working directory)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _, cfg = write_config(tmp_path, MANIFEST, enabled=False)
    before = set(tmp_path.iterdir())
    threads = set(threading.enumerate())

    def no_spec() -> None:
        raise AssertionError("a process that records nothing never makes the run spec")

    off = start_tracker(cfg.mlflow, rank=0, world_size=1, resume_run_id=None, run_spec=no_spec)
    cfg.mlflow.enabled, cfg.mlflow.system_metrics = True, False
    other_rank = start_tracker(cfg.mlflow, rank=1, world_size=2, resume_run_id=None, run_spec=no_spec)
    for tracker in (off, other_rank):
        assert isinstance(tracker, NullTracker)
        assert tracker.run_id is None and tracker.tracking_uri == "sqlite:///mlflow.db"
        tracker.log_metrics({"loss": 1.0}, 1)
        tracker.finish({"eval/mlm_loss": 2.0})
    assert set(threading.enumerate()) == threads
    assert set(tmp_path.iterdir()) == before
