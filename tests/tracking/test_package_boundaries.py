"""The MLflow package (``trainer/tracking/``) stands without DeepSpeed and without the training side.

``pull``, ``register`` and ``promote`` run where DeepSpeed is not installed (a laptop pulling a
student), and the training side depends on the MLflow package, never the other way round.
"""

from __future__ import annotations

import ast
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import trainer.tracking

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(trainer.tracking.__file__).parent
FORBIDDEN = (
    "deepspeed",
    "trainer.objective",
    "trainer.runtime",
    "trainer.commands",
    "trainer.finetuning",
    "trainer.evaluation",
    "trainer.planning",
)

# Run in a fresh interpreter with DeepSpeed blocked: ``import deepspeed`` raises ImportError, as if not installed.
PRELUDE = """
import json, sys
sys.modules["deepspeed"] = None
"""
REPORT = """
prefixes = tuple(name + "." for name in {forbidden!r})
loaded = [n for n, m in sys.modules.items() if m is not None and (n in {forbidden!r} or n.startswith(prefixes))]
print(json.dumps(sorted(loaded)))
"""


def run_blocked(body: str) -> subprocess.CompletedProcess:
    code = PRELUDE + body + REPORT.format(forbidden=FORBIDDEN)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def package_modules() -> list[str]:
    return sorted(f"trainer.tracking.{m.name}" for m in pkgutil.iter_modules([str(PACKAGE)]))


def test_every_module_imports_without_deepspeed_or_the_training_side():
    modules = package_modules()
    assert {"trainer.tracking.config", "trainer.tracking.tracker", "trainer.tracking.registry"} <= set(modules)
    done = run_blocked("import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_pull_runs_without_deepspeed(mlflow_server, tiny_student_dir, tmp_path):
    """A real pull of a registered student from the MLflow server, in a process where DeepSpeed cannot be imported."""
    from trainer.tracking.registry import register_student

    register_student(tiny_student_dir, name="boundary", alias="laptop", run_id=None, tracking_uri=mlflow_server.uri)
    dest = tmp_path / "pulled"
    body = f"""
from trainer.__main__ import main
assert main(["pull", "models:/boundary@laptop", {str(dest)!r}, "--tracking-uri", {mlflow_server.uri!r}]) == 0
"""
    done = run_blocked(body)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "models:/boundary@laptop (version 1)" in done.stdout
    assert json.loads(done.stdout.splitlines()[-1]) == []  # nothing of DeepSpeed or the training side was loaded
    assert json.loads((dest / "mlflow_source.json").read_text())["version"] == "1"
    assert (dest / "model.safetensors").read_bytes() == (tiny_student_dir / "model.safetensors").read_bytes()


def imported_names(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function, relative imports made absolute."""
    package = "trainer.tracking"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)  # from trainer import runtime
    return names


def test_no_module_imports_deepspeed_or_the_training_side():
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) == len(package_modules()) + 1  # every module, and __init__.py
    offending = {
        f"{path.name}: {name}"
        for path in files
        for name in imported_names(path)
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
    }
    assert not offending
