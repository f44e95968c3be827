"""Checkpoints: DeepSpeed's ``save_checkpoint`` every N steps, the last K kept, automatic resume.

Layout: ``OUTPUT_DIR/checkpoints/step-00001000/`` (DeepSpeed's model, optimizer and scheduler
files for every ZeRO stage, plus ``hf/``: the student's Hugging Face config and the tokenizer,
so a checkpoint alone can be exported) and ``OUTPUT_DIR/checkpoints/latest``, which names the last
complete checkpoint: the trainer writes it (atomically, rank 0) only once every rank has written its
files, so a run killed mid-save resumes from the previous one. (DeepSpeed's own ``latest`` is written
by rank 0 as soon as its own files are, while other ranks may still be writing their partitions,
and in place: a kill then could leave it naming a partial checkpoint, or empty.) A save into a step
directory that a killed save left behind first empties it: a partition of a rank that no longer
exists would otherwise stay, and make the checkpoint look saved by more ranks than it was.

The trainer's own state (step, data position, MLflow run id) travels in DeepSpeed's client state.
RNG state needs no saving: the trainer reseeds from ``(seed, step, rank)`` at every step.

A checkpoint holds one ZeRO partition of the optimizer per rank, so DeepSpeed loads it only into
as many ranks as saved it. Relaunched on another number of ranks (a cluster lost or gained nodes),
the run first converts the checkpoint once into DeepSpeed's *universal* form, ``step-N/universal/``
(every parameter's float32 weights and Adam moments whole, plus the client state), which any
world size and ZeRO stage can load; the optimizer state comes along, it is not reset.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import tempfile
import time
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.atomic import (
    atomic_directory,
    explaining_full_disk,
    free_bytes,
    size_text,
    write_text_atomically,
)
from common.config import ConfigError
from trainer.runtime.rendezvous import logged_while_waiting

log = logging.getLogger(__name__)

TAG = re.compile(r"step-(\d+)")
HF_DIR = "hf"
UNIVERSAL_DIR = "universal"
# DeepSpeed writes one optimizer partition per data-parallel rank, bf16_-prefixed under its BF16 optimizer.
OPTIMIZER_PARTITION = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt")


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def step_of(tag_dir: Path) -> int | None:
    match = TAG.fullmatch(tag_dir.name)
    return int(match.group(1)) if match else None


def checkpoint_dirs(root: Path) -> list[Path]:
    """The ``step-*`` directories under ``root``, oldest first."""
    if not root.is_dir():
        return []
    tagged = [(step_of(p), p) for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return [p for _, p in sorted(tagged)]


def latest_tag(root: Path) -> str | None:
    """The last completed checkpoint's tag, from DeepSpeed's ``latest`` file."""
    latest = root / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text(encoding="utf-8").strip()
    return tag if TAG.fullmatch(tag) and (root / tag).is_dir() else None  # empty: `root / ""` is root itself


def prune(root: Path, keep_last: int, newest_step: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints up to ``newest_step``, and any newer
    (left behind by a run that was killed after them and resumed from ``newest_step``)."""
    dirs = checkpoint_dirs(root)
    kept = [p for p in dirs if step_of(p) <= newest_step][-keep_last:]
    doomed = [p for p in dirs if p not in kept]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def saved_world_size(checkpoint: Path) -> int:
    """The number of ranks ``checkpoint`` was saved by: one optimizer partition each."""
    ranks = {int(m.group(1)) for p in checkpoint.iterdir() if (m := OPTIMIZER_PARTITION.fullmatch(p.name))}
    if not ranks or ranks != set(range(len(ranks))):
        raise RuntimeError(f"checkpoint {checkpoint}: expected optimizer partitions of ranks 0..N-1, found {ranks}")
    return len(ranks)


def convert_to_universal(checkpoint: Path) -> Path:
    """``checkpoint/universal``: DeepSpeed's world-size-independent form of ``checkpoint``, made once.

    DeepSpeed's own converter (``deepspeed.checkpoint.ds_to_universal``, in this process, serially)
    writes into a temporary directory renamed into place, so a run killed mid-conversion leaves no
    half-converted checkpoint and converts again on the next launch. Its console output goes to
    ``universal.log`` beside it.
    """
    from deepspeed.checkpoint import ds_to_universal

    dest = checkpoint / UNIVERSAL_DIR
    if dest.is_dir():
        return dest
    options = Namespace(
        input_folder=str(checkpoint),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # the run stores no tensor-parallel layout info: there is none
    )
    with atomic_directory(dest) as tmp, (checkpoint / f"{UNIVERSAL_DIR}.log").open("w") as console:
        options.output_folder = str(tmp)
        with contextlib.redirect_stdout(console), contextlib.redirect_stderr(console):
            ds_to_universal.main(options)
    (checkpoint / "latest_universal").unlink(missing_ok=True)  # the converter's pointer; the trainer names the tag
    return dest


