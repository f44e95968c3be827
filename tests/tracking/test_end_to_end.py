"""The tiny CPU distillation through the real launcher, tracked by a real MLflow server.

One run is tracked, registered, promoted, pulled and fine-tuned as a downstream team would. A run that loses its
tracking server mid-run and trains on, its metrics reaching the server once it is back, is
test_registered_checkpoints' outage test (its relaunch).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REGISTERED_EXPERIMENT, REGISTERED_MODEL, assert_metrics_reached_mlflow

from common.config import flatten, load_config, to_dict
from trainer.commands.run_record import dataset_fingerprint
from trainer.config import TrainConfig

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "tests" / "data" / "docs-classification.jsonl"


@pytest.mark.full
@pytest.mark.parametrize("registry_server", ["sqlite"], indirect=True)  # the team's: test_registered_checkpoints
def test_distilled_student_is_tracked_registered_pulled_and_finetuned(
    registry_server, registered_run, trainer_cli, tiny_teacher_dir, tiny_dataset_dir, tmp_path
):
    """``registered_run`` (tracking/conftest.py): 12 steps, tracked, its checkpoints and final student registered."""
    from mlflow import MlflowClient
    from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification

    from trainer.finetuning.finetune import FinetuneConfig, finetune

    uri, run = registry_server.uri, registered_run
    client = MlflowClient(uri)
    (tracked,) = client.search_runs([client.get_experiment_by_name(REGISTERED_EXPERIMENT).experiment_id])
    run_id = tracked.info.run_id
    assert tracked.info.status == "FINISHED"

    # Params: the resolved config, flattened. Tags: what the run was made of.
    cfg = load_config(TrainConfig, REPO / "configs" / "tiny-cpu.yaml", run.overrides)
    expected = {key: str(value) for key, value in flatten(to_dict(cfg)).items()}
    assert tracked.data.params == {**expected, "world_size": "2"}
    manifest = json.loads((tiny_dataset_dir / "manifest.json").read_text())
    tags = tracked.data.tags
    assert tags["teacher"] == str(tiny_teacher_dir)
    assert tags["dataset_fingerprint"] == dataset_fingerprint(manifest)
    assert (tags["world_size"], tags["deepspeed_stage"]) == ("2", "2")
    is_commit = subprocess.run(["git", "cat-file", "-e", f"{tags['git_commit']}^{{commit}}"], cwd=REPO)
    assert len(tags["git_commit"]) == 40 and is_commit.returncode == 0

    # Metrics: exactly what the loop wrote to metrics.jsonl, plus this node's system metrics.
    records = run.records()
    assert max(r["step"] for r in records) == 12
    assert_metrics_reached_mlflow(client, run_id, records)
    assert any(k.startswith("system/") and k.endswith("/cpu_utilization_percentage") for k in tracked.data.metrics)
    assert any(k.startswith("system/") and k.endswith("/system_memory_usage_megabytes") for k in tracked.data.metrics)

    # Artifacts: the config files (with the preset it inherits from), the DeepSpeed config, the manifest.
    listed = {a.path for d in ("config", "deepspeed", "dataset") for a in client.list_artifacts(run_id, d)}
    assert listed == {"config/tiny-cpu.yaml", "config/distilbert-base.yaml", "config/resolved.yaml",
                      "deepspeed/ds_config.json", "dataset/manifest.json"}  # fmt: skip
    fetched = Path(client.download_artifacts(run_id, "", str(tmp_path / "artifacts")))
    assert json.loads((fetched / "dataset" / "manifest.json").read_text()) == manifest
    ds_config = json.loads((fetched / "deepspeed" / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == 2 and ds_config["train_batch_size"] == 8
    assert yaml.safe_load((fetched / "config" / "resolved.yaml").read_text()) == to_dict(cfg)

    # The registered version: linked to the run, tagged, aliased; promotion is one command.
    version = client.get_model_version_by_alias(REGISTERED_MODEL, "candidate")
    assert version.run_id == run_id
    last_eval = [r for r in records if "eval/student_mlm_accuracy" in r][-1]
    assert version.tags["teacher"] == str(tiny_teacher_dir)
    assert version.tags["dataset_fingerprint"] == dataset_fingerprint(manifest)
    assert version.tags["step"] == "12" and version.tags["kind"] == "final"
    assert version.tags["eval/student_mlm_accuracy"] == f"{last_eval['eval/student_mlm_accuracy']:.6g}"
    done = trainer_cli("promote", REGISTERED_MODEL, version.version, "champion", "--tracking-uri", uri)
    assert done.returncode == 0, done.stderr[-3000:]
    assert client.get_model_version_by_alias(REGISTERED_MODEL, "champion").version == version.version

    # Pulled by alias: both auto classes load it, with the trained weights.
    pulled = tmp_path / "pulled"
    done = trainer_cli("pull", f"models:/{REGISTERED_MODEL}@champion", str(pulled), "--tracking-uri", uri)
    assert done.returncode == 0, done.stderr[-3000:]
    exported = AutoModelForMaskedLM.from_pretrained(run.output_dir / "student").state_dict()
    student = AutoModelForMaskedLM.from_pretrained(pulled).state_dict()
    assert exported.keys() == student.keys()
    assert all(torch.equal(exported[k], student[k]) for k in exported)
    classifier = AutoModelForSequenceClassification.from_pretrained(pulled, num_labels=2)
    embeddings = exported["bert.embeddings.word_embeddings.weight"]
    assert torch.equal(classifier.bert.embeddings.word_embeddings.weight, embeddings)

    # A short fine-tune from the registered student, tracked in its own experiment.
    args = [f"model=models:/{REGISTERED_MODEL}@champion", f"data={DOCS}", f"output_dir={tmp_path / 'finetune'}",
            "epochs=1", "max_seq_len=64", f"mlflow.tracking_uri={uri}"]  # fmt: skip
    finetuned = finetune(load_config(FinetuneConfig, None, args))
    assert finetuned["total"] == 60 and finetuned["source"]["version"] == version.version
    (ft_run,) = client.search_runs([client.get_experiment_by_name("finetune").experiment_id])
    assert ft_run.info.status == "FINISHED"
    assert ft_run.data.metrics["eval/accuracy"] == finetuned["accuracy"]
    assert ft_run.data.tags["source_version"] == version.version
