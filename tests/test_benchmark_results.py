"""The results pages are what the committed result files give: README's table, docs/benchmarks.md's and
docs/quality.md's, rendered by benchmarks/results.py; a new result file without a re-render fails here."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO


def test_the_pages_tables_are_the_committed_files_rendered():
    command = [sys.executable, "benchmarks/results.py", "--check"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_figure_in_the_readme_table_is_in_its_file():
    """Spot-check the rendering against the files themselves, not against itself."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("<!-- results:start -->") : readme.index("<!-- results:end -->")]
    throughput = json.loads((REPO / "docs/gpu-campaign/throughput.json").read_text())
    headline = next(c for c in throughput["cases"] if c["name"] == "distilbert-512-gb4096-mb64")
    assert f"{headline['tokens_per_s']:,.0f} tokens/s" in table
    distilled = json.loads((REPO / "docs/quality/task-distill.json").read_text())["study"]["comparisons"]
    alone = next(d for d in distilled if (d["first"], d["second"]) == ("task-distilled", "fine-tuned alone"))
    low, high = alone["ci95"]
    assert f"{alone['difference']:+.3f} [{low:+.3f}, {high:+.3f}]" in table
    assert "keeps" not in table  # a share of the teacher's score is quoted only with its interval (docs/quality.md)


