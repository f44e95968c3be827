"""Register, promote and pull students through the CLI against a real MLflow server."""

from __future__ import annotations

import json

import pytest
import torch

from common.config import ConfigError


@pytest.mark.full
@pytest.mark.integration
def test_register_promote_and_pull(mlflow_server, tiny_student_dir, tmp_path, trainer_cli):
    import mlflow
    from mlflow import MlflowClient
    from mlflow.entities import Metric, RunTag
    from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification, AutoTokenizer

    from trainer.tracking.pull import pull
    from trainer.tracking.registry import register_student

    uri = mlflow_server.uri
    client = MlflowClient(uri)
    experiment = client.create_experiment("registry-test")
    run = client.create_run(experiment, tags={"teacher": "bert-base-uncased", "dataset_fingerprint": "d00d"})
    run_id = run.info.run_id
    client.log_batch(
        run_id,
        metrics=[Metric("train/loss", 3.0, 0, 40), Metric("eval/mlm_accuracy", 0.375, 0, 40)],
        tags=[RunTag("git_commit", "c0ffee")],
    )

    # The command the trainer prints when registration fails at the end of training.
    name = "students-test"
    done = trainer_cli(
        "register", str(tiny_student_dir), "--name", name, "--alias", "candidate", "--run-id", run_id,
        "--tracking-uri", uri,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    first = client.get_model_version_by_alias(name, "candidate")
    assert first.version == "1" and first.run_id == run_id
    assert first.tags["teacher"] == "bert-base-uncased"
    assert first.tags["dataset_fingerprint"] == "d00d"
    assert first.tags["git_commit"] == "c0ffee"
    assert first.tags["step"] == "40"
    assert first.tags["eval/mlm_accuracy"] == "0.375"

    done = trainer_cli("promote", name, "1", "champion", "--tracking-uri", uri)
    assert done.returncode == 0, done.stderr[-3000:]
    second = register_student(tiny_student_dir, name=name, alias="candidate", run_id=None, tracking_uri=uri)
    assert second.version == "2"
    assert client.get_model_version_by_alias(name, "candidate").version == "2"  # the alias moved
    assert client.get_model_version_by_alias(name, "champion").version == "1"  # promotion stays put

    dest = tmp_path / "pulled"
    done = trainer_cli("pull", f"models:/{name}@champion", str(dest), "--tracking-uri", uri)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"models:/{name}@champion (version 1)" in done.stdout
    assert json.loads((dest / "mlflow_source.json").read_text())["version"] == "1"
    original = AutoModelForMaskedLM.from_pretrained(tiny_student_dir)
    pulled = AutoModelForMaskedLM.from_pretrained(dest)
    for key, value in original.state_dict().items():
        assert torch.equal(value, pulled.state_dict()[key]), key
    classifier = AutoModelForSequenceClassification.from_pretrained(dest, num_labels=2)
    tokenizer = AutoTokenizer.from_pretrained(dest)
    logits = classifier(**tokenizer(["a pulled student"], return_tensors="pt")).logits
    assert logits.shape == (1, 2)
    layer = original.bert.encoder.layer[1].output.dense.weight
    assert torch.equal(classifier.bert.encoder.layer[1].output.dense.weight, layer)

    # The evaluation suite pulls a registered model into its work_dir; a second suite with the same work_dir
    # pulls it again (the alias may have moved), where `pull` alone refuses a directory that is not empty.
    from common.config import load_config
    from trainer.evaluation.suite import SuiteConfig, local_model

    suite = load_config(SuiteConfig, None, [f"models=[models:/{name}@candidate]", f"mlflow.tracking_uri={uri}"])
    for _ in range(2):
        local = local_model(suite, suite.models[0], tmp_path / "suite-work" / "model-0" / "base")
        assert (
            json.loads((tmp_path / "suite-work" / "model-0" / "base" / "mlflow_source.json").read_text())["version"]
            == "2"
        )
    assert local == str(tmp_path / "suite-work" / "model-0" / "base")

    # The other URI form, MLflow's own loader, and the errors a user can make.
    by_version = pull(f"models:/{name}/2", tmp_path / "by-version", uri)
    assert json.loads((by_version / "mlflow_source.json").read_text())["version"] == "2"
    mlflow.set_tracking_uri(uri)
    fill_mask = mlflow.transformers.load_model(f"models:/{name}@candidate")
    predictions = fill_mask("the capital of france is [MASK].")
    assert len(predictions) == 5 and all(p["sequence"].startswith("the capital of france is") for p in predictions)
    done = trainer_cli("pull", f"models:/{name}@nosuchalias", str(tmp_path / "missing"), "--tracking-uri", uri)
    assert done.returncode == 1 and "nosuchalias" in done.stderr
    assert not (tmp_path / "missing").exists()
    with pytest.raises(ConfigError, match="not empty"):
        pull(f"models:/{name}/1", dest, uri)
