"""``python -m trainer plan``: sizing a run from the teacher's config.json alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import EngineProbes, Probe

from common.cli import run_cli
from common.config import ConfigError, load_config
from trainer.__main__ import main as trainer_main
from trainer.commands import plan as plan_command
from trainer.config import TrainConfig
from trainer.modeling import base_config, load_teacher_config, student_config
from trainer.planning import plan

REPO = Path(__file__).resolve().parents[2]
BERT_BASE = REPO / "configs" / "teachers" / "bert-base-uncased"


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(
        f"teacher: {BERT_BASE}\ndata: {tmp_path / 'dataset'}\noutput_dir: {tmp_path / 'out'}\n"
        "global_batch_size: 4096\nmicro_batch_size: 16\nmax_steps: 100\n",
        encoding="utf-8",
    )
    return path


def run_plan(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert plan_command.main(list(argv)) == 0
    return capsys.readouterr().out


def test_json_plan_for_distilbert(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = json.loads(run_plan(capsys, str(config_file), "--json", "--world-size", "8"))
    assert result["teacher_params"] == 108_891_648  # bert-base-uncased encoder (no MLM head, no pooler)
    assert result["student_params"] == 66_362_880 + 768  # DistilBERT's 66M (+ one token-type row)
    assert result["layer_map"] == [0, 2, 4, 7, 9, 11]
    assert result["teacher"]["class"] == result["student"]["class"] == "BertForMaskedLM"
    assert result["student"]["num_layers"] == 6 and result["student"]["hidden_size"] == 768
    batch = result["batch"]
    assert batch["gradient_accumulation_steps"] == 32
    assert batch["micro_batch_size"] * batch["gradient_accumulation_steps"] * batch["world_size"] == 4096
    assert batch["seq_len"] == 512 and batch["tokens_per_step"] == 4096 * 512
    flops = result["flops_per_token"]
    assert flops["total"] == pytest.approx(flops["teacher_forward"] + flops["student_forward_backward"])
    # Student forward+backward of 6 layers is about 3 x 6/12 of the teacher's forward: 1.5x, plus the sparse heads.
    assert 1.4 < flops["student_forward_backward"] / flops["teacher_forward"] < 1.7
    assert result["flops_total"] == pytest.approx(flops["total"] * 4096 * 512 * 100)
    assert result["config"]["teacher"] == str(BERT_BASE) and result["data"]["found"] is False


def test_overrides_and_text_report(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = run_plan(
        capsys, str(config_file), "student.teacher_layers=[0,11]", "micro_batch_size=32", "--seq-len", "128"
    )
    assert "layer map (student layer i <- teacher layer): [0, 11]" in text
    assert "micro 32 x accumulation 128 x world size 1 = global 4096 sequences of 128 tokens" in text
    assert "teacher: BertForMaskedLM 12 layers x 768 hidden" in text


def test_sequence_length_and_epochs_come_from_the_manifest(
    config_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    manifest = {"max_seq_len": 256, "tokenizer": {"vocab_size": 30522}, "splits": {"train": {"samples": 204800}}}
    (dataset / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    result = json.loads(run_plan(capsys, str(config_file), "--json"))
    assert result["batch"]["seq_len"] == 256 and result["data"]["epochs"] == pytest.approx(100 * 4096 / 204800)
    manifest["tokenizer"]["vocab_size"] = 50265
    (dataset / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(ConfigError, match="data: the dataset's tokenizer has 50265 ids"):
        plan_command.main([str(config_file)])


def test_batch_that_does_not_divide_is_a_config_error(config_file: Path) -> None:
    with pytest.raises(ConfigError, match="global_batch_size"):
        plan_command.main([str(config_file), "--world-size", "3"])


def test_random_student_has_no_layer_map(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overrides = ["student.init=random", "student.hidden_size=384", "student.num_layers=4", "objective.cos=0"]
    result = json.loads(run_plan(capsys, str(config_file), *overrides, "--json"))
    assert result["layer_map"] is None and result["student"]["num_layers"] == 4
    assert result["student_params"] < 30e6


def test_cli_rejects_logit_losses_for_a_teacher_without_mlm_head(
    config_file: Path, bert_tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real all-MiniLM-L6-v2 has no MLM head: the default objective (ce=5) is refused before anything runs.

    Goes through the ``python -m trainer`` entry point (dispatch + error handling), in-process.
    """
    assert run_cli(trainer_main, ["plan", str(config_file), f"teacher={bert_tokenizer_dir}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: objective.ce: needs the teacher's logits") and "no masked-LM head" in err


def test_a_teacher_config_without_architectures_points_to_the_config(
    config_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config.json without ``architectures`` hides the MLM head: the error says how to declare it."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    config = json.loads((BERT_BASE / "config.json").read_text())
    del config["architectures"]
    (teacher / "config.json").write_text(json.dumps(config))
    assert run_cli(trainer_main, ["plan", str(config_file), f"teacher={teacher}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: objective.ce: needs the teacher's logits") and "declares no `architectures`" in err
    assert 'add "architectures": ["BertForMaskedLM"]' in err and "configs/teachers/*/config.json" in err


def meta_and_real_step(tiny_teacher_dir: Path, objective: str) -> tuple[Any, Any, Any, int]:
    """(config, the Distiller on the meta device as ``plan`` builds it, the same Distiller with real CPU
    weights, and a real packed micro-batch of 3 x 96) in bf16, attention dropout 0 (the CPU flash kernel has
    none; on a GPU flash keeps only the dropout's random state)."""
    import torch

    from trainer.modeling import model_from_config
    from trainer.objective.distiller import Distiller
    from trainer.objective.masking import MaskedBatch, Positions, max_masked

    overrides = [f"teacher={tiny_teacher_dir}", "data=unused", "output_dir=unused", "micro_batch_size=3"]
    overrides += ["global_batch_size=3"]
    overrides += ["deepspeed.precision=bf16"]
    if objective == "tinybert":  # layer terms: captured hidden states, attention scores, a learned projection
        overrides += [
            "objective.ce=0",
            "objective.cos=0",
            "objective.tinybert.hidden=1",
            "objective.tinybert.attention=1",
        ]
        overrides += ["student.init=random", "student.hidden_size=32", "student.num_attention_heads=4"]
        overrides += ["student.intermediate_size=64"]
    cfg = load_config(TrainConfig, None, overrides)
    teacher_config = load_teacher_config(cfg.teacher)
    teacher_config.attention_probs_dropout_prob = 0.0
    s_config = student_config(cfg.student, base_config(cfg.student, teacher_config))
    seq = 96
    meta, _ = plan.meta_distiller(cfg, teacher_config, s_config)

    torch.manual_seed(0)
    teacher = model_from_config(teacher_config).to(torch.bfloat16).eval()
    distiller = Distiller(model_from_config(s_config).to(torch.bfloat16).train(), teacher, cfg.objective)
    distiller.to(torch.bfloat16)
    budget = max_masked(cfg.masking.probability, seq)
    ids = torch.randint(1000, 30000, (3, seq))
    index = torch.stack([torch.randperm(seq)[:budget] for _ in range(3)])
    batch = MaskedBatch(
        ids, ids, Positions(index=index, valid=torch.ones_like(index, dtype=torch.bool)), ids[:, :budget]
    )
    return cfg, meta, distiller, batch


@pytest.mark.parametrize("objective", ["distilbert", "tinybert"])
def test_activation_count_on_meta_equals_what_a_real_step_saves(tiny_teacher_dir: Path, objective: str) -> None:
    """``plan``'s activation memory: counted on the meta device with flash attention's saves standing in for
    SDPA, it equals the bytes a real CPU step of the same micro-batch keeps for backward (each storage once,
    weights excluded), where SDPA runs its flash kernel (packed batch)."""
    import torch

    cfg, meta, distiller, batch = meta_and_real_step(tiny_teacher_dir, objective)
    counted = plan.activation_bytes(meta, cfg.micro_batch_size, cfg.masking.probability, batch.input_ids.shape[1])
    weights = {p.untyped_storage().data_ptr() for p in [*distiller.parameters(), *distiller.teacher.parameters()]}
    storages: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        distiller(batch, None)["loss"].backward()
    # Equal but for a few KB of per-row statistics: the CPU layer norm keeps its mean and 1/std of a bf16 input in
    # bf16, the meta kernel (as CUDA's) in float32. Saving score matrices or counting a view twice would be
    # tens of percent.
    assert counted == pytest.approx(sum(storages.values()), rel=5e-3)


@pytest.mark.parametrize("objective", ["distilbert", "tinybert"])
def test_peak_on_meta_equals_the_cpu_allocators_peak(tiny_teacher_dir: Path, tmp_path: Path, objective: str) -> None:
    """``plan``'s activations at the peak (what ``memory_gib`` adds to the weights): the most a forward and
    backward hold at once, tracked op by op on the meta device. Checked against the CPU allocator's own count
    of the same step (the profiler's memory events), gradients dropped in both as ZeRO moves them into its
    buckets. The saved activations alone fall short by what the step makes and frees around them (the losses'
    float32 temporaries: a fifth more at distilbert-base's 512 x 32)."""
    from torch.profiler import ProfilerActivity, profile

    cfg, meta, distiller, batch = meta_and_real_step(tiny_teacher_dir, objective)
    shape = (cfg.micro_batch_size, cfg.masking.probability, batch.input_ids.shape[1])
    counted, saved = plan.peak_activation_bytes(meta, *shape), plan.activation_bytes(meta, *shape)
    for p in distiller.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        distiller(batch, None)["loss"].backward()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    allocated = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]  # since the start
    # Within 0.5% (measured: 0.02% and 0.05%); the saved activations alone are about half of it here
    assert counted == pytest.approx(max(allocated), rel=5e-3)
    assert counted > 1.5 * saved


@pytest.mark.full
@pytest.mark.parametrize(
    "probe",
    [
        # the launches of test_plan_cluster.py's 2-rank communication cases (one each: equal probes), with an
        # accumulation of 2: ZeRO-1 keeps its bucket between the micro-steps, ZeRO-3 its partition and bucket
        Probe("zero1", 2, "bf16", 8),
        Probe("zero3", 2, "fp32", 8),
        # ZeRO-2 without accumulation: between micro-steps it also holds the reduced gradients' partition, which
        # plan does not count (memory_per_rank's "Not counted")
        Probe("zero2", 2, "fp32", 4),
    ],
    ids=str,
)
def test_memory_parts_equal_what_a_real_engine_keeps(
    tiny_teacher_dir: Path, engine_probes: EngineProbes, probe: Probe
) -> None:
    """``plan``'s memory per rank against the tensors a real DeepSpeed engine keeps on two CPU ranks (the
    launcher, gloo; ``tests/trainer/engine_probe.py``), with the shipped ZeRO JSON: between steps it holds
    the teacher, the student's weights, the partitioned optimizer states, and under ZeRO-3 the gradient
    partition and the reduction bucket; during backward ZeRO-1 and -2 add their buckets. Offload is left
    out: on CPU ranks the offloaded states sit in the same memory as everything else."""
    from trainer.runtime.engine import deepspeed_config

    overrides = probe.overrides(tiny_teacher_dir)
    engine = engine_probes.measure(probe)

    cfg = load_config(TrainConfig, REPO / "configs" / "tiny-cpu.yaml", overrides)
    teacher_config = load_teacher_config(cfg.teacher)
    distiller, teacher = plan.meta_distiller(
        cfg, teacher_config, student_config(cfg.student, base_config(cfg.student, teacher_config))
    )
    planned = plan.memory_per_rank(distiller, teacher, deepspeed_config(cfg, 2), 2, activations=0)

    between_steps = planned["teacher"] + planned["student_weights"] + planned["optimizer_states"]
    between_steps += planned["gradient_partition"]
    in_backward = planned["buckets"] + engine["word_embedding_grad"]
    if (
        probe.zero == "zero3"
    ):  # its bucket is held for the run; in backward, the gathered word embedding beside its gradient
        between_steps, in_backward = between_steps + planned["buckets"], 2 * engine["word_embedding_grad"]
    # Within 0.5%: the rest is a few KB (AdamW's step counters, the batch, padding of the partitions); a part
    # missing or counted whole instead of partitioned would be tens of percent.
    assert engine["held"] == pytest.approx(between_steps, rel=5e-3)
    assert engine["in_backward"] - engine["held"] == pytest.approx(in_backward, rel=5e-3)
    assert planned["buckets"] > 0


SHIPPED_ZERO = sorted((REPO / "configs" / "deepspeed").glob("*.json"))
PRESETS = {  # preset -> its teacher's config, offline
    "distilbert-base": BERT_BASE,
    "tinybert-4l-312": BERT_BASE,
    "tinybert-6l-768": BERT_BASE,
    "pkd-skip-6l": BERT_BASE,
    "minilm-6l-384": BERT_BASE,
    "distilroberta-base": REPO / "configs" / "teachers" / "roberta-base",
    "tiny-roberta-4l-312": REPO / "configs" / "teachers" / "roberta-base",
}


@pytest.mark.parametrize("zero", SHIPPED_ZERO, ids=lambda path: path.stem)
def test_shipped_buckets_fit_the_presets(zero: Path) -> None:
    """The gradient-reduction buckets of each shipped ZeRO JSON are sized for the students: large enough for
    every preset's largest tensor (RoBERTa's 50,265 x 768 word embedding), so that none takes DeepSpeed's
    separate path for oversized gradients, and no larger than the default preset's whole gradient, which
    a larger bucket could never fill: the excess would be memory for nothing, and the reduction could not
    start before backward ends. DeepSpeed's default, 5e8 elements, is 7.5 times distilbert-base's 66M
    (1.9 GiB of bf16 buffers under ZeRO-2 with ``overlap_comm``, for 0.9 GiB of weights and optimizer states)."""
    for preset, teacher in PRESETS.items():
        cfg = load_config(
            TrainConfig, REPO / "configs" / f"{preset}.yaml", [f"teacher={teacher}", f"deepspeed.config={zero}"]
        )
        teacher_config = load_teacher_config(str(teacher))
        s_config = student_config(cfg.student, base_config(cfg.student, teacher_config))
        distiller, _ = plan.meta_distiller(cfg, teacher_config, s_config)
        largest = max(p.numel() for p in distiller.parameters())
        bucket = json.loads(zero.read_text())["zero_optimization"]["reduce_bucket_size"]
        assert largest <= bucket, f"{preset}: a {largest:,}-element tensor does not fit a bucket of {bucket:,}"
        if preset == "distilbert-base":
            assert bucket <= sum(p.numel() for p in distiller.parameters())
