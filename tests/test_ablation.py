"""The quality ablation (benchmarks/quality/ablation.sh) end to end at toy size: the real Beam pipeline on a
slice of a corpus, the teacher pretrained by the deepspeed launcher on two CPU ranks, every student
variant distilled from it and from the real all-MiniLM-L6-v2, evaluate-mlm and evaluate-suite on all of
them, and the report. It checks that every row and column is there, not which way the results go.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

BERT_STUDENTS = ["bert-a", "bert-b", "bert-c", "bert-d", "bert-e"]
MINILM_STUDENTS = ["minilm-c", "minilm-d", "minilm-e"]


@pytest.mark.integration
def test_ablation_runs_end_to_end_at_toy_size(tmp_path: Path) -> None:
    corpora = tmp_path / "corpora"  # two files, as in ../shared/corpora; the script slices 20 documents of each
    corpora.mkdir()
    with gzip.open(REPO / "demo" / "corpus.jsonl.gz", "rt", encoding="utf-8") as f:
        lines = f.readlines()
    for i, name in enumerate(("first.jsonl.gz", "second.jsonl.gz")):
        with gzip.open(corpora / name, "wt", encoding="utf-8") as f:
            f.writelines(lines[i::2])
    out = tmp_path / "ablation"
    env = {
        **os.environ,
        "ABLATION_OUTPUT": str(out),
        "PYTHON": sys.executable,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    script = REPO / "benchmarks" / "quality" / "ablation.sh"
    proc = subprocess.run(
        ["bash", str(script), "toy", str(corpora)], env=env, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    report = json.loads((out / "ablation.json").read_text())
    rows = {row["name"]: row for row in report["rows"]}
    assert list(rows) == ["teacher", *BERT_STUDENTS, "minilm", *MINILM_STUDENTS]
    assert report["dataset"]["documents"] == 40 and report["dataset"]["train_tokens"] > 0
    for name, row in rows.items():
        assert row["encoder_params"] > 0 and row["suite_share"] > 0, name
        assert set(row["suite"]) == {"debian-section"} and 0 <= row["suite_average"] <= 1, name
        trained = name != "minilm"  # the pretrained MiniLM is the only model not trained here
        assert (row["tokens"] is not None and row["tokens"] > 0) is trained, name
        assert (row["command"] is not None and "launch/run.sh" in row["command"]) is trained, name
        headless = name == "minilm"  # no masked-LM head: no masked-LM figures
        assert (row["mlm_accuracy"] is None) is headless and (row["perplexity"] is None) is headless, name
        # Agreement needs a teacher with a head: the BERT teacher's students have it, MiniLM's cannot.
        assert (row["top1_agreement"] is not None) is (name in BERT_STUDENTS), name
    assert rows["teacher"]["suite_share"] == rows["minilm"]["suite_share"] == 1.0
    # Equal tokens: every student of both teachers saw the same number.
    assert len({rows[name]["tokens"] for name in BERT_STUDENTS + MINILM_STUDENTS}) == 1
    assert "objective.cos=0" in rows["bert-b"]["command"] and "objective.ce=0" in rows["bert-c"]["command"]
    assert "student.init=random" in rows["bert-d"]["command"] and "teacher=null" in rows["bert-e"]["command"]

    table = (out / "ablation.md").read_text()
    header = table.splitlines()[0]
    for column in ("params (M)", "tokens (M)", "train s", "MLM acc", "ppl", "top-1 agr.", "suite avg", "share"):
        assert column in header
    for name in rows:
        assert f"| {name}: " in table
    for step in ("preprocess", "teacher", "mlm-bert", "mlm-minilm", "suite-bert", "suite-minilm"):
        assert f"| {step} | " in table
    assert table in proc.stdout  # the script ends by printing the table
