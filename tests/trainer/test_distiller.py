"""The Distiller: sparse-position losses equal the dense formulas, the teacher stays outside, FLOPs add up."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import PreTrainedModel

from common.config import ConfigError, load_config
from trainer.config import MaskingConfig, ObjectiveConfig, StudentConfig, TinyBertConfig, TrainConfig
from trainer.modeling import RowPaddedLinear, build_student, load_teacher, load_teacher_config, padded_linear
from trainer.objective.distiller import OUTPUT_LOSSES, Distiller, eval_metrics, validate_against_teacher
from trainer.objective.masking import DynamicMasker, MaskedBatch, seeded_generator
from trainer.planning.plan import step_flops_per_token

SPECIALS = [0, 100, 101, 102, 103]  # bert-base-uncased [PAD] [UNK] [CLS] [SEP] [MASK]


@pytest.fixture(scope="module")
def teacher(tiny_teacher_dir: Path) -> PreTrainedModel:
    return load_teacher(str(tiny_teacher_dir), torch.float32)


@pytest.fixture(scope="module")
def student(teacher: PreTrainedModel) -> PreTrainedModel:
    torch.manual_seed(0)
    return build_student(StudentConfig(), teacher).eval()  # eval: no dropout, so dense and sparse paths agree


@pytest.fixture(scope="module")
def batch() -> tuple[MaskedBatch, torch.Tensor]:
    """A masked batch whose last sequence is padded after 40 tokens, and its attention mask."""
    ids = torch.randint(1000, 30000, (3, 64), generator=torch.Generator().manual_seed(3))
    ids[:, 0], ids[:, 30] = 101, 102
    ids[2, 40:] = 0
    attention_mask = (ids != 0).long()
    masker = DynamicMasker(MaskingConfig(), vocab_size=30522, mask_id=103, special_ids=SPECIALS)
    return masker(ids, attention_mask, seeded_generator(0, 0, 0)), attention_mask


def dense_terms(student, teacher, batch, attention_mask, objective: ObjectiveConfig) -> dict[str, float]:
    """The four terms from full ``[batch, seq, vocab]`` logits and boolean indexing: the obvious way."""
    masked, labels = batch.input_ids, batch.labels
    s = student(input_ids=masked, attention_mask=attention_mask, output_hidden_states=True)
    t = teacher(input_ids=masked, attention_mask=attention_mask, output_hidden_states=True)
    real, chosen = attention_mask.bool(), labels != -100
    at = chosen if objective.ce_positions == "masked" else real
    temperature = objective.temperature
    kl = F.kl_div(
        F.log_softmax(s.logits[at] / temperature, -1), F.softmax(t.logits[at] / temperature, -1), reduction="batchmean"
    )
    cos = 1 - F.cosine_similarity(s.hidden_states[-1][real], t.hidden_states[-1][real], dim=-1)
    return {
        "ce": kl.item() * temperature**2,
        "mlm": F.cross_entropy(s.logits[chosen], labels[chosen]).item(),
        "cos": cos.mean().item(),
        "mse": F.mse_loss(s.logits[at], t.logits[at]).item(),
    }


@pytest.mark.parametrize("positions", ["masked", "all"])
def test_losses_equal_the_dense_computation(student, teacher, batch, positions: str) -> None:
    objective = ObjectiveConfig(ce=5.0, mlm=2.0, cos=1.0, mse=0.5, ce_positions=positions)
    out = Distiller(student, teacher, objective)(*batch)
    expected = dense_terms(student, teacher, *batch, objective)
    assert set(out) == {"loss", "ce", "mlm", "cos", "mse"}
    for name, value in expected.items():
        assert out[name].item() == pytest.approx(value, rel=1e-4, abs=1e-6), name
    weighted = 5.0 * out["ce"] + 2.0 * out["mlm"] + 1.0 * out["cos"] + 0.5 * out["mse"]
    assert out["loss"].item() == pytest.approx(weighted.item(), rel=1e-6)


def test_zero_weights_are_not_computed_and_teacher_skipped(student, teacher, batch) -> None:
    calls = []
    handle = teacher.register_forward_hook(lambda *args: calls.append(1))
    try:
        out = Distiller(student, teacher, ObjectiveConfig(ce=0.0, cos=0.0, mlm=1.0))(*batch)
        assert set(out) == {"loss", "mlm"} and calls == []
        assert out["loss"].item() == pytest.approx(out["mlm"].item())
    finally:
        handle.remove()


def test_no_attention_mask_means_no_padding(student, teacher) -> None:
    ids = torch.randint(1000, 30000, (2, 32), generator=torch.Generator().manual_seed(4))
    masker = DynamicMasker(MaskingConfig(), vocab_size=30522, mask_id=103, special_ids=SPECIALS)
    masked = masker(ids, None, seeded_generator(1))
    distiller = Distiller(student, teacher, ObjectiveConfig(mse=1.0))
    without, with_ones = distiller(masked, None), distiller(masked, torch.ones_like(ids))
    for name in without:
        assert without[name].item() == pytest.approx(with_ones[name].item(), rel=1e-5)


def test_teacher_is_outside_the_module_and_gets_no_gradient(teacher: PreTrainedModel, batch) -> None:
    student = build_student(StudentConfig(), teacher)
    distiller = Distiller(student, teacher, ObjectiveConfig(mse=1.0))
    teacher_params = {id(p) for p in teacher.parameters()}
    assert not teacher_params & {id(p) for p in distiller.parameters()}
    assert all(name.startswith("student.") for name in distiller.state_dict())
    assert distiller.teacher is teacher and distiller.student_model() is student
    distiller.train()
    assert not teacher.training  # .train() on the Distiller does not reach the teacher
    distiller(*batch)["loss"].backward()
    assert all(p.grad is None for p in teacher.parameters())
    grads = [p.grad for p in student.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert student.bert.encoder.layer[0].attention.self.query.weight.grad.abs().sum() > 0


def test_evaluate_sums_match_dense_metrics(student, teacher, batch) -> None:
    batch, attention_mask = batch
    masked, labels = batch.input_ids, batch.labels
    distiller = Distiller(student, teacher, ObjectiveConfig()).train()
    sums = {k: v.item() for k, v in distiller.evaluate(batch, attention_mask).items()}
    assert distiller.training and student.training  # restored after evaluating in eval mode
    student.eval()
    chosen = labels != -100
    s_logits = student(input_ids=masked, attention_mask=attention_mask).logits[chosen]
    t_logits = teacher(input_ids=masked, attention_mask=attention_mask).logits[chosen]
    metrics = eval_metrics(sums)
    assert sums["predicted"] == chosen.sum().item()
    assert metrics["student_mlm_loss"] == pytest.approx(F.cross_entropy(s_logits, labels[chosen]).item(), rel=1e-5)
    assert metrics["teacher_mlm_loss"] == pytest.approx(F.cross_entropy(t_logits, labels[chosen]).item(), rel=1e-5)
    n = chosen.sum().item()
    assert metrics["student_mlm_accuracy"] == (s_logits.argmax(-1) == labels[chosen]).sum().item() / n
    assert metrics["teacher_mlm_accuracy"] == (t_logits.argmax(-1) == labels[chosen]).sum().item() / n
    assert metrics["top1_agreement"] == (s_logits.argmax(-1) == t_logits.argmax(-1)).sum().item() / n
    # The hidden-state cosines over the real tokens (the padded tail of sequence 2 left out), plain and
    # with each model's mean over those tokens removed: the obvious way, from [tokens, width] rows.
    real = attention_mask.bool()
    s_rows, t_rows = (
        m(input_ids=masked, attention_mask=attention_mask, output_hidden_states=True).hidden_states[-1][real]
        for m in (student, teacher)
    )
    assert sums["real_tokens"] == real.sum().item() < real.numel()
    assert metrics["hidden_cosine"] == pytest.approx(F.cosine_similarity(s_rows, t_rows, dim=-1).mean().item())
    centred = F.cosine_similarity(s_rows - s_rows.mean(0), t_rows - t_rows.mean(0), dim=-1).mean().item()
    assert metrics["centred_cosine"] == pytest.approx(centred, abs=1e-6)


def test_a_full_copy_of_the_teacher_agrees_with_it(teacher, batch) -> None:
    clone = build_student(StudentConfig(teacher_layers=[0, 1, 2, 3]), teacher)
    sums = Distiller(clone, teacher, ObjectiveConfig()).evaluate(*batch)
    metrics = eval_metrics({k: v.item() for k, v in sums.items()})
    assert metrics["top1_agreement"] == 1.0
    assert metrics["student_mlm_loss"] == pytest.approx(metrics["teacher_mlm_loss"], rel=1e-5)
    assert metrics["hidden_cosine"] == pytest.approx(1.0) and metrics["centred_cosine"] == pytest.approx(1.0)


def test_teacher_without_mlm_head_trains_with_mlm_and_cos(bert_tokenizer_dir: Path, batch) -> None:
    minilm = load_teacher(str(bert_tokenizer_dir), torch.float32)  # the real all-MiniLM-L6-v2, no MLM head
    student = build_student(StudentConfig(), minilm)
    distiller = Distiller(student, minilm, ObjectiveConfig(ce=0.0, mlm=2.0, cos=1.0))
    out = distiller(*batch)
    assert set(out) == {"loss", "mlm", "cos"} and torch.isfinite(out["loss"])
    out["loss"].backward()
    # Evaluated against it: no predictions to agree with, but its hidden states to compare with.
    metrics = eval_metrics({k: v.item() for k, v in distiller.evaluate(*batch).items()})
    assert "top1_agreement" not in metrics and "teacher_mlm_loss" not in metrics
    assert -1 <= metrics["centred_cosine"] <= 1 and -1 <= metrics["hidden_cosine"] <= 1


def train_config(teacher: str, **overrides: object) -> TrainConfig:
    return load_config(
        TrainConfig, None, [f"teacher={teacher}", "data=d", "output_dir=o"] + [f"{k}={v}" for k, v in overrides.items()]
    )


@pytest.mark.parametrize("key", ["ce", "mse"])
def test_logit_losses_need_a_teacher_mlm_head(bert_tokenizer_dir: Path, key: str) -> None:
    teacher_config = load_teacher_config(str(bert_tokenizer_dir))
    others = {"objective.ce": 0.0, "objective.mse": 0.0, f"objective.{key}": 1.0}
    with pytest.raises(ConfigError, match=rf"objective\.{key}: .*no masked-LM head"):
        validate_against_teacher(train_config(str(bert_tokenizer_dir), **others), teacher_config)
    validate_against_teacher(train_config(str(bert_tokenizer_dir), **{"objective.ce": 0.0}), teacher_config)


def test_cosine_loss_needs_equal_widths(tiny_teacher_dir: Path) -> None:
    narrow = {"student.init": "random", "student.hidden_size": 32, "student.num_attention_heads": 2}
    with pytest.raises(ConfigError, match=r"objective\.cos"):
        validate_against_teacher(
            train_config(str(tiny_teacher_dir), **narrow), load_teacher_config(str(tiny_teacher_dir))
        )


@pytest.mark.parametrize(
    "objective",
    [
        ObjectiveConfig(),
        ObjectiveConfig(ce=0.0, cos=0.0),
        ObjectiveConfig(ce=0.0, mlm=0.0, cos=1.0),
        ObjectiveConfig(mse=1.0, ce_positions="all"),
    ],
    ids=["distilbert", "mlm-only", "cos-only", "all-positions"],
)
def test_step_flops_formula_matches_counted_matmuls(student, teacher, batch, objective: ObjectiveConfig) -> None:
    """Teacher forward + student forward/backward, with the vocabulary projection only where needed."""
    masked, _ = batch
    distiller = Distiller(student, teacher, objective)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        distiller(masked, None)["loss"].backward()
    ids = masked.input_ids
    expected = step_flops_per_token(objective, teacher.config, student.config, 0.15, ids.shape[1])["total"]
    assert counter.get_total_flops() == pytest.approx(expected * ids.numel(), rel=1e-9)


def test_bf16_step_matches_float32(student, teacher, batch) -> None:
    """In DeepSpeed's bf16 mode both models hold bf16 weights; the losses are still float32 and close."""
    reference = Distiller(student, teacher, ObjectiveConfig(mse=1.0))(*batch)
    low = Distiller(copy.deepcopy(student).bfloat16(), copy.deepcopy(teacher).bfloat16(), ObjectiveConfig(mse=1.0))
    out = low(*batch)
    for name, value in reference.items():
        assert out[name].dtype == torch.float32
        assert out[name].item() == pytest.approx(value.item(), rel=0.05, abs=1e-3), name
    out["loss"].backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in low.student.parameters())