@pytest.mark.parametrize("script", ["benchmarks/quality/task_distill_evidence.py"])
def test_the_quality_pages_own_tables_are_their_files_rendered(script: str, tmp_path: Path) -> None:
    """Tables a quality script renders itself (``--from-result --docs``): rendering the committed result file
    into a copy of docs/quality.md changes nothing, so the page shows what the file holds."""
    page = tmp_path / "quality.md"
    shutil.copy(REPO / "docs" / "quality.md", page)
    command = [sys.executable, script, "--from-result", "--docs", str(page)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": "."})
    assert proc.returncode == 0, proc.stderr
    assert page.read_text(encoding="utf-8") == (REPO / "docs" / "quality.md").read_text(encoding="utf-8")


def test_the_suite_tasks_table_is_the_task_file_and_the_separation_run_rendered() -> None:
    """docs/quality.md's table of the suite's tasks: each task's bag-of-words baselines and chance are the
    committed files' figures, and the block is what benchmarks/results.py renders from them."""
    sys.path.insert(0, str(REPO))
    from benchmarks import results

    page = (REPO / "docs" / "quality.md").read_text(encoding="utf-8")
    start, end = "<!-- suite-tasks:start -->", "<!-- suite-tasks:end -->"
    block = page[page.index(start) + len(start) : page.index(end)].strip()
    assert block == results.suite_tasks_table()
    tasks = json.loads((REPO / "benchmarks/quality/tasks/tasks.json").read_text())["tasks"]
    report = json.loads((REPO / "docs/quality/suite-separation.json").read_text())["report"]
    bow_500 = report["models"][1]["tasks"]
    assert "bag-of-words" in report["models"][1]["model"]
    for name, task in tasks.items():
        row = next(line for line in block.splitlines() if line.startswith(f"| `{name}` |"))
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[-3:] == [
            f"{report['tasks'][name]['chance']:.3f}",
            f"{task['bow_baseline'][task['metric']]:.3f}",
            f"{bow_500[name]['mean']:.3f}",
        ]
        assert task["source"] in row


def synthetic_suite(rights: dict[str, float], seeds: list[int]) -> dict:
    """An evaluate-suite report of models named as run directories (``.../NAME/student``) whose predictions
    are drawn here, each right with its probability (regression: noise of 1 - it), on two real tasks' first 60
    test labels: what the checks read, without fine-tuning anything."""
    import numpy as np

    from trainer.evaluation import suite_statistics as stats
    from trainer.evaluation.suite import SuiteConfig, labels_of_test, load_tasks, summarise

    models = [f"/runs/{name}/student" for name in rights]
    cfg = SuiteConfig(models=models, tasks=["debian-section", "debian-size"], valid_size=60, seeds=seeds).resolved()
    tasks = load_tasks(cfg)
    labels = {name: labels_of_test(cfg, task) for name, task in tasks.items()}
    rng = np.random.default_rng(0)

    def run(name: str, right: float) -> dict:
        task, truth = tasks[name], labels[name]
        if task["kind"] == "regression":
            predicted = [float(v) + rng.normal(scale=1 - right) for v in truth]
        else:
            predicted = [v if rng.random() < right else task["labels"][0] for v in truth]
        score = stats.score(predicted, truth, task["kind"] == "regression")
        return {"dev": right, "test": score, "predicted": predicted}

    results = [
        {"model": model, "runs": {name: {cfg.lr: [run(name, right) for _ in cfg.seeds]} for name in tasks}}
        | {"wall_s": 1.0, "cpu_s": 1.0}
        for model, right in zip(models, rights.values(), strict=True)
    ]
    return summarise(cfg, tasks, results, labels)


def test_check_recomputes_a_suite_results_figures_from_its_predictions(tmp_path: Path) -> None:
    """A suite result that carries its predictions (two models, two seeds, a class and a regression task, on the
    real task files' test labels) passes ``--check``; the same file with one figure edited fails it, naming the
    figure. The predictions are drawn here: the check reads files, never how they were made."""
    report = synthetic_suite({"a": 0.8, "b": 0.6}, [0, 1])
    docs = tmp_path / "docs"
    (docs / "quality").mkdir(parents=True)
    path = docs / "quality" / "suite.json"
    path.write_text(json.dumps(report))
    command = [sys.executable, "benchmarks/results.py", "--check", "--root", str(docs)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

    report["models"][1]["skill_ci"][0] -= 0.02  # a wider interval than the predictions give
    path.write_text(json.dumps(report))
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1 and "quality/suite.json: models[1].skill_ci:" in proc.stderr, proc.stderr


def test_a_study_is_decided_as_its_protocol_says_and_its_protocol_came_first(tmp_path: Path) -> None:
    """A study of replicated students (three of (a), one untrained (f)) under a protocol: the report groups each
    variant's students, decides the protocol's comparison by Holm's procedure and labels an added one
    exploratory. ``results.py --check`` accepts it where the protocol was committed before the results, and
    names what is wrong where they came in one commit, where a figure was edited or the protocol changed."""
    import yaml

    from benchmarks.quality import ablation_report
    from benchmarks.results import studies_as_fixed

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    fixed = {
        "study": "toy",
        "question": "Does (a) beat (f)?",
        "family": "minilm",
        "scale": "toy",
        "variants": ["a", "f", "a0"],
        "distillation_seeds": [0, 1, 2],
        "suite": {"tasks": ["debian-section", "debian-size"], "valid_size": 60, "seeds": [0, 1]},
        "comparisons": [["a", "f"]],
        "decision": {"level": 0.05, "correction": "holm"},
    }
    protocol_path = tmp_path / "protocols" / "toy.yaml"
    protocol_path.parent.mkdir()
    protocol_path.write_text(yaml.safe_dump(fixed))
    rights = {"teacher": 0.9, "minilm-a": 0.85, "minilm-a-s1": 0.8, "minilm-a-s2": 0.82, "minilm-f": 0.4}
    suite = synthetic_suite(rights | {"minilm-a0": 0.8}, [0, 1])
    out = tmp_path / "docs" / "study"
    out.mkdir(parents=True)
    (out / "suite-minilm.json").write_text(json.dumps(suite))
    study = ablation_report.study(protocol_path, out, [("a0", "a")])
    study["path"] = "protocols/toy.yaml"  # as ablation.sh records it: from the repository's root
    confirmatory, exploratory = study["comparisons"]
    assert (confirmatory["kind"], confirmatory["students"], confirmatory["verdict"]) == (
        "confirmatory",
        [3, 1],
        "first better",
    )
    assert exploratory["kind"] == "exploratory" and exploratory["students"] == [1, 3]
    assert "(Holm, family-wise 5%)" in "\n".join(ablation_report.study_lines(study))
    (out / "ablation.json").write_text(json.dumps({"study": study}))

    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "protocol and results at once")
    assert studies_as_fixed(tmp_path / "docs") == [
        "docs/study/ablation.json: its protocol protocols/toy.yaml was not committed before it"
    ]

    shutil.rmtree(tmp_path / ".git")
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "add", "protocols")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "the protocol, first")
    git("-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "its results")
    assert studies_as_fixed(tmp_path / "docs") == []

    study["comparisons"][0]["p"] += 0.01
    (out / "ablation.json").write_text(json.dumps({"study": study}))
    [problem] = studies_as_fixed(tmp_path / "docs")
    assert problem.startswith("docs/study/ablation.json: (a) - (f) p:")
    protocol_path.write_text(yaml.safe_dump({**fixed, "comparisons": [["a", "f"], ["a0", "a"]]}))
    assert studies_as_fixed(tmp_path / "docs") == [
        "docs/study/ablation.json: its protocol protocols/toy.yaml is missing or changed since the runs"
    ]
