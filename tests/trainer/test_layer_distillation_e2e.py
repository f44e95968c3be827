"""TinyBERT, PKD and MiniLM terms through the real launcher, in one run that keeps each term asserted.

``deepspeed --num_gpus 2 launch/run.sh configs/tiny-cpu.yaml`` on two CPU ranks, with the real
all-MiniLM-L6-v2 encoder as teacher: 6 layers x 384, 12 heads and NO masked-LM head, so only
objectives that need no teacher logits are possible. The student is narrower (3 x 48, 12 heads),
which exercises the learned projections (48 -> 384): TinyBERT's W_e and W_h, and PKD's own; PKD
compares its layers 0-1 with teacher layers 1 and 3; MiniLM's last-layer relations use 6 relation
heads (head size 8 in the student, 64 in the teacher). One run costs about two minutes on 2 cores,
so the families share it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 16
LAYER_TERMS = (
    "tinybert_embedding",
    "tinybert_hidden",
    "tinybert_attention",
    "pkd",
    "minilm_attention",
    "minilm_value",
)
SETTINGS = [
    f"max_steps={MAX_STEPS}",
    "checkpoint.every_steps=8",
    "checkpoint.keep_last=2",
    f"eval.every_steps={MAX_STEPS}",
    "logging.every_steps=1",
    "optimizer.lr=0.01",
    "student.init=random",
    "student.num_layers=3",
    "student.hidden_size=48",
    "student.num_attention_heads=12",
    "student.intermediate_size=96",
    "objective.ce=0",
    "objective.cos=0",
    "objective.mlm=1",
    "objective.tinybert.embedding=1",
    "objective.tinybert.hidden=1",
    "objective.tinybert.attention=1",
    "objective.pkd.weight=10",
    "objective.minilm.attention=1",
    "objective.minilm.value=3",
    "objective.minilm.relation_heads=6",
]


@pytest.fixture(scope="module")
def layer_run(tmp_path_factory, bert_tokenizer_dir: Path, tiny_dataset_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("layer-distillation") / "run"
    deepspeed = Path(sys.executable).parent / "deepspeed"
    cmd = [str(deepspeed), "--num_gpus", "2", "launch/run.sh"]
    cmd += ["configs/tiny-cpu.yaml", f"teacher={bert_tokenizer_dir}", f"data={tiny_dataset_dir}", f"output_dir={out}"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, *SETTINGS], cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, f"launcher exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"
    return out


def train_records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "train/loss" in r]


@pytest.mark.full
def test_every_layer_term_is_finite_and_falls(layer_run: Path):
    records = train_records(layer_run)
    assert [r["step"] for r in records] == list(range(1, MAX_STEPS + 1))
    for term in ("loss", "mlm", *LAYER_TERMS):
        values = [r[f"train/{term}"] for r in records]
        assert all(math.isfinite(v) and v >= 0 for v in values), (term, values)
        first, last = sum(values[:4]) / 4, sum(values[-4:]) / 4
        assert last < 0.95 * first, f"{term} did not fall: {first:.4f} over the first steps, {last:.4f} at the end"
    assert not any(f"train/{term}" in records[0] for term in ("ce", "mse", "cos"))  # no teacher logits, widths differ


@pytest.mark.full
def test_projections_train_in_the_engine_and_stay_out_of_the_export(layer_run: Path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForMaskedLM

    checkpoints = layer_run / "checkpoints"
    states = [get_fp32_state_dict_from_zero_checkpoint(str(checkpoints), tag=f"step-{s:08d}") for s in (8, 16)]
    owners = ("tinybert.embedding_projection", "tinybert.hidden_projection", "pkd.projection")
    projections = [f"layer_distillation.methods.{p}.{w}" for p in owners for w in ("weight", "bias")]
    for name in projections:
        assert states[0][name].shape[0] == 384  # 48 -> 384
        assert not torch.equal(states[0][name], states[1][name]), f"{name} did not change between checkpoints"

    student_dir = layer_run / "student"
    exported = load_file(student_dir / "model.safetensors")
    assert not any("projection" in key or key.startswith("layer_distillation") for key in exported)
    model = AutoModelForMaskedLM.from_pretrained(student_dir)
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (3, 48)
    for key, value in exported.items():  # the export is the student of the last checkpoint, nothing else
        assert torch.equal(value, states[1][f"student.{key}"])
