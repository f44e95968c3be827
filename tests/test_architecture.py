"""The package layout holds: no import cycle, each package imports alone, and the layers point one way.

The rules are the map in docs/architecture.md: ``common`` is shared by everything and imports
nothing of ours; ``preprocessing`` and ``trainer`` never import each other; inside the trainer the
objective (what a step optimises) knows nothing of the runtime (how it runs at scale), the
commands, the role packages or MLflow, and the MLflow package (what downstream teams import to pull
a student) knows nothing of DeepSpeed, the objective, the runtime, the role packages or the commands.
The role packages (fine-tuning, evaluation, planning) sit between those and the commands: the
commands are thin command lines that call into them, and no role package imports a command;
evaluation fine-tunes through ``finetuning`` (never the other way round), and planning records nothing
in MLflow.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, run_in_repo

PACKAGES = ("common", "preprocessing", "trainer")

# the role packages: the machinery the commands call into
ROLES = ("trainer.finetuning", "trainer.evaluation", "trainer.planning")

# package prefix -> what it must never import (imports inside functions included)
FORBIDDEN = {
    "common": ("preprocessing", "trainer"),
    "preprocessing": ("trainer",),
    "trainer": ("preprocessing",),
    "trainer.objective": ("trainer.runtime", "trainer.commands", *ROLES, "trainer.tracking", "deepspeed"),
    "trainer.runtime": ("trainer.commands", *ROLES, "trainer.tracking"),
    "trainer.tracking": ("trainer.objective", "trainer.runtime", "trainer.commands", *ROLES, "deepspeed"),
    "trainer.modeling": (
        "trainer.objective",
        "trainer.runtime",
        "trainer.commands",
        *ROLES,
        "trainer.tracking",
        "deepspeed",
    ),
    "trainer.finetuning": ("trainer.commands", "trainer.evaluation", "trainer.planning", "deepspeed"),
    "trainer.evaluation": ("trainer.commands", "trainer.planning", "deepspeed"),
    "trainer.planning": ("trainer.commands", "trainer.finetuning", "trainer.evaluation", "trainer.tracking"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function, as absolute names."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return names


def project_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_no_import_cycle() -> None:
    graph = project_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_layers_import_only_downwards() -> None:
    violations = []
    for name, path in project_modules().items():
        for package, forbidden in FORBIDDEN.items():
            if within(name, package):
                violations += [f"{name} imports {m}" for m in imports_of(path) for f in forbidden if within(m, f)]
    assert not violations, "\n".join(sorted(set(violations)))


@pytest.mark.parametrize(
    "package",
    ["common", "preprocessing", "trainer.objective", "trainer.runtime", "trainer.tracking", *ROLES, "trainer"],
)
def test_each_package_imports_alone(package: str) -> None:
    """Every module of ``package`` imports in a fresh interpreter that has imported nothing else of ours."""
    names = [n for n in project_modules() if within(n, package) and not n.endswith("__main__")]
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    env = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", code, *names], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_no_test_folder_is_named_like_a_package_it_could_hide() -> None:
    """pytest puts ``tests/`` first on ``sys.path``, so a folder there is importable by its name, as a namespace
    package. Where the real package of that name is absent (the GPU machine has no mlflow), ``import NAME`` then
    finds the test folder instead: DeepSpeed's ``try: import mlflow`` did, and the tests' MLflow clean-up then
    failed on it. Only this project's own packages may share a name, since a regular package wins."""
    from importlib.metadata import packages_distributions

    folders = {p.name for p in (REPO / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    importable = set(packages_distributions()) | set(sys.stdlib_module_names)
    assert folders & importable - set(PACKAGES) == set()


def test_the_commands_that_build_no_engine_import_no_deepspeed() -> None:
    """Evaluation and fine-tuning run a model on one device: DeepSpeed's import (~3 s of CPU) is
    paid only by training, `plan` (ZeRO's config) and `export` (ZeRO's checkpoints). The ablation runs these
    commands dozens of times; a type imported for a hint once put DeepSpeed back into each of them."""
    commands = ["evaluate_mlm", "evaluate_suite", "finetune", "task_distill"]  # and their role packages, whole
    modules = [f"trainer.commands.{c}" for c in commands] + [
        name for name in project_modules() if within(name, "trainer.evaluation") or within(name, "trainer.finetuning")
    ]
    code = (
        "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))\n"
    )
    env = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    proc = run_in_repo([sys.executable, "-c", code, *modules], env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout[-2000:]


def test_a_rank_imports_deepspeed_without_mlflow_and_mlflow_still_imports_when_tracking_asks() -> None:
    """DeepSpeed's autotuner imports mlflow at ``import deepspeed`` (~1.9 s of CPU a process); trainer/__init__.py
    refuses that one importer, so a rank or ``plan`` that tracks nothing never loads mlflow, and one that tracks
    still can. Fails if the refusal stops working (a DeepSpeed that moves the probe) or reaches further."""
    code = (
        "import sys\nimport trainer.runtime.engine\nimport trainer.planning.plan\n"
        "from deepspeed.autotuning import autotuner\n"
        "print('mlflow' in sys.modules, autotuner.has_mlflow)\n"
        "import mlflow\nfrom trainer.tracking.registry import log_student\nprint(mlflow.MlflowClient.__name__)\n"
    )
    proc = run_in_repo([sys.executable, "-c", code], {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "False", "MlflowClient"], proc.stdout