@pytest.mark.parametrize(
    "objective",
    [
        ObjectiveConfig(),
        ObjectiveConfig(ce=0.0, tinybert=TinyBertConfig(embedding=1.0, hidden=1.0, attention=1.0)),
        ObjectiveConfig(vocab_multiple=64),
    ],
    ids=["distilbert", "tinybert-layer-hooks", "distilbert-padded-vocab"],
)
@pytest.mark.full
def test_compiled_models_give_the_eager_losses_and_gradients_and_compile_once(
    tiny_teacher_dir: Path, batch, objective: ObjectiveConfig
) -> None:
    """``compile=true``: what a step calls (encoders, heads, layer methods, output losses) is compiled, hooks of
    the layer methods included, with the eager step's numbers and no graph break; later steps reuse the graphs
    (the hooks come and go every step). On models as a run loads them: the module fixtures were asked for
    ``output_hidden_states`` (dense_terms), which installs Hugging Face's output hooks, and a run never does."""
    import torch._dynamo

    teacher = load_teacher(str(tiny_teacher_dir), torch.float32)
    torch.manual_seed(0)
    student = build_student(StudentConfig(), teacher).eval()
    torch._dynamo.reset()
    breaks_before = sum(torch._dynamo.utils.counters["graph_break"].values())
    eager = Distiller(copy.deepcopy(student), teacher, objective)
    compiled = Distiller(copy.deepcopy(student), copy.deepcopy(teacher), objective)
    compiled.load_state_dict(eager.state_dict())  # the same learned projections
    compiled.compile_models()
    expected = eager(*batch)
    expected["loss"].backward()
    graphs = []
    for _ in range(3):
        compiled.zero_grad()
        out = compiled(*batch)
        out["loss"].backward()
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] > 0, "nothing was compiled: the step calls other modules than those compiled"
    assert graphs[0] == graphs[-1], f"recompiled on later steps: {graphs}"
    # A break splits the encoder into pieces with a trip through Python between them. torch 2.11 broke at every
    # capture hook while they were functools.partial(dict.__setitem__, ...): 17 graphs here, not 6.
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert sum(breaks.values()) == breaks_before, f"graph breaks: {list(breaks)}"
    if objective.tinybert.attention:  # without hook guards torch 2.11 skipped the teacher's hooks (KeyError above)
        assert torch._dynamo.config.skip_nnmodule_hook_guards is False
    for name, value in expected.items():
        assert out[name].item() == pytest.approx(value.item(), rel=1e-4, abs=1e-6), name
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-3, atol=1e-6), name
    assert list(compiled.state_dict()) == list(eager.state_dict())  # checkpoints and export see the same keys
    for name, fn in compiled.losses.items():  # each term's loss is its compiled twin
        assert getattr(fn, "_torchdynamo_orig_callable", None) is OUTPUT_LOSSES[name], name


