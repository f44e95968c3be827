"""The GPU path, proven on a real GPU: ``pytest -m gpu tests/gpu`` (the campaign's ``benchmarks/gpu/run.sh``).

Skipped where no CUDA device is present (CI never needs them). The tests read runs of the real launcher,
``deepspeed --num_gpus 1 launch/run.sh configs/tiny-cpu.yaml ...``, with the tiny BERT teacher of
``tests/helpers.py`` and real shards made by the preprocessing pipeline: ``ENCODER_DISTILL_GPU_DATA``
(the GPU machine has no Beam; ``make gpu-data`` writes ``.gpu/data-128``), else the session's tiny dataset.
The runs that the selected tests read start together (``launched``), and the tests that run in this
process (sync-free step, held-out scores) overlap them.

``ENCODER_DISTILL_GPU_TESTS_ON=cpu`` runs the same bodies on a CPU rank (DS_ACCELERATOR=cpu), except the
checks only CUDA can make (fp16 loss scaling, CUDA's sync debug mode): a dry run of everything else,
so that a GPU session spends its minutes on the GPU, not on the tests' own bugs.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import (
    FP16_OVERFLOW,
    REPO,
    check_fp16_overflows_were_skipped,
    finish_run,
    kill_and_resume,
    launch_run,
    records,
    train_losses,
)

ON = os.environ.get("ENCODER_DISTILL_GPU_TESTS_ON", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ON == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
cuda_only = pytest.mark.skipif(ON != "cuda", reason="a CUDA-only check (dry run on CPU)")

MAX_STEPS = 20
SETTINGS = [
    f"max_steps={MAX_STEPS}",
    "deepspeed.precision=bf16",
    "checkpoint.every_steps=5",
    "checkpoint.keep_last=2",
    "eval.every_steps=10",
    "logging.every_steps=1",
    "loader.num_workers=1",
]
LOSS_KEYS = ("train/loss", "train/ce", "train/mlm", "train/cos")
RUN_TIMEOUT = 600  # the first ZeRO-Offload run compiles DeepSpeed's CPU Adam


@pytest.fixture(scope="session")
def gpu_dataset_dir(request: pytest.FixtureRequest) -> Path:
    carried = os.environ.get("ENCODER_DISTILL_GPU_DATA")
    return Path(carried) if carried else request.getfixturevalue("tiny_dataset_dir")


def start(teacher: Path, data: Path, out: Path, *overrides: str):
    return launch_run(
        "configs/tiny-cpu.yaml",
        out,
        f"teacher={teacher}",
        f"data={data}",
        *SETTINGS,
        *overrides,
        num_gpus=1,
        accelerator=ON,
    )


def run(teacher: Path, data: Path, out: Path, *overrides: str) -> Path:
    finish_run(start(teacher, data, out, *overrides), out, RUN_TIMEOUT)
    return out


def resume(teacher: Path, data: Path, out: Path) -> Path:
    """A run killed two steps after a checkpoint, relaunched to the end."""
    kill_and_resume(lambda: start(teacher, data, out), out, rank=0, max_steps=MAX_STEPS, timeout=RUN_TIMEOUT)
    return out


# Every launcher run that the tests read: how it runs, and its overrides. The ZeRO-2 run is also the
# reference that `resumed` must reach, and `again` (the same config) measures the GPU's run-to-run spread.
RUNS = {
    "zero1": (run, "deepspeed.config=configs/deepspeed/zero1.json"),
    "zero2": (run, "deepspeed.config=configs/deepspeed/zero2.json"),
    "zero3": (run, "deepspeed.config=configs/deepspeed/zero3.json"),
    "again": (run, "deepspeed.config=configs/deepspeed/zero2.json"),
    "resumed": (resume,),
    "fp16": (run, *FP16_OVERFLOW, "max_steps=40"),
    "offload": (run, "deepspeed.config=configs/deepspeed/zero2-offload.json"),
}
# How many run at once. A tiny run leaves the GPU idle most of its time: of its 25 s or so, most is process
# start, imports, engine set-up and export (the first GPU ablation's untrained copies took 24-26 s). One after
# another, the eight launches cost minutes of a 15-minute device session; together, about the longest one.
JOBS = int(os.environ.get("ENCODER_DISTILL_GPU_TESTS_JOBS", len(RUNS)))


def uses(*names: str) -> pytest.MarkDecorator:
    """The launcher runs a test reads (``launched(name)``): those of the selected tests start together."""
    assert set(names) <= set(RUNS), names
    return pytest.mark.launcher_runs(*names)


@pytest.fixture(scope="session")
def launched(
    request: pytest.FixtureRequest, tmp_path_factory, tiny_teacher_dir: Path, gpu_dataset_dir: Path
) -> Iterator[Callable[[str], Path]]:
    """Starts, at once, every launcher run that a selected, unskipped test uses; ``launched(name)`` waits for
    one and returns its output directory (or raises what failed it). Each run is a launch of its own, with
    its own port, directory and process group, so running them side by side changes none of its losses:
    the same kernels on the same inputs."""
    wanted = sorted(
        {
            name
            for item in request.session.items
            if not any(mark.args and mark.args[0] for mark in item.iter_markers("skipif"))
            for mark in item.iter_markers("launcher_runs")
            for name in mark.args
        },
        key=list(RUNS).index,
    )
    root = tmp_path_factory.mktemp("runs")
    with ThreadPoolExecutor(max_workers=JOBS, thread_name_prefix="launch") as pool:
        futures = {
            name: pool.submit(RUNS[name][0], tiny_teacher_dir, gpu_dataset_dir, root / name, *RUNS[name][1:])
            for name in wanted
        }
        yield lambda name: futures[name].result()
        # leaving the pool waits for runs still going (a test that failed early does not stop them)


def check_trained(out: Path) -> dict[int, dict[str, float]]:
    """Every step logged with finite losses, the loss fell, the run measured its GPU memory, a student exported."""
    losses = train_losses(out, LOSS_KEYS)
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    assert all(math.isfinite(v) for step in losses.values() for v in step.values())
    first = sum(losses[s]["train/loss"] for s in range(1, 4)) / 3
    last = sum(losses[s]["train/loss"] for s in range(MAX_STEPS - 2, MAX_STEPS + 1)) / 3
    assert last < first, f"loss did not fall: first steps {first:.4f}, last steps {last:.4f}"
    train = [r for r in records(out) if "train/loss" in r]
    if ON == "cuda":  # the metric exists only for a CUDA device: proof the step ran there
        assert all(r["train/max_memory_gib"] > 0 for r in train)
    assert all(0 <= r["train/data_wait_share"] <= 1 for r in train)
    assert (out / "student" / "model.safetensors").is_file()
    return losses


@uses("zero1", "zero2", "zero3")
def test_bf16_trains_with_zero_1_2_and_3(launched: Callable[[str], Path]) -> None:
    """One bf16 run per ZeRO stage, the same seed, data and config otherwise."""
    losses = {stage: check_trained(launched(f"zero{stage}")) for stage in (1, 2, 3)}
    # Step 1 runs the same weights on the same masked batch in every stage: the same loss up to bf16
    # rounding in differently ordered reductions (2**-8 relative).
    for stage in (1, 3):
        assert losses[stage][1]["train/loss"] == pytest.approx(losses[2][1]["train/loss"], rel=1e-2)


PRESETS = {  # each preset's objective, at the tiny teacher's width (64, 4 heads, 4 layers)
    "distilbert-base": ["student.teacher_layers=null"],
    "tinybert-4l-312": ["student.hidden_size=32", "student.num_attention_heads=4", "student.intermediate_size=64"],
    "minilm-6l-384": ["student.num_layers=2", "student.hidden_size=32", "student.num_attention_heads=4"],
}


@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_masking_forward_and_backward_never_wait_for_the_device(
    preset: str, padded: bool, tiny_teacher_dir: Path, gpu_dataset_dir: Path
) -> None:
    """Under ``torch.cuda.set_sync_debug_mode("error")`` any device-to-host wait raises: masking, the
    Distiller's forward (teacher, student, every loss term of the preset) and backward have none. On a CPU
    rank, :class:`HostReads` raises at the operators that would wait on a GPU. (In this
    process, while the launcher runs that the later tests read still train.)"""
    from common.config import load_config
    from common.tokenizer import load_tokenizer
    from trainer.config import TrainConfig
    from trainer.modeling import build_student, load_teacher
    from trainer.objective.distiller import Distiller
    from trainer.objective.masking import DynamicMasker, seeded_generator
    from trainer.runtime.data import TrainLoader, load_token_counts, open_dataset, padding_mask
    from trainer.runtime.host_reads import HostReads

    overrides = [f"teacher={tiny_teacher_dir}", f"data={gpu_dataset_dir}", "output_dir=unused", "micro_batch_size=4"]
    overrides += ["loader.num_workers=0", *PRESETS[preset]]
    cfg = load_config(TrainConfig, str(REPO / "configs" / f"{preset}.yaml"), overrides)
    device = torch.device(ON)
    torch.manual_seed(0)
    teacher = load_teacher(cfg.teacher, torch.float32)
    distiller = Distiller(build_student(cfg.student, teacher), teacher.to(device, torch.bfloat16), cfg.objective)
    distiller.to(device).train()
    counts = load_token_counts(cfg.data) if cfg.masking.frequency_smoothing is not None else None
    masker = DynamicMasker.from_tokenizer(cfg.masking, load_tokenizer(cfg.teacher), counts, device=device)
    dataset = open_dataset(cfg.data)
    loader = TrainLoader(dataset, micro_batch_size=4, rank=0, world_size=1, loader_cfg=cfg.loader, seed=0)
    batch = next(loader)["input_ids"]
    if padded:  # the loop's two cases: a batch with padding comes with an attention mask, a packed one without
        batch[:, -7:] = dataset.pad_id
    else:
        batch[batch == dataset.pad_id] = int(dataset.tokenizer["special_token_ids"]["sep"])
    host_mask = padding_mask(batch, dataset.pad_id)
    assert (host_mask is not None) == padded
    input_ids = batch.to(device, non_blocking=True)
    attention_mask = None if host_mask is None else host_mask.to(device, non_blocking=True)
    generator = seeded_generator(0, 1, 0, 0, device=device)

    def step() -> torch.Tensor:
        masked = masker(input_ids, attention_mask, generator)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = distiller(batch=masked, attention_mask=attention_mask)["loss"]
        loss.backward()
        return loss.detach()

    step()  # the first call may initialise lazily (cuBLAS handles, autotuning), which is not a step's work
    distiller.zero_grad(set_to_none=True)
    # On a CPU rank nothing waits, but the operators that would wait on a GPU are seen as they dispatch.
    watch = contextlib.nullcontext() if ON == "cuda" else HostReads(fail=True)
    if ON == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with watch:
            loss = step()
    finally:
        if ON == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert math.isfinite(float(loss))
    assert any(p.grad is not None for p in distiller.parameters())


@cuda_only
@uses("fp16")
def test_fp16_overflowing_steps_are_skipped_not_fatal(launched: Callable[[str], Path]) -> None:
    """A loss scale of 2**32 overflows fp16 gradients: DeepSpeed skips those steps and halves the scale until
    the gradients fit; the run goes on to train, where the non-finite guard would have stopped it (on CPU:
    tests/trainer/test_launcher.py, in CI)."""
    check_fp16_overflows_were_skipped(launched("fp16"), 40)


# The second uninterrupted run measures the GPU's run-to-run spread; a CPU rank has none to measure (its
# losses repeat bit for bit: docs/training.md), so the dry run on CPU launches no such run.
SPREAD_RUN = ("again",) if ON == "cuda" else ()


@uses("zero2", "resumed", *SPREAD_RUN)
def test_killed_run_resumes_to_the_same_losses(launched: Callable[[str], Path]) -> None:
    """Killed two steps after a checkpoint and relaunched, a run continues to the same losses.

    The tolerance is the GPU's own run-to-run spread, measured: a second uninterrupted run of the same
    config. Where its kernels are deterministic the spread is 0 and the resumed losses must be
    bit-identical (up to 1e-6 relative); where some reduction is not (atomics in attention's backward),
    the resumed run may differ by as much as two uninterrupted runs do, with a margin of 4x. A resume
    that restored the wrong data position, optimizer state or schedule moves the losses by percent.
    On a CPU rank the spread is 0 without measuring it.
    """
    reference, resumed = (train_losses(launched(name), LOSS_KEYS) for name in ("zero2", "resumed"))
    again = train_losses(launched("again"), LOSS_KEYS) if SPREAD_RUN else reference
    assert sorted(resumed) == sorted(reference)
    for step in reference:
        for key, value in reference[step].items():
            spread = abs(again[step][key] - value)
            assert abs(resumed[step][key] - value) <= 4 * spread + 1e-6 * abs(value), (step, key, spread)


@uses("zero2")
def test_exported_student_fills_masks_on_the_gpu(launched: Callable[[str], Path]) -> None:
    from transformers import pipeline

    fill = pipeline("fill-mask", model=str(launched("zero2") / "student"), device=ON)
    assert next(fill.model.parameters()).device.type == ON
    predictions = fill("The [MASK] module provides regular expression matching.")
    assert len(predictions) == 5 and all(0 <= p["score"] <= 1 for p in predictions)
    assert all(isinstance(p["token_str"], str) and p["token_str"] for p in predictions)


@uses("zero2")
def test_held_out_scores_and_the_probe_run_on_the_gpu_and_score_as_the_cpu_does(
    launched: Callable[[str], Path], tiny_teacher_dir: Path, gpu_dataset_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """``evaluate-mlm`` and the suite's linear probe compute on the GPU (the first GPU ablation found both on
    the machine's CPU, minutes a model) and score what the CPU scores: the same masked tokens, and
    figures equal up to float32 rounding in other kernels (a near-tied guess may flip: a few in a
    thousand; for the probe, one of the 32 validation examples). The probe's ridge fits run there too
    (the second GPU ablation's probe spent 8-36 s a model and task with its fits on the machine's CPU)."""
    from common.config import load_config
    from trainer.evaluation import probe
    from trainer.evaluation.mlm import EvaluateMlmConfig, evaluate_mlm
    from trainer.evaluation.suite import SuiteConfig, evaluate_suite

    fitted_on = []  # the device of every ridge fit (jobs=1: the suite runs in this process)
    prepare = probe.Ridge.__init__

    def recording(self, x, y):
        fitted_on.append(x.device.type)
        prepare(self, x, y)

    monkeypatch.setattr(probe.Ridge, "__init__", recording)

    student = str(launched("zero2") / "student")
    mlm = load_config(
        EvaluateMlmConfig,
        None,
        [f"data={gpu_dataset_dir}", f'models=["{student}"]', f"teacher={tiny_teacher_dir}", "max_batches=4"],
    )
    probe_args = ["method=probe", "tasks=[wordnet-supersense]", "train_size=64", "valid_size=32", "jobs=1"]
    probe_args += ["mlflow.enabled=false"]

    def scores(accelerator: str) -> tuple[dict, float]:
        monkeypatch.setenv("DS_ACCELERATOR", accelerator)
        held_out = evaluate_mlm(mlm)
        suite = load_config(SuiteConfig, None, [*probe_args, f'models=["{student}"]', f"output={tmp_path / 'p.json'}"])
        if accelerator == "cuda":
            torch.cuda.reset_peak_memory_stats()
        probed = evaluate_suite(suite)["models"][0]["average"]
        if accelerator == "cuda":
            assert torch.cuda.max_memory_allocated() > 0  # the probe's encoder ran there
        assert set(fitted_on) == {"cuda" if accelerator == "cuda" else "cpu"}, fitted_on  # and its fits
        fitted_on.clear()
        return held_out, probed

    here, probed = scores(ON)
    assert here["device"].startswith(ON)
    if ON != "cuda":  # the dry run on a CPU: what runs where is checked above; the CPU is its own reference
        return
    reference, probed_on_cpu = scores("cpu")
    assert reference["device"] == "cpu"
    [a], [b] = here["models"], reference["models"]
    assert a["masked_tokens"] == b["masked_tokens"] > 0
    assert a["mlm_loss"] == pytest.approx(b["mlm_loss"], rel=1e-4)
    assert a["hidden_cosine"] == pytest.approx(b["hidden_cosine"], rel=1e-4)
    for key in ("mlm_accuracy", "top1_agreement"):
        assert a[key] == pytest.approx(b[key], abs=5e-3)
    assert probed == pytest.approx(probed_on_cpu, abs=1 / 32 + 1e-9)


@uses("offload")
def test_zero2_with_cpu_offload_trains(launched: Callable[[str], Path]) -> None:
    """ZeRO-Offload: the optimizer state and step on the CPU (DeepSpeed's CPU Adam, compiled on first use)."""
    check_trained(launched("offload"))
