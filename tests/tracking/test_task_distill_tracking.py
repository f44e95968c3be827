"""Task distillation tracked by a real MLflow server: a registered teacher pulled as ``models:/``, one
parent run with a child run per stage, the student registered and pulled back as a classifier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.config import from_dict
from trainer.finetuning.finetune import FinetuneConfig, finetune
from trainer.finetuning.task_distill import CHECKPOINT, TaskDistillConfig, task_distill

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "tests" / "data" / "docs-classification.jsonl"


def test_parent_and_stage_runs_registered_student_pulled(
    mlflow_server, tiny_teacher_dir, tiny_student_dir, trainer_cli, tmp_path
):
    from mlflow import MlflowClient
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    uri = mlflow_server.uri
    tracking = {"tracking_uri": uri, "experiment": "td-teachers", "register_as": "td-teacher", "alias": "candidate"}
    finetune(
        from_dict(
            FinetuneConfig,
            {"model": str(tiny_teacher_dir), "data": str(DOCS), "output_dir": str(tmp_path / "teacher"), "epochs": 1,
             "max_seq_len": 48, "mlflow": tracking},
        )
    )  # fmt: skip
    values = {
        "teacher": "models:/td-teacher@candidate",
        "student": str(tiny_student_dir),
        "data": str(DOCS),
        "output_dir": str(tmp_path / "run"),
        "max_seq_len": 48,
        "eval_every_steps": 4,
        "log_every_steps": 2,
        "layers": {"epochs": 1, "lr": 1e-3, "pkd": {"weight": 1.0}},
        "predictions": {"epochs": 1, "lr": 1e-3, "soft": 1.0},
        "mlflow": {"tracking_uri": uri, "experiment": "td", "run_name": "tiny", "register_as": "td-student",
                   "alias": "candidate"},
    }  # fmt: skip
    result = task_distill(from_dict(TaskDistillConfig, values))

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("td").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.data.tags["stage"]: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert set(children) == {"layers", "predictions"}
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in children.values())
    assert all(r.info.status == "FINISHED" for r in runs)
    assert parent.data.params["teacher"] == "models:/td-teacher@candidate"
    assert parent.data.tags["teacher_model_uri"].startswith("models:/td-teacher")
    assert parent.data.metrics["eval/accuracy"] == pytest.approx(result["accuracy"])
    assert "train/pkd" in children["layers"].data.metrics and "train/soft" in children["predictions"].data.metrics
    assert children["predictions"].data.params["soft"] == "1.0"

    version = client.get_model_version_by_alias("td-student", "candidate")
    assert version.run_id == parent.info.run_id
    pulled = tmp_path / "pulled"
    done = trainer_cli("pull", "models:/td-student@candidate", str(pulled), "--tracking-uri", uri)
    assert done.returncode == 0, done.stderr[-3000:]
    model = AutoModelForSequenceClassification.from_pretrained(pulled)
    tokenizer = AutoTokenizer.from_pretrained(pulled)
    with torch.no_grad():
        logits = model(**tokenizer(["The logging module writes records."], return_tensors="pt")).logits
    assert logits.shape == (1, 2)
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "model")
    for key, value in exported.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, msg=key)

    # Not waiting for the server (start_timeout_s=0), the runs are created in the background: their ids still
    # reach the checkpoint, from which a resumed run continues them (they were recorded only if known at once).
    late = {**values, "output_dir": str(tmp_path / "late"), "predictions": {"epochs": 1, "lr": 1e-3, "soft": 1.0}}
    late["mlflow"] = {"tracking_uri": uri, "experiment": "td-late", "start_timeout_s": 0}
    task_distill(from_dict(TaskDistillConfig, late))
    on_server = {r.info.run_id for r in client.search_runs([client.get_experiment_by_name("td-late").experiment_id])}
    recorded = json.loads((tmp_path / "late" / CHECKPOINT / "state.json").read_text())["runs"]
    assert set(recorded) == {"parent", "layers", "predictions"} and set(recorded.values()) == on_server
