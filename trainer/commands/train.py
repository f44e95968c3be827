"""``python -m trainer train CONFIG.yaml [key=value ...]``: the distillation loop.

Normally started once per rank by ``deepspeed launch/run.sh CONFIG.yaml ...``. The whole run
reads top to bottom in :func:`train`: check everything that can be checked cheaply, build the
teacher, the student and the DeepSpeed engine, resume from the latest checkpoint if the output
directory has one, then step: mask, forward, backward, optimizer step; log, evaluate and
checkpoint every so many steps; finally export the student as a Hugging Face model. A step whose
loss or gradient norm is not finite stops the run before anything is saved (``runtime.guard``).

A config with ``teacher: null`` runs the same loop as masked-LM pretraining: no teacher is loaded,
the student comes from ``student.model`` and L_mlm is its only loss (``trainer.config``). With
``max_steps: 0`` the run stops once the student is built and writes it untrained
(:func:`export_untrained`).

Nothing in a step reads a device value on the host: losses stay on the device until a log
step, masks are drawn on the device, and batches arrive in pinned memory.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from common.atomic import atomic_directory
from common.cli import split_config_args
from common.config import ConfigError, load_config, to_dict
from common.tokenizer import load_tokenizer, tokenizer_identity
from trainer.commands.export import export, save_student
from trainer.commands.run_record import training_run_spec
from trainer.config import TrainConfig
from trainer.modeling import build_student, load_teacher, load_teacher_config, training_dtype
from trainer.objective.distiller import Distiller, validate_against_teacher
from trainer.objective.masking import DynamicMasker, seeded_generator
from trainer.planning.plan import output_bytes
from trainer.runtime.checkpoint import Checkpointer
from trainer.runtime.data import (
    TrainLoader,
    check_shards_present,
    check_split_feeds_streams,
    check_streams_fit,
    check_tokenizer,
    fresh_streams,
    load_token_counts,
    open_dataset,
    padding_mask,
)
from trainer.runtime.engine import Distributed, build_engine, deepspeed_config, init_distributed
from trainer.runtime.evaluate import Evaluation
from trainer.runtime.guard import FiniteGuard
from trainer.runtime.metrics import MetricsLog, StepMeter
from trainer.runtime.optim import follow_schedule, follow_settings
from trainer.runtime.peers import PeerWatch
from trainer.runtime.profiling import step_profiler
from trainer.tracking.checkpoints import start_registrar
from trainer.tracking.registry import register_or_explain
from trainer.tracking.tracker import check_access_on_rank0, checked_on_rank0, start_tracker

log = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    path, overrides = split_config_args(argv, __doc__)
    if path is None:
        raise ConfigError("usage: python -m trainer train CONFIG.yaml [key=value ...] (the config file is required)")
    train(load_config(TrainConfig, path, overrides), config_path=path)
    return 0


def train(cfg: TrainConfig, config_path: str | None = None) -> Path:
    """Run (or resume) the distillation (or pretraining) ``cfg`` describes; returns the exported student's
    directory."""
    # Cheap checks first: a bad config or dataset fails in seconds, before any weight is loaded.
    world = init_distributed()
    watch = PeerWatch.for_this_rank(cfg.deepspeed.peer_timeout_s)  # a lost node stops every rank, in a bound
    if watch is not None:
        watch.start()
    output_dir = Path(cfg.output_dir)
    checkpoints = Checkpointer(
        output_dir, every_steps=cfg.checkpoint.every_steps, keep_last=cfg.checkpoint.keep_last, is_main=world.is_main
    )
    # A checkpoint saved by another number of ranks loads through DeepSpeed's universal form, which
    # the engine must be configured for before it is built (runtime.checkpoint).
    resume_point = checkpoints.resume_point(world.world_size)
    ds_config = deepspeed_config(
        cfg, world.world_size, load_universal=resume_point is not None and resume_point.universal
    )
    teacher_config = None if cfg.teacher is None else load_teacher_config(cfg.teacher)
    validate_against_teacher(cfg, teacher_config)
    check_access_on_rank0(cfg.mlflow, world.is_main, world.world_size)  # wrong credentials: before any weight
    dataset = open_dataset(cfg.data)
    tokenizer_source, tokenizer_key = cfg.tokenizer_source()
    tokenizer = load_tokenizer(tokenizer_source)
    check_tokenizer(dataset, tokenizer_identity(tokenizer, tokenizer_source), tokenizer_source, tokenizer_key)
    if resume_point is None:  # a new run's streams are this config's (a resumed run's, its checkpoint's)
        streams = fresh_streams(cfg.loader, world.world_size)
        check_streams_fit(streams, world.world_size)
        check_split_feeds_streams(dataset.shards("train"), streams)
    # Every shard there with its size, and room for the checkpoints and the export: a missing shard or a full
    # disk found in seconds on rank 0 (a listing, the free space), not when a loader or a save reaches it.
    save_bytes, export_bytes = output_bytes(cfg, teacher_config, ds_config)  # plan's figures
    checkpoints.save_bytes = save_bytes  # what a full disk's message says a save needs

    def start_check() -> None:  # max_steps 0 saves no checkpoint, only the export
        room = checkpoints.check_room(save_bytes if cfg.max_steps else 0, export_bytes)
        log.info("%s; %s", check_shards_present(dataset), room)

    checked_on_rank0(start_check, world.is_main, world.world_size)
    if world.is_main:
        task = f"distilling {cfg.teacher}" if cfg.teacher is not None else f"pretraining {cfg.student.model}"
        log.info(
            "%s on %d rank(s): global batch %d = micro %d x accumulation %d x world %d",
            task,
            world.world_size,
            cfg.global_batch_size,
            cfg.micro_batch_size,
            ds_config["gradient_accumulation_steps"],
            world.world_size,
        )

    # Models: the student is derived from the float32 teacher, then the teacher drops to the
    # training dtype and stays outside the engine (see trainer.objective.distiller).
    torch.manual_seed(cfg.seed)
    teacher = None if cfg.teacher is None else load_teacher(cfg.teacher, torch.float32)
    student = build_student(cfg.student, teacher)
    if cfg.max_steps == 0:
        return export_untrained(student, tokenizer, output_dir, world.is_main)
    if teacher is not None:
        teacher.to(device=world.device, dtype=training_dtype(cfg.deepspeed.precision))
    distiller = Distiller(student, teacher, cfg.objective)
    if cfg.compile:
        distiller.compile_models()  # in place: checkpoints and export see the same modules
    engine = build_engine(distiller, cfg, ds_config, world.device)

    resumed = checkpoints.resume(engine, resume_point) or {}
    step = int(resumed.get("step", 0))
    if resumed:  # the schedule and settings are this launch's (max_steps may have grown), not the checkpoint's
        saved_lr, lr = follow_schedule(engine.lr_scheduler, cfg.optimizer.lr)
        if world.is_main and not math.isclose(saved_lr, lr):
            log.info("step %d: lr %.3g from this launch's schedule (the checkpoint's was %.3g)", step, lr, saved_lr)
        changed = follow_settings(engine.lr_scheduler.optimizer.param_groups, cfg.optimizer)
        if world.is_main and changed:
            log.info("step %d: optimizer settings from this launch's config (the checkpoint's, now): %s", step, changed)
    # Rank 0 tracks the run in MLflow (a resumed run continues its MLflow run); never blocks a step.
    tracker = start_tracker(
        cfg.mlflow,
        rank=world.rank,
        world_size=world.world_size,
        resume_run_id=resumed.get("mlflow_run_id"),
        run_spec=lambda: training_run_spec(cfg, config_path, ds_config, world.world_size),
    )
    # Rank 0 registers every K-th checkpoint's student while training, in the background (mlflow.register_checkpoints).
    registrar = start_registrar(
        cfg.mlflow,
        output_dir,
        tracker,
        is_main=world.is_main,
        save_every_steps=cfg.checkpoint.every_steps,
        max_steps=cfg.max_steps,
    )
    facts = StudentFacts(cfg.global_batch_size, dataset.max_seq_len)
    if resumed:  # a kill between its save and its hand-over must not lose a due checkpoint (no duplicate either)
        registrar.submit(resume_point.checkpoint, facts.at(step))

    loader = TrainLoader(
        dataset,
        micro_batch_size=cfg.micro_batch_size,
        rank=world.rank,
        world_size=world.world_size,
        loader_cfg=cfg.loader,
        seed=cfg.seed,
        state=resumed.get("data"),
    )
    token_counts = load_token_counts(cfg.data) if cfg.masking.frequency_smoothing is not None else None
    masker = DynamicMasker.from_tokenizer(cfg.masking, tokenizer, token_counts, device=world.device)
    evaluation = Evaluation(cfg, dataset, masker, world)
    meter = StepMeter(cfg.global_batch_size)
    metrics_log = MetricsLog(output_dir, is_main=world.is_main, max_steps=cfg.max_steps, start_step=step)
    guard = FiniteGuard(world.device)
    profiler = step_profiler(cfg.profile, output_dir, world.rank, world.device)

    stepper = Stepper(
        engine, masker, guard, meter, world, cfg.seed, dataset.pad_id, cfg.deepspeed.skips_nonfinite_steps
    )
    accumulation = engine.gradient_accumulation_steps()
    while step < cfg.max_steps:
        reseed(cfg.seed, step, world.rank)  # dropout: the same random stream after a resume
        lr = engine.get_lr()[0]
        profiler.step_begins(step + 1)
        for micro in range(accumulation):
            waited = time.perf_counter()
            batch = next(loader)
            meter.add_data_wait(time.perf_counter() - waited)
            meter.add_damaged(batch["damaged"])
            stepper.micro_step(batch["input_ids"], step, micro)
        step += 1
        stepper.end_step(step, lr)
        profiler.step_ended(step)

        eval_due = step % cfg.eval.every_steps == 0 or step == cfg.max_steps
        log_due = eval_due or step % cfg.logging.every_steps == 0
        checkpoint_due = checkpoints.due(step, cfg.max_steps)
        if log_due:  # train records first: the log stays in step order
            for logged_step, metrics in meter.flush():
                metrics_log.write(logged_step, metrics)
                tracker.log_metrics(metrics, logged_step)
        if log_due or checkpoint_due:  # the loop waits for the device here anyway
            guard.check(checkpoints.latest())
        if eval_due:
            metrics = evaluation.run(engine.module)
            metrics_log.write(step, metrics)
            tracker.log_metrics(metrics, step)
            facts.evaluated(step, metrics)
        if checkpoint_due:
            client_state = {
                "step": step,
                "data": loader.state(),
                "mlflow_run_id": tracker.run_id,
                "config": to_dict(cfg),
            }
            saved = checkpoints.save(
                engine, step, client_state, hf_files=lambda dest: save_hf_files(student, tokenizer, dest)
            )
            registrar.submit(saved, facts.at(step))

    metrics_log.close()
    student_dir = output_dir / "student"
    if world.is_main:
        registrar.close(cfg.mlflow.finish_timeout_s)  # the checkpoints' versions first, in step order
        export(checkpoints.root, student_dir)
        log.info("exported the student to %s", student_dir)
    dist.barrier()
    tracker.finish({})
    if watch is not None:
        watch.stop()  # the collectives are over; rank 0 alone registers below
    world.close()
    if world.is_main:  # if mlflow.register_as
        register_or_explain(student_dir, cfg.mlflow, tracker, tags={"kind": "final", **facts.tags(step)})
    return student_dir


class StudentFacts:
    """What a registered student is tagged with: its step, samples and tokens (token positions, padding
    included), and for a checkpoint's student the metrics of the last evaluation at or before its step."""

    def __init__(self, global_batch_size: int, seq_len: int) -> None:
        self.global_batch_size, self.seq_len = global_batch_size, seq_len
        self.last_eval: dict[str, float] = {}

    def evaluated(self, step: int, metrics: dict[str, float]) -> None:
        self.last_eval = {**self.last_eval, **metrics, "eval_step": step}  # the teacher's figures come once

    def at(self, step: int) -> dict[str, Any]:
        samples = step * self.global_batch_size
        return {"step": step, "samples": samples, "tokens": samples * self.seq_len, **self.last_eval}

    def tags(self, step: int) -> dict[str, str]:
        return {key: str(value) for key, value in self.at(step).items() if not key.startswith("eval")}


