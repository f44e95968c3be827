"""The steps ``benchmarks/distill_step.py`` compares run on equal terms (issue 52): the naive script's teacher in
the project's 16-bit dtype, the same gradient clipping in every step, and the real peer (TextBrewer) configured
for the same objective.

Tiny models on the CPU: a few seconds in all. The peer's test runs where TextBrewer is installed (the GPU
machine's carried wheel; here ``pip install --target DIR`` of ``.gpu/wheels/textbrewer-*.whl`` put on
``PYTHONPATH``, docs/gpu-machine.md) and is skipped elsewhere.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.distill_step import MasterWeights, synthetic_batch
from benchmarks.naive_step import NaiveStep
from common.config import load_config
from trainer.config import TrainConfig
from trainer.modeling import training_dtype
from trainer.objective.masking import seeded_generator

REPO = Path(__file__).resolve().parents[1]


def preset(*overrides: str) -> TrainConfig:
    """The distilbert-base preset, whose step the GPU campaign compares (bf16, grad_clip 5, T = 2, 5/2/1)."""
    base = ["teacher=unused", "data=unused", "output_dir=unused", "micro_batch_size=2"]
    return load_config(TrainConfig, REPO / "configs" / "distilbert-base.yaml", [*base, *overrides])


def tiny_bert(layers: int, vocab: int, seed: int) -> Any:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,  # the same forward twice: the peer's gradients against the naive step's
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


@pytest.fixture(scope="module")
def tokenizer(bert_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bert_tokenizer_dir, use_fast=True)


def batch(tokenizer: Any, i: int = 0) -> torch.Tensor:
    return synthetic_batch(tokenizer, 2, 32, seeded_generator(0, i))


def test_the_naive_teacher_runs_under_the_project_step_s_16_bit_dtype(tokenizer: Any) -> None:
    """The naive teacher used to run in float32 (TF32 off) against the project's bf16 teacher: at least ~58 of the
    naive step's ~135 ms on an H200 came from that alone. Its forward now runs under autocast in the training dtype,
    the dtype the project's step gives its teacher's weights; the student's too."""
    cfg = preset()
    seen: dict[str, tuple[bool, torch.dtype]] = {}

    def record(name: str) -> Any:
        def hook(module: Any, args: Any) -> None:
            seen[name] = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))

        return hook

    vocab = len(tokenizer)
    naive = NaiveStep(cfg, tiny_bert(2, vocab, 0), tiny_bert(1, vocab, 1), tokenizer, torch.device("cpu"))
    naive.teacher.register_forward_pre_hook(record("teacher"))
    naive.student.register_forward_pre_hook(record("student"))
    naive.forward_backward(batch(tokenizer), seeded_generator(0, 0))
    project_dtype = training_dtype(cfg.deepspeed.precision)
    assert project_dtype == torch.bfloat16
    assert seen == {"teacher": (True, project_dtype), "student": (True, project_dtype)}

    seen.clear()  # fp32 training: no autocast for either, as the project's float32 teacher
    naive = NaiveStep(preset("deepspeed.precision=fp32"), naive.teacher, naive.student, tokenizer, torch.device("cpu"))
    naive.forward_backward(batch(tokenizer), seeded_generator(0, 0))
    assert not seen["teacher"][0] and not seen["student"][0]


@pytest.mark.parametrize("grad_clip", [5.0, 0.0])
def test_the_project_and_naive_steps_clip_their_gradients_the_same_way(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch, grad_clip: float
) -> None:
    """The naive step clipped and the project's bare step did not. Both now clip the global norm to the preset's
    optimizer.grad_clip, as the engine does (DeepSpeed's gradient_clipping), and neither clips at 0."""
    cfg = preset(f"optimizer.grad_clip={grad_clip}")
    clips: list[tuple[str, float, int]] = []
    original = torch.nn.utils.clip_grad_norm_
    which = ""

    def recording(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        parameters = list(parameters)
        clips.append((which, max_norm, len(parameters)))
        return original(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording)
    vocab = len(tokenizer)
    which = "naive"
    student = tiny_bert(1, vocab, 1)
    NaiveStep(cfg, tiny_bert(2, vocab, 0), student, tokenizer, torch.device("cpu"))(
        batch(tokenizer), seeded_generator(0, 0)
    )
    which = "project"
    student = tiny_bert(1, vocab, 1).to(training_dtype(cfg.deepspeed.precision))  # the project's 16-bit student
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = MasterWeights(params, cfg, fused=False)
    student(input_ids=batch(tokenizer)).logits.float().square().mean().backward()
    optimizer.step()
    if grad_clip:
        assert [(name, max_norm) for name, max_norm, _ in clips] == [("naive", grad_clip), ("project", grad_clip)]
        assert clips[0][2] == clips[1][2] == len(params)  # every parameter of the student, in both
    else:
        assert clips == []


def test_the_peer_step_trains_the_naive_step_s_objective(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """TextBrewer configured for DistilBERT's terms (soft cross-entropy at T = 2 with weight 5 T^2, the MLM loss with
    weight 2, the last hidden states' cosine with weight 1) gives the student the gradients of the naive step's
    objective, on the same masked batch: the same losses, however differently computed. Its loss is larger by the
    teacher's entropy (its soft cross-entropy is the KL divergence plus that constant). And it clips as the
    others do."""
    pytest.importorskip("textbrewer")
    from benchmarks.peer_step import PeerStep

    cfg = preset("deepspeed.precision=fp32")  # float32 both ways: the gradients compared to rounding
    vocab = len(tokenizer)
    teacher, student = tiny_bert(2, vocab, 0), tiny_bert(1, vocab, 1)
    naive = NaiveStep(cfg, copy.deepcopy(teacher), copy.deepcopy(student), tokenizer, torch.device("cpu"))
    peer = PeerStep(cfg, teacher, student, tokenizer, torch.device("cpu"), [batch(tokenizer, i) for i in range(2)])
    masked = peer.batches[0]["student"]
    assert masked["labels"].ne(-100).any()
    naive_loss = naive.masked_forward_backward(masked["input_ids"], masked["labels"])["loss"]
    peer_loss = peer.forward_backward(0).item()
    assert peer_loss > naive_loss  # + 5 T^2 x the teacher's mean entropy at the masked positions
    for (name, p), q in zip(peer.student.named_parameters(), naive.student.parameters(), strict=True):
        if p.grad is None:
            assert q.grad is None or not q.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)

    clips: list[float] = []
    original = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(
        torch.nn.utils, "clip_grad_norm_", lambda ps, max_norm, **kw: clips.append(max_norm) or original(ps, max_norm)
    )
    peer.optimizer.zero_grad()
    peer(1)
    assert clips == [cfg.optimizer.grad_clip]
    assert all(p.grad is None for p in peer.student.parameters())  # zeroed after the step, as TextBrewer's loop does