def conversion_bound_s(checkpoint: Path) -> float:
    """How long the other ranks wait for rank 0's universal conversion of ``checkpoint``: 10 minutes, plus a
    minute per GB of its files (a conservative 17 MB/s for DeepSpeed's serial converter). Rank 0 is known to be
    alive meanwhile (``runtime.peers``), so the bound only catches a conversion that is stuck."""
    size = sum(f.stat().st_size for f in checkpoint.iterdir() if f.is_file())
    return 600.0 + 60.0 * size / 1e9


def wait_for_conversion(checkpoint: Path, rank: int, poll_s: float = 1.0) -> Path:
    """Wait, on a rank other than 0, for ``checkpoint/universal`` (renamed into place whole by
    :func:`convert_to_universal`, on the filesystem every rank reads checkpoints from), logging while it waits;
    a TimeoutError after :func:`conversion_bound_s`."""
    dest, bound = checkpoint / UNIVERSAL_DIR, conversion_bound_s(checkpoint)
    deadline = time.monotonic() + bound
    with logged_while_waiting(
        f"rank {rank}: waiting for rank 0 to convert {checkpoint} to universal", level=logging.INFO
    ):
        while not dest.is_dir():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {rank}: rank 0 did not finish converting {checkpoint} to its universal form within "
                    f"{bound:.0f} s (10 minutes + 1 minute per GB of checkpoint); see {checkpoint}/universal.log"
                )
            time.sleep(poll_s)
    return dest


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a launch resumes from, and whether it must go through the universal form."""

    checkpoint: Path
    saved_world_size: int
    world_size: int

    @property
    def universal(self) -> bool:
        return self.saved_world_size != self.world_size


def untie_step_counters(engine: Any) -> None:
    """Give every parameter group's Adam state its own step counter after a universal load.

    DeepSpeed's ZeRO-3 universal loader (0.19.8) hands all of a rank's flat parameter groups one and
    the same ``step`` tensor, which ``torch.optim.AdamW`` then increments in place once per group:
    with two groups (decayed and not) the step count, and so the bias correction, would run twice as
    fast after the resume.
    """
    for state in engine.optimizer.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def optimizer_summary(engine: Any) -> dict[str, float]:
    """Adam's step count and the global norms of its two moments, over every rank's partition.

    Logged at each save and after each resume, so that a resume that carried the optimizer over
    (same step, same norms, whatever the world size) can be told from one that reset it. A
    collective: every rank calls it.
    """
    state = engine.optimizer.optimizer.state.values()  # the base optimizer inside ZeRO's wrapper
    # Summed in float64 (a float32 sum over millions of entries drifts by 1e-4 with the partitioning),
    # a slice at a time so that no partition is copied whole; on the ranks' device, which NCCL needs.
    squares = torch.zeros(2, dtype=torch.float64, device=engine.device)
    for s in state:
        for i, key in enumerate(("exp_avg", "exp_avg_sq")):
            if key in s:
                for part in s[key].detach().reshape(-1).split(1 << 24):
                    squares[i] += part.to(squares.device, torch.float64).square().sum()
    if dist.is_initialized():
        dist.all_reduce(squares)
    return {
        "step": max((int(s["step"]) for s in state if "step" in s), default=0),
        "exp_avg_norm": float(squares[0].sqrt()),
        "exp_avg_sq_norm": float(squares[1].sqrt()),
    }


def describe(summary: dict[str, float]) -> str:
    return (
        f"optimizer step {summary['step']}, |exp_avg| {summary['exp_avg_norm']:.6e}, "
        f"|exp_avg_sq| {summary['exp_avg_sq_norm']:.6e}"
    )


class Checkpointer:
    """Saves and restores a DeepSpeed engine plus the trainer's client state."""

    def __init__(
        self, output_dir: str | Path, *, every_steps: int, keep_last: int, is_main: bool, save_bytes: int | None = None
    ) -> None:
        self.root = Path(output_dir) / "checkpoints"
        self.every_steps = every_steps
        self.keep_last = keep_last
        self.is_main = is_main
        self.save_bytes = save_bytes  # what one save writes, all ranks together (plan's checkpoint_bytes)

    def due(self, step: int, max_steps: int) -> bool:
        return step % self.every_steps == 0 or step == max_steps

    def latest(self) -> Path | None:
        """The last completed checkpoint, or None."""
        tag = latest_tag(self.root)
        return None if tag is None else self.root / tag

    def save(self, engine: Any, step: int, client_state: dict[str, Any], hf_files: Any) -> Path:
        """Save on every rank (ZeRO shards live everywhere); rank 0 adds ``hf/`` and prunes.

        ``hf_files(dest)`` writes the student's config and tokenizer into ``dest``; it runs
        first, so that ``latest`` never names a checkpoint that cannot be exported.
        """
        tag = tag_for(step)
        # A full disk, a refused write or a directory removed meanwhile fails the run in one line (naming the bytes
        # for a full disk); every rank that meets it removes the partial step directory, so that the disk is as it
        # was before the attempt, and `latest` still names the last complete save.
        previous = latest_tag(self.root)
        then = f"`latest` still names {previous}: relaunch to resume from it" if previous else "nothing was saved yet"
        partial = self.root / tag if previous != tag else None
        with explaining_full_disk(f"checkpoint {tag}", self.root, self.save_bytes, then, partial):
            if self.is_main:
                if (self.root / tag).is_dir() and previous != tag:  # what a killed save left
                    shutil.rmtree(self.root / tag)
                (self.root / tag).mkdir(parents=True, exist_ok=True)
                hf_files(self.root / tag / HF_DIR)
            # DeepSpeed's save begins with a barrier (no rank writes before rank 0 is done above) and ends with
            # one (every rank's files are written when it returns): only then may `latest` name the checkpoint.
            started = time.monotonic()
            engine.save_checkpoint(str(self.root), tag=tag, client_state=client_state, save_latest=False)
            seconds = time.monotonic() - started  # what `plan --storage-gbs` stands for (docs/training.md)
        summary = describe(optimizer_summary(engine))
        if self.is_main:
            write_text_atomically(self.root / "latest", tag)
            log.info("saved checkpoint %s in %.1f s: %s", self.root / tag, seconds, summary)
            prune(self.root, self.keep_last, step)
        dist.barrier()
        return self.root / tag

    def check_room(self, checkpoint_bytes: int, export_bytes: int) -> str:
        """The start of a run, on rank 0, before any weight is loaded: the output directory can be written, and its
        filesystem has room for ``checkpoint.keep_last`` + 1 checkpoints of ``checkpoint_bytes`` (plan's size; the
        kept ones and the one being saved, before the oldest is pruned), less what checkpoints already there hold,
        plus the export of ``export_bytes``. A ConfigError naming the key or path and the fix otherwise, instead
        of a full disk hours in; else its one line."""
        output_dir = self.root.parent
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=output_dir, prefix=".write-check."):
                pass
        except OSError as err:
            raise ConfigError(
                f"output_dir: cannot write into {output_dir}: {(err.strerror or str(err)).lower()}; make it writable "
                "by this user (a read-only mount?) or set output_dir to a directory that is"
            ) from None
        free = free_bytes(output_dir)
        if free is None:
            return f"output_dir: {output_dir} (free space not checked)"
        held = sum(f.stat().st_size for tag in checkpoint_dirs(self.root) for f in tag.rglob("*") if f.is_file())
        needed = max(0, (self.keep_last + 1) * checkpoint_bytes - held) + export_bytes
        room = (
            f"needs {size_text(needed)} for keep_last+1 = {self.keep_last + 1} checkpoints of "
            f"{size_text(checkpoint_bytes)}{f' ({size_text(held)} of them there already)' if held else ''} and "
            f"the export of {size_text(export_bytes)}"
        )
        if free < needed:
            raise ConfigError(
                f"output_dir: {output_dir} has {size_text(free)} free, but the run {room}: free space there, lower "
                "checkpoint.keep_last, or set output_dir to a larger filesystem"
            )
        return f"output_dir: {size_text(free)} free, {room}"

    def resume_point(self, world_size: int) -> ResumePoint | None:
        """Where this launch of ``world_size`` ranks resumes from, or None for a fresh run."""
        checkpoint = self.latest()
        return None if checkpoint is None else ResumePoint(checkpoint, saved_world_size(checkpoint), world_size)

    def resume(self, engine: Any, point: ResumePoint | None) -> dict[str, Any] | None:
        """Load ``point`` into ``engine``; its client state, or None for a fresh run.

        A checkpoint saved by another number of ranks is loaded from its universal form (rank 0
        converts it first if no earlier launch has); ``engine`` must then have been built with
        ``checkpoint.load_universal`` (``runtime.engine.deepspeed_config``).
        """
        if point is None:
            return None
        load_dir, tag = self.root, point.checkpoint.name
        if point.universal:
            if self.is_main:
                log.info(
                    "checkpoint %s was saved by %d rank(s), this launch has %d: loading its universal form",
                    point.checkpoint,
                    point.saved_world_size,
                    point.world_size,
                )
                convert_to_universal(point.checkpoint)
            else:  # the conversion takes minutes for a large model: say what this rank waits for
                wait_for_conversion(point.checkpoint, dist.get_rank())
            dist.barrier()
            load_dir, tag = point.checkpoint, UNIVERSAL_DIR
        path, client_state = engine.load_checkpoint(
            str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise RuntimeError(f"checkpoint {load_dir / tag} could not be loaded")
        if point.universal:
            untie_step_counters(engine)
        summary = describe(optimizer_summary(engine))
        if self.is_main:
            log.info("resumed from step %s in %s: %s", client_state.get("step"), point.checkpoint, summary)
        return client_state
