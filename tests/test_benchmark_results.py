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
    suite = json.loads((REPO / "docs/gpu-ablation/2026-11-28-h200/suite-minilm.json").read_text())
    student = next(m for m in suite["models"] if m["model"].endswith("/minilm-a/student"))
    assert f"keeps {student['share']:.1%}" in table


@pytest.mark.parametrize(
    "script", ["benchmarks/quality/suite_separation.py", "benchmarks/quality/task_distill_evidence.py"]
)
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


def test_check_recomputes_a_suite_results_figures_from_its_predictions(tmp_path: Path) -> None:
    """A suite result that carries its predictions (two models, two seeds, a class and a regression task, on the
    real task files' test labels) passes ``--check``; the same file with one figure edited fails it, naming the
    figure. The predictions are drawn here: the check reads files, never how they were made."""
    import numpy as np

    from trainer.evaluation import suite_statistics as stats
    from trainer.evaluation.suite import SuiteConfig, labels_of_test, load_tasks, summarise

    cfg = SuiteConfig(models=["a", "b"], tasks=["debian-section", "debian-size"], valid_size=60, seeds=[0, 1])
    cfg = cfg.resolved()
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
        for model, right in (("a", 0.8), ("b", 0.6))
    ]
    report = summarise(cfg, tasks, results, labels)
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
