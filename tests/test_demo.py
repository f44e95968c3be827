"""The quickstart (`make demo`) at reduced size: every step through the real commands.

Beam DirectRunner preprocessing of demo/corpus.jsonl.gz -> the real deepspeed launcher on two
CPU ranks distilling the real all-MiniLM-L6-v2 teacher -> registration in a SQLite MLflow store
-> pull -> fill-mask -> fine-tune -> the student and the teacher on one evaluation-suite task, side by
side. Only the number of steps and examples is smaller than in `make demo`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.full
@pytest.mark.integration
def test_demo_runs_end_to_end_at_reduced_size(tmp_path: Path):
    out = tmp_path / "demo"
    env = {
        **os.environ,
        "DEMO_OUTPUT": str(out),
        "DEMO_MAX_STEPS": "2",  # the first and the last step: the loop, the export and registration
        "DEMO_FT_EPOCHS": "1",
        "DEMO_FT_MAX_SEQ_LEN": "64",  # the fine-tune was 60 % of the test's CPU at 128; the texts average ~42 words
        "DEMO_SUITE_TRAIN_SIZE": "16",
        "DEMO_SUITE_DEV_SIZE": "16",
        "DEMO_SUITE_VALID_SIZE": "16",
        "PYTHON": sys.executable,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    for leftover in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        env.pop(leftover, None)
    proc = subprocess.run(
        ["bash", str(REPO / "demo" / "run.sh")], env=env, capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert manifest["documents"]["kept"] > 300 and manifest["splits"]["train"]["samples"] > 1000

    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(m.get("step", 0) for m in metrics) == 2

    from mlflow import MlflowClient

    store = f"sqlite:///{out / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=store, registry_uri=store)  # not MLflow's process-global registry
    version = client.get_model_version_by_alias("demo-minilm-3l", "demo")
    assert int(version.version) == 1

    from transformers import AutoModelForMaskedLM

    student = AutoModelForMaskedLM.from_pretrained(out / "student")
    assert student.config.num_hidden_layers == 3 and student.config.hidden_size == 384

    assert "[MASK] module at boot." in proc.stdout and "->" in proc.stdout  # the fill-mask example ran
    result = json.loads((out / "finetune" / "metrics.json").read_text())
    # Python docs vs Linux docs, balanced: chance is 0.5 (one standard error 0.04 on the 160 held out); MiniLM's
    # first 3 layers, untrained, fine-tuned alike for one epoch, scored 0.825.
    assert result["total"] == 160 and result["correct"] / 160 == result["accuracy"] > 0.65, result
    assert f"validation accuracy {result['accuracy']:.4f} ({result['correct']}/160)" in proc.stdout
    assert "mlflow ui --backend-store-uri" in proc.stdout  # ends by saying what to run next

    # The student and its teacher on one suite task, side by side, from the suite's own report.
    suite = json.loads((out / "suite.json").read_text())
    teacher, student_entry = suite["models"]
    assert list(suite["tasks"]) == ["debian-section"] and suite["tasks"]["debian-section"]["train_size"] == 16
    # A share only of a teacher above chance: at this reduced size (16 examples, 2 steps, every model's pooler and
    # head new) the teacher may not be, and the line then says n/a, as the suite's report does.
    share = r"-?[\d.]+%" if teacher["skill"] > 0 else "n/a"
    side_by_side = (
        r"^Student vs teacher \(all-MiniLM-L6-v2\), fine-tuned alike: debian-section \(accuracy, 16 training "
        rf"examples\): student {student_entry['tasks']['debian-section']['mean']:.3f} \| teacher "
        rf"{teacher['tasks']['debian-section']['mean']:.3f} \| chance {suite['tasks']['debian-section']['chance']:.3f} "
        rf"\| the student keeps {share} of the teacher's skill above chance$"
    )
    assert re.search(side_by_side, proc.stdout, re.MULTILINE), proc.stdout[-2000:]

    # Quiet: no line from the sources silenced at their origin (issue 19) ...
    output = proc.stdout + proc.stderr
    silenced = [
        r"apitools not found",  # the driver's and every Beam worker's
        r"No semi_persistent_directory",
        r"Logging handler created",  # a Beam worker's start-up line
        r"Discarding unparseable args",
        r"^INFO:preprocessing:bucket \d+:",
        r"^INFO:preprocessing:shard ",
        r"FutureWarning: `torch\.distributed\.all_gather_into_tensor` is deprecated",
        r"LOAD REPORT",
        r"deepspeed_shm_comm_op built",
        r"were not sharded",  # transformers' tensor-parallel check, run by the classifier's quiet load
        r"Loading weights",  # transformers' and the Hub's progress bars
        r"Writing model shards",
        r"Downloading artifacts",  # MLflow's
    ]
    for pattern in silenced:
        assert not re.search(pattern, output, re.MULTILINE), pattern
    # ... and every line that says how it went.
    summaries = [
        r"preprocessing 1 file\(s\), 0\.9 MB on disk",
        r"read \S+corpus\.jsonl\.gz: \d+ documents \(0 dropped\), 3\.1 MB of text from 0\.9 MB on disk",
        r"^\S+ \S+ INFO preprocessing: tokenized train: [\d,]+ text tokens",  # a worker's line, our format
        r"^text MB \(decompressed\) / seconds / MB/s +3\.1 / ",
        r"distilling \S+ on 2 rank\(s\)",
        r"^step 2/2 \| loss .* \| elapsed \w+ \| eta 0s$",
        r"exported the student to ",
        r"registered demo-minilm-3l version 1 as @demo",
        r"pulled models:/demo-minilm-3l@demo",
        r"new weights for the classification head: ",
        r"step \d+/\d+ \| loss [\d.]+ \| elapsed \w+ \| eta \w+",
        r"^validation accuracy ",
        # where the minutes went, stage by stage (benchmarks/demo_time.py reads this line)
        r"^=== done in \d+ min \d+ s \(preprocess \d+ s, distil \d+ s, pull \d+ s, fill-mask \d+ s, finetune \d+ s, "
        r"suite \d+ s\) ===$",
    ]
    for pattern in summaries:
        assert re.search(pattern, output, re.MULTILINE), pattern
