"""Shared fixtures: real text, a real tokenizer, a tiny teacher and a real preprocessed dataset.

The builders behind them live in ``tests/helpers.py`` (import them as ``from helpers import ...``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# No model hub is reachable here: fail fast instead of retrying the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Every process the tests start runs tests/launcher_site/sitecustomize.py: the DeepSpeed launcher's own two processes
# a launch then refuse its autotuner's mlflow probe as the ranks do (trainer/__init__.py), ~3 s of CPU a launch. A
# test that sets its own PYTHONPATH (block_imports's sitecustomize) goes without.
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(Path(__file__).parent / "launcher_site"), os.environ.get("PYTHONPATH")])
)

from helpers import (
    SAMPLE_CORPUS,
    TINY_DATASET_SETTINGS,
    EngineProbes,
    MotoServer,
    Probe,
    build_dataset,
    build_tiny_teacher,
)
from helpers import bert_tokenizer_dir as tokenizer_dir

pytest_plugins = ("tiers",)  # the fast and full tiers, and the fast tier's guard


@pytest.fixture(scope="session")
def bert_tokenizer_dir() -> Path:
    return tokenizer_dir()


@pytest.fixture(scope="session")
def sample_corpus() -> Path:
    return SAMPLE_CORPUS


@pytest.fixture(scope="session")
def tiny_teacher_dir(tmp_path_factory: pytest.TempPathFactory, bert_tokenizer_dir: Path) -> Path:
    return build_tiny_teacher(tmp_path_factory.mktemp("tiny-teacher"), bert_tokenizer_dir)


@pytest.fixture(scope="session")
def engine_probes(
    request: pytest.FixtureRequest, tiny_teacher_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProbes]:
    """Real DeepSpeed engines' measurements over the tiny teacher (``helpers.EngineProbes``): every engine this
    session's selected tests name (their ``probe`` parameter, a ``helpers.Probe``) launched together at the first
    test that asks, so that ``-k`` one test launches that test's engine alone."""
    named = [item.callspec.params.get("probe") for item in request.session.items if hasattr(item, "callspec")]
    probes = EngineProbes(
        [p for p in named if isinstance(p, Probe)], tiny_teacher_dir, tmp_path_factory.mktemp("engines")
    )
    yield probes
    probes.close()


@pytest.fixture(scope="session")
def tiny_dataset_dir(tmp_path_factory: pytest.TempPathFactory, bert_tokenizer_dir: Path, sample_corpus: Path) -> Path:
    """The sample corpus as a real dataset: max_seq_len 64, 8 train shards of 128 sequences, 2 valid shards."""
    return build_dataset(
        tmp_path_factory.mktemp("tiny-dataset") / "dataset",
        bert_tokenizer_dir,
        sample_corpus,
        **TINY_DATASET_SETTINGS,
        beam={"direct_num_workers": 2},
    )


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """A real S3-compatible server (moto's) on 127.0.0.1 for the session."""
    pytest.importorskip("boto3")
    server = MotoServer(tmp_path_factory.mktemp("moto") / "server.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def isolate_mlflow_uris() -> Iterator[None]:
    """``mlflow.set_tracking_uri``/``set_registry_uri`` write process-wide environment variables and
    mlflow's own module globals; restore both after each test so one test's store (a stopped server,
    another test's SQLite registry) never leaks into the next."""
    saved = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    yield
    if "mlflow" in sys.modules:
        mlflow = sys.modules["mlflow"]
        mlflow.set_tracking_uri(saved["MLFLOW_TRACKING_URI"])
        mlflow.set_registry_uri(saved["MLFLOW_REGISTRY_URI"])
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