def test_the_naive_reference_step_computes_the_projects_losses(student, teacher, tiny_teacher_dir: Path) -> None:
    """benchmarks/naive_step.py (the baseline the GPU campaign compares with) optimises the same objective:
    on the mask it draws, its L_ce, L_mlm and L_cos equal the Distiller's, so the speed ratio compares
    like with like."""
    import importlib.util

    from common.tokenizer import load_tokenizer

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("naive_step", repo / "benchmarks" / "naive_step.py")
    naive_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(naive_step)  # benchmarks/ is not a package

    overrides = [f"teacher={tiny_teacher_dir}", "data=unused", "output_dir=unused"]
    cfg = load_config(TrainConfig, repo / "configs" / "tiny-cpu.yaml", overrides)
    naive = naive_step.NaiveStep(
        cfg, teacher, copy.deepcopy(student), load_tokenizer(str(tiny_teacher_dir)), torch.device("cpu")
    )
    naive.student.eval()  # no dropout, as the Distiller below
    ids = torch.randint(1000, 30000, (3, 64), generator=torch.Generator().manual_seed(5))
    ids[:, 0], ids[:, 30] = 101, 102
    corrupted, labels = naive.mask_on_host(ids, torch.Generator().manual_seed(7))
    logged = naive.forward_backward(ids, torch.Generator().manual_seed(7))  # the same draw
    masked = MaskedBatch.from_labels(corrupted, labels, budget=64)  # every chosen position, no budget cut
    out = Distiller(student, teacher, cfg.objective)(masked, torch.ones_like(ids))
    # The student copies the teacher's layers, so L_ce is ~1e-5: a difference of nearly equal float32 sums over
    # the vocabulary, computed in another order (softmax vs log-softmax target): hence an absolute tolerance.
    for name in ("ce", "mlm", "cos"):
        assert logged[name] == pytest.approx(float(out[name].detach()), rel=1e-4, abs=1e-6), name


