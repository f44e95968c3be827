"""The task-distillation study under its protocol (benchmarks/quality/task_distill_evidence.py): the settings come
from the protocol file, an option contradicting it is an error naming the key, the result carries each row's
per-example test predictions and its comparisons decided by Holm's procedure from them, and
``benchmarks/results.py --check`` decides them again and fails on an edited figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO, build_tiny_teacher

sys.path.insert(0, str(REPO))

ROWS = ["fine-tuned alone", "fine-tuned on the augmented data", "task-distilled", "task-distilled + augmentation"]


def fixed(sizes: dict[str, int], seeds: list[int], **budgets: int) -> dict:
    """A task study's protocol on ``debian-section``, with every row, two confirmatory comparisons and one
    exploratory."""
    return {
        "study": "tiny",
        "question": "Does the machinery run? (a rehearsal; its answer means nothing)",
        "task": "debian-section",
        "sizes": sizes,
        "seeds": seeds,
        "rows": ROWS,
        "settings": {"variants": 1, "max_seq_len": 16, "mlm_steps": 2},
        "budgets": {"batch_size": 8, "lr": 0.001, "teacher_epochs": 1, "layer_epochs": 1, "prediction_epochs": 1}
        | {"eval_every_steps": 5, "finetune_epochs": 2}
        | budgets,
        "comparisons": [[ROWS[2], ROWS[0]], [ROWS[3], ROWS[1]]],
        "exploratory": [[ROWS[1], ROWS[0]]],
        "decision": {"level": 0.05, "correction": "holm"},
    }


def written(protocol: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(protocol, sort_keys=False), encoding="utf-8")
    return path


def test_an_option_that_contradicts_the_protocol_is_an_error_naming_its_key(tmp_path: Path, monkeypatch) -> None:
    """The protocol fixes every setting: an option may restate it, never change it, and a protocol whose controls
    would train other steps than the distilled rows is refused, all before anything runs."""
    from benchmarks.quality import task_distill_evidence

    path = written(fixed({"train": 40, "dev": 10, "test": 24}, [0, 1]), tmp_path / "tiny.yaml")
    unmatched = written(fixed({"train": 40, "dev": 10, "test": 24}, [0, 1], finetune_epochs=3), tmp_path / "u.yaml")
    work = ["--work", str(tmp_path / "w")]
    refused = {  # options -> what the error says
        ("--seeds", "0", "1", "2"): ["--seeds [0, 1, 2] contradicts the protocol", "its seeds is [0, 1]"],
        ("--train-size", "41"): ["--train-size 41 contradicts the protocol", "its sizes.train is 40"],
        ("--task", "debian-size"): ["--task debian-size contradicts the protocol", "its task is debian-section"],
    }
    for options, said in refused.items():
        monkeypatch.setattr(sys, "argv", ["task_distill_evidence.py", "--protocol", str(path), *options, *work])
        with pytest.raises(SystemExit) as refusal:
            task_distill_evidence.main()
        assert all(words in str(refusal.value) for words in said), refusal.value
    monkeypatch.setattr(sys, "argv", ["task_distill_evidence.py", "--protocol", str(unmatched), *work])
    with pytest.raises(SystemExit, match=r"budgets: finetune_epochs must be 2 \(matched\)"):
        task_distill_evidence.main()
    assert not (tmp_path / "w").exists()


def drawn_study(protocol_path: Path, rights: dict[str, float]) -> dict:
    """A task study's result as the script writes it, its predictions drawn here (each right with its row's
    probability, else the first label) on the real test labels: what the check reads, without training."""
    import numpy as np

    from benchmarks.quality import protocol
    from trainer.evaluation.suite import SuiteConfig, compact, labels_of_test, load_tasks

    study = protocol.load_task_study(protocol_path)
    cfg = SuiteConfig(models=["unused"], tasks=[study["task"]], valid_size=study["sizes"]["test"])
    task = load_tasks(cfg)[study["task"]]
    labels = labels_of_test(cfg, task)
    rng = np.random.default_rng(0)
    predicted = {
        row: {
            str(seed): compact([v if rng.random() < right else task["labels"][0] for v in labels], task)
            for seed in study["seeds"]
        }
        for row, right in rights.items()
    }
    decided = protocol.decide_task_study(study, predicted)
    students = {
        row: {"seeds": dict(zip(predicted[row], scores, strict=True)), "mean": sum(scores) / len(scores)}
        | {"predictions": predicted[row]}
        for row, scores in decided["scores"].items()
    }
    found = {"path": "protocols/tiny.yaml", "protocol": study, "comparisons": decided["comparisons"]}
    return {"chance": decided["chance"], "students": students, "study": found}


def test_check_decides_a_task_study_again_and_fails_on_an_edited_figure(tmp_path: Path) -> None:
    """A task study whose protocol was committed before its result (and before the commit it ran at) passes the
    check, its confirmatory comparisons decided by Holm's procedure and its exploratory one labelled so; a run
    at a commit without the protocol fails it, and so does an edited interval or score, naming the figure; a
    record from before the protocol (no predictions) is only counted."""
    from benchmarks.results import task_studies_as_fixed

    def git(*args: str) -> None:
        command = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
        subprocess.run(command, cwd=tmp_path, check=True, capture_output=True)

    def head() -> str:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("commit", "-q", "--allow-empty", "-m", "before the protocol")
    before = head()
    protocol_path = written(fixed({"train": 200, "dev": 200, "test": 120}, [0, 1, 2]), tmp_path / "protocols/tiny.yaml")
    git("add", "-A")
    git("commit", "-qm", "the protocol, first")
    report = drawn_study(protocol_path, dict(zip(ROWS, [0.5, 0.55, 0.9, 0.6], strict=True))) | {"commit": head()}
    path = tmp_path / "docs" / "quality" / "task-distill.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(report))
    (path.parent / "task-distill-old.json").write_text(json.dumps({"differences": []}))  # before the protocol
    git("add", "-A")
    git("commit", "-qm", "its result")

    distilled, augmented, data = report["study"]["comparisons"]
    assert (distilled["kind"], distilled["students"], distilled["verdict"]) == ("confirmatory", [3, 3], "first better")
    assert (augmented["kind"], data["kind"]) == ("confirmatory", "exploratory")
    assert task_studies_as_fixed(tmp_path / "docs") == []
    path.write_text(json.dumps(report | {"commit": before}))  # a run made before its protocol was committed
    assert task_studies_as_fixed(tmp_path / "docs") == [
        f"docs/quality/task-distill.json: it ran at commit {before[:10]}, which does not hold its protocol "
        "protocols/tiny.yaml"
    ]

    report["study"]["comparisons"][0]["ci95"][0] -= 0.01  # a wider interval than the predictions give
    report["students"][ROWS[1]]["seeds"]["2"] += 0.01  # a better score than its predictions give
    path.write_text(json.dumps(report))
    problems = task_studies_as_fixed(tmp_path / "docs")
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"docs/quality/task-distill.json: {ROWS[1]} scores:")
    assert problems[1].startswith(f"docs/quality/task-distill.json: ({ROWS[2]}) - ({ROWS[0]}) ci95:")


@pytest.mark.full
def test_a_tiny_study_runs_under_its_protocol_end_to_end(tmp_path: Path, bert_tokenizer_dir: Path, monkeypatch) -> None:
    """The whole study at toy size, a tiny 6-layer BERT standing in for MiniLM (teacher, student's layers,
    augmentation MLM): every row at both seeds, the compute matched as the protocol fixes it, the protocol
    and each row's predictions recorded, and the comparisons what those predictions give again."""
    from benchmarks.quality import protocol, task_distill_evidence

    tiny = build_tiny_teacher(tmp_path / "tiny", bert_tokenizer_dir, layers=6)
    monkeypatch.setattr(task_distill_evidence, "minilm_dir", lambda: tiny)
    path = written(fixed({"train": 16, "dev": 10, "test": 16}, [0, 1]), tmp_path / "tiny.yaml")
    out = tmp_path / "result.json"
    argv = ["task_distill_evidence.py", "--protocol", str(path), "--seeds", "0", "1", "--work", str(tmp_path / "w")]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    assert task_distill_evidence.main() == 0

    result = json.loads(out.read_text())
    assert result["study"]["protocol"] == yaml.safe_load(path.read_text()) and result["study"]["path"] == str(path)
    rows = result["students"]
    assert list(rows) == ROWS and all(sorted(row["predictions"]) == ["0", "1"] for row in rows.values())
    assert all(len(p) == 16 for row in rows.values() for p in row["predictions"].values())
    assert rows[ROWS[0]]["optimizer_steps"] == rows[ROWS[2]]["optimizer_steps"] == 2 * 2  # 2 epochs of 16 / 8
    assert rows[ROWS[1]]["optimizer_steps"] == rows[ROWS[3]]["optimizer_steps"]
    again = protocol.decide_task_study(result["study"]["protocol"], {k: row["predictions"] for k, row in rows.items()})
    assert again["comparisons"] == result["study"]["comparisons"]
    assert [c["kind"] for c in again["comparisons"]] == ["confirmatory", "confirmatory", "exploratory"]
    assert "| task-distilled - fine-tuned alone | confirmatory | 2 / 2 |" in task_distill_evidence.table(result)

    # Run again on the same --work: every finished run is read back, none trained again, the same result.
    assert task_distill_evidence.main() == 0
    again = json.loads(out.read_text())
    assert again["students"] == rows and again["teacher"] == result["teacher"]
    assert again["invocations"] == result["invocations"] and len(result["invocations"]) == 1
    # A run cut off before its record (run.json is written last) is trained again, alone; the study now holds
    # the runs of two invocations.
    work = tmp_path / "w"
    (work / "task-distilled-1" / "run.json").unlink()
    assert task_distill_evidence.main() == 0
    continued = json.loads(out.read_text())
    assert len(continued["invocations"]) == 2
    assert {k: v for k, v in continued["students"].items() if k != ROWS[2]} == {
        k: v for k, v in rows.items() if k != ROWS[2]
    }
    retrained = continued["students"][ROWS[2]]
    assert retrained["predictions"] == rows[ROWS[2]]["predictions"]  # on CPU, the same run gives the same student
    # A run another commit trained is never mixed in: an error naming its record.
    record = work / "fine-tuned-alone-0" / "run.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "commit": "0" * 40}))
    with pytest.raises(SystemExit, match=r"fine-tuned-alone-0/run\.json was run at commit 0{10}"):
        task_distill_evidence.main()
