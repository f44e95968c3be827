"""Every preset plans offline, and its student has the published parameter count.

``plan`` reads only the teacher's ``config.json`` (``configs/teachers/``), as a user sizing a run
would. The count it reports is checked twice: exactly, against the encoder formula written out
below from the architecture (an independent count), and within TOLERANCE of the published
figure, whose counting conventions docs/objectives.md explains preset by preset.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import ConfigError, load_config
from trainer.commands.plan import main as plan_main
from trainer.config import TrainConfig
from trainer.planning.plan import build_plan

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TOLERANCE = 0.03  # the largest gap is MiniLM's "22M" for 22.56M (2.6%); see docs/objectives.md
BERT = dict(vocab=30522, positions=512)
ROBERTA = dict(vocab=50265, positions=514)

# preset: (teacher, vocabulary, (layers, hidden, heads, ffn), published parameters or None, layer maps)
PRESETS = {
    "distilbert-base": ("bert-base-uncased", BERT, (6, 768, 12, 3072), 66e6, {}),
    "tinybert-4l-312": (
        "bert-base-uncased",
        BERT,
        (4, 312, 12, 1200),
        14.5e6,
        {"tinybert": [[0, 2], [1, 5], [2, 8], [3, 11]]},
    ),
    "tinybert-6l-768": (
        "bert-base-uncased",
        BERT,
        (6, 768, 12, 3072),
        67e6,
        {"tinybert": [[0, 1], [1, 3], [2, 5], [3, 7], [4, 9], [5, 11]]},
    ),
    "pkd-skip-6l": (
        "bert-base-uncased",
        BERT,
        (6, 768, 12, 3072),
        67e6,
        {"pkd": [[0, 1], [1, 3], [2, 5], [3, 7], [4, 9]]},
    ),
    "minilm-6l-384": ("bert-base-uncased", BERT, (6, 384, 12, 1536), 22e6, {"minilm": [5, 11]}),
    "distilroberta-base": ("roberta-base", ROBERTA, (6, 768, 12, 3072), 82e6, {}),
    "tiny-roberta-4l-312": (
        "roberta-base",
        ROBERTA,
        (4, 312, 12, 1200),
        None,  # the paper's Korean vocabulary makes its figure incomparable
        {"tinybert": [[0, 2], [1, 5], [2, 8], [3, 11]]},
    ),
}


def encoder_params(vocab: int, positions: int, layers: int, hidden: int, ffn: int) -> int:
    """Embeddings (word, position, one token-type row, LayerNorm) + layers (Q, K, V, O, 2 LayerNorms, FFN)."""
    embeddings = (vocab + positions + 1) * hidden + 2 * hidden
    attention = 4 * (hidden * hidden + hidden) + 2 * hidden
    feed_forward = (hidden * ffn + ffn) + (ffn * hidden + hidden) + 2 * hidden
    return embeddings + layers * (attention + feed_forward)


def plan_for(preset: str, *overrides: str, teacher: str | None = None) -> dict:
    teacher = teacher or f"{REPO_CONFIGS}/teachers/{PRESETS[preset][0]}"
    cfg = load_config(TrainConfig, f"{REPO_CONFIGS}/{preset}.yaml", [f"teacher={teacher}", *overrides])
    return build_plan(cfg, world_size=1)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_plans_with_the_published_student_size(preset):
    _, vocab, (layers, hidden, heads, ffn), published, maps = PRESETS[preset]
    plan = plan_for(preset)
    student = plan["student"]
    assert (student["num_layers"], student["hidden_size"], student["num_attention_heads"]) == (layers, hidden, heads)
    assert student["intermediate_size"] == ffn
    assert plan["student_params"] == encoder_params(**vocab, layers=layers, hidden=hidden, ffn=ffn)
    if published is not None:
        assert abs(plan["student_params"] - published) <= TOLERANCE * published, (
            f"{preset}: {plan['student_params']:,} vs published {published:,.0f}"
        )
    assert plan["layer_distillation"]["maps"] == maps


def test_tinybert_4l_projections_are_reported_but_not_counted_in_the_student():
    plan = plan_for("tinybert-4l-312")
    assert plan["layer_distillation"]["projection_params"] == 2 * (312 * 768 + 768)  # W_e and W_h
    # TinyBERT's published 14.5M counts its one shared 312->768 projection with the encoder (2 token types).
    assert round((plan["student_params"] + 312 + 312 * 768 + 768) / 1e5) == 145


def test_plan_command_prints_the_layer_terms(capsys):
    teacher = f"{REPO_CONFIGS}/teachers/bert-base-uncased"
    assert plan_main([f"{REPO_CONFIGS}/minilm-6l-384.yaml", f"teacher={teacher}", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layer_distillation"]["weights"] == {"minilm_attention": 1.0, "minilm_value": 1.0}
    assert plan["flops_per_token"]["teacher_forward"] > 0
    assert plan_main([f"{REPO_CONFIGS}/tinybert-4l-312.yaml", f"teacher={teacher}"]) == 0
    assert "layer terms: 1·tinybert_embedding, 1·tinybert_hidden, 1·tinybert_attention" in capsys.readouterr().out


def test_a_teacher_without_mlm_head_serves_every_layer_objective(bert_tokenizer_dir):
    """all-MiniLM-L6-v2 (6 x 384, 12 heads, no MLM head): layer terms plan, teacher-logit terms are refused."""
    teacher = str(bert_tokenizer_dir)
    narrow = ["student.num_layers=3", "global_batch_size=256"]
    plan = plan_for("tinybert-4l-312", *narrow, teacher=teacher)
    assert plan["layer_distillation"]["maps"] == {"tinybert": [[0, 1], [1, 3], [2, 5]]}
    assert plan["layer_distillation"]["projection_params"] == 2 * (312 * 384 + 384)
    plan = plan_for(
        "minilm-6l-384", "student.num_attention_heads=6", "objective.minilm.relation_heads=12", teacher=teacher
    )
    assert plan["layer_distillation"]["maps"] == {"minilm": [5, 5]}
    plan = plan_for("pkd-skip-6l", "objective.ce=0", "student.teacher_layers=[0,2,4]", teacher=teacher)
    assert plan["layer_distillation"]["maps"] == {"pkd": [[0, 1], [1, 3]]}
    for key in ("ce", "mse"):
        with pytest.raises(ConfigError, match=rf"objective\.{key}: needs the teacher's logits"):
            plan_for("tinybert-4l-312", *narrow, f"objective.{key}=1", teacher=teacher)


def test_head_mismatch_for_tinybert_attention_is_a_config_error():
    with pytest.raises(ConfigError, match=r"objective\.tinybert\.attention: .* 12 heads \(it has 6\)"):
        plan_for("tinybert-4l-312", "student.num_attention_heads=6")