def test_a_padded_linear_is_the_plain_one_forward_and_backward() -> None:
    """``padded_linear`` pads the weight's rows for the matmul and slices the padding's outputs off: in float64 the
    same outputs and the same gradients for the input, weight and bias; rows already aligned are left as they are."""
    x, weight, bias = (
        torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in [(5, 8), (30, 8), (30,)]
    )
    grad = torch.randn(5, 30, dtype=torch.float64)
    plain, padded = F.linear(x, weight, bias), padded_linear(x, weight, bias, multiple=64)
    assert padded.shape == plain.shape and torch.allclose(padded, plain, rtol=0, atol=1e-12)
    ours = torch.autograd.grad(padded, (x, weight, bias), grad)
    theirs = torch.autograd.grad(plain, (x, weight, bias), grad)
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-12)
    aligned = torch.randn(64, 8, dtype=torch.float64)
    assert torch.equal(padded_linear(x, aligned, None, 64), F.linear(x, aligned))


def test_objective_vocab_multiple_pads_both_decoders_and_changes_no_number(tiny_teacher_dir: Path, batch) -> None:
    """``objective.vocab_multiple=64``: the student's and the teacher's decoders compute their 30,522 logits from
    30,528 rows, with the plain step's losses and gradients, over the same (still tied) parameters, so that
    parameter names, checkpoints and the exported student are unchanged."""
    teacher = load_teacher(str(tiny_teacher_dir), torch.float32)
    torch.manual_seed(0)
    student = build_student(StudentConfig(), teacher).eval()
    plain = Distiller(copy.deepcopy(student), copy.deepcopy(teacher), ObjectiveConfig())
    padded = Distiller(copy.deepcopy(student), copy.deepcopy(teacher), ObjectiveConfig(vocab_multiple=64))
    for model in (padded.student, padded.teacher):
        decoder = model.get_output_embeddings()
        assert isinstance(decoder, RowPaddedLinear) and decoder.multiple == 64 and decoder.out_features == 30522
        assert decoder.weight is model.get_input_embeddings().weight  # tied as before
    assert not isinstance(plain.student.get_output_embeddings(), RowPaddedLinear)
    expected, out = plain(*batch), padded(*batch)
    expected["loss"].backward()
    out["loss"].backward()
    for name, value in expected.items():
        assert out[name].item() == pytest.approx(value.item(), rel=1e-6, abs=1e-7), name
    for (name, p), q in zip(plain.named_parameters(), padded.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name
    assert list(padded.state_dict()) == list(plain.state_dict())
    assert [name for name, _ in padded.named_parameters()] == [name for name, _ in plain.named_parameters()]

    with pytest.raises(ConfigError, match=r"objective\.vocab_multiple"):
        ObjectiveConfig(vocab_multiple=0).validate()