@dataclass
class Stepper:
    """What a training step does with its parts, built once by :func:`train`, so that a step is one call that
    tests and profilers can drive as the loop does."""

    engine: Any
    masker: DynamicMasker
    guard: FiniteGuard
    meter: StepMeter
    world: Distributed
    seed: int
    pad_id: int
    skips_nonfinite_steps: bool

    def micro_step(self, batch: torch.Tensor, step: int, micro: int) -> None:
        """Masking, forward, backward and the engine's step for micro-batch ``micro`` of step ``step`` (0-based):
        ``batch`` is the loader's host tensor of token ids."""
        device = self.world.device
        host_mask = padding_mask(batch, self.pad_id)
        input_ids = batch.to(device, non_blocking=True)
        attention_mask = None if host_mask is None else host_mask.to(device, non_blocking=True)
        generator = seeded_generator(self.seed, step, self.world.rank, micro, device=device)
        masked = self.masker(input_ids, attention_mask, generator)
        # Keywords: ZeRO-3's hooks look for tensors among the positional inputs, and a MaskedBatch is none.
        out = self.engine(batch=masked, attention_mask=attention_mask)
        self.guard.observe(step + 1, out["loss"])  # before the optimizer step below
        self.engine.backward(out["loss"])
        self.engine.step()
        self.meter.add_micro(out, tokens=batch.numel() if host_mask is None else int(host_mask.sum()))

    def end_step(self, step: int, lr: float) -> None:
        """After the last micro-batch of step ``step`` (1-based, counted): its gradient norm checked and metered."""
        grad_norm = self.engine.get_global_grad_norm()
        # fp16: a step whose gradients overflowed is skipped by the loss scaler (its norm is inf, the scale
        # halves); that is normal operation, not a lost run. So is a non-finite bf16 step under
        # deepspeed.bf16_skip_nonfinite. Any other non-finite norm stops the run, also where DeepSpeed
        # skipped its step on its own (ZeRO-3, fp32).
        if self.engine.was_step_applied() or not self.skips_nonfinite_steps:
            self.guard.observe(step, grad_norm)
        self.meter.end_step(step, lr, grad_norm)


def export_untrained(student: Any, tokenizer: Any, output_dir: Path, is_main: bool) -> Path:
    """``max_steps: 0``: the student exactly as a run with this config would start training it (teacher
    layers copied for ``from_teacher``, with a fresh MLM head where the teacher has none), written where
    a run writes its export, with no engine, checkpoint or MLflow run.

    It is the baseline a distillation has to beat: fine-tuned beside the distilled student, it shows
    what the training added over the initialisation (docs/log/quality.md measures it for MiniLM's layers).
    """
    student_dir = output_dir / "student"
    if is_main:
        save_student(student, tokenizer, student_dir)
        log.info("max_steps is 0: wrote the untrained student to %s", student_dir)
    return student_dir


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed torch's global generators (dropout) from (seed, step, rank)."""
    torch.manual_seed(int(np.random.SeedSequence([seed, step, rank]).generate_state(1, np.uint64)[0] >> 1))


def save_hf_files(student: Any, tokenizer: Any, dest: Path) -> None:
    """The student's config and the tokenizer, next to the weights DeepSpeed saved (for export)."""
    with atomic_directory(dest) as tmp:
        student.config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
