"""Checkpoints: DeepSpeed's ``save_checkpoint`` every N steps, the last K kept, automatic resume.

Layout: ``OUTPUT_DIR/checkpoints/step-00001000/`` (DeepSpeed's model, optimizer and scheduler
files for every ZeRO stage, plus ``hf/``: the student's Hugging Face config and the tokenizer,
so a checkpoint alone can be exported) and ``OUTPUT_DIR/checkpoints/latest``, which DeepSpeed
rewrites only after a save completed: a run killed mid-save resumes from the previous one.

The trainer's own state (step, data position, MLflow run id) travels in DeepSpeed's client state.
RNG state needs no saving: the trainer reseeds from ``(seed, step, rank)`` at every step.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

TAG = re.compile(r"step-(\d+)")
HF_DIR = "hf"


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
    return tag if (root / tag).is_dir() else None


def prune(root: Path, keep_last: int, newest_step: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints up to ``newest_step``, and any newer
    (left behind by a run that was killed after them and resumed from ``newest_step``)."""
    dirs = checkpoint_dirs(root)
    kept = [p for p in dirs if step_of(p) <= newest_step][-keep_last:]
    doomed = [p for p in dirs if p not in kept]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


class Checkpointer:
    """Saves and restores a DeepSpeed engine plus the trainer's client state."""

    def __init__(self, output_dir: str | Path, *, every_steps: int, keep_last: int, is_main: bool) -> None:
        self.root = Path(output_dir) / "checkpoints"
        self.every_steps = every_steps
        self.keep_last = keep_last
        self.is_main = is_main

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
        if self.is_main:
            (self.root / tag).mkdir(parents=True, exist_ok=True)
            hf_files(self.root / tag / HF_DIR)
        engine.save_checkpoint(str(self.root), tag=tag, client_state=client_state)
        if self.is_main:
            prune(self.root, self.keep_last, step)
        dist.barrier()
        return self.root / tag

    def resume(self, engine: Any) -> dict[str, Any] | None:
        """Load the latest checkpoint into ``engine``; its client state, or None for a fresh run."""
        tag = latest_tag(self.root)
        if tag is None:
            return None
        path, client_state = engine.load_checkpoint(
            str(self.root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise RuntimeError(f"checkpoint {self.root / tag} could not be loaded")
        return client_state
