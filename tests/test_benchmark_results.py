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
