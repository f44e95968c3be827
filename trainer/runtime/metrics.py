"""Step metrics without stalling the device, and where rank 0 writes them.

:class:`StepMeter` keeps each step's loss terms, grad norm and token count as device tensors;
only at a log step does it move them to the host, in one transfer, so the GPU never waits on
Python inside a step. :class:`MetricsLog` writes one JSON object per step to
``OUTPUT_DIR/metrics.jsonl`` and the console (a tqdm bar when interactive, plain lines in logs);
each train record carries the seconds since the loop started, from which the console line shows
the time elapsed and an estimate of the time left to ``max_steps``.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from common.atomic import explaining_full_disk, write_text_atomically

log = logging.getLogger(__name__)


class StepMeter:
    """Per-step device-side sums, averaged over ranks and turned into numbers at log time."""

    def __init__(self, global_batch_size: int) -> None:
        self.global_batch_size = global_batch_size
        self.names: list[str] | None = None
        self.rows: list[torch.Tensor] = []
        self.pending: list[tuple[int, float, int, int, float]] = []  # (step, lr, tokens, damaged, end time)
        self.tokens = 0  # real tokens of the current step on this rank, counted on the host
        self.damaged = 0  # samples of skipped damaged shards in the current step on this rank (loader.damaged_shards)
        self.micro: list[torch.Tensor] = []
        self.data_wait = 0.0  # host seconds spent waiting for batches since the last flush
        self.started = self.last_flush = time.perf_counter()

    def add_micro(self, losses: dict[str, torch.Tensor], tokens: int) -> None:
        """One micro-batch's detached loss terms (kept on the device) and its real-token count."""
        if self.names is None:
            self.names = list(losses)
        self.micro.append(torch.stack([losses[name].detach().float() for name in self.names]))
        self.tokens += tokens

    def add_damaged(self, samples: int) -> None:
        """Samples of skipped damaged shards that one micro-batch stood in for (``train/damaged_samples_skipped``)."""
        self.damaged += samples

    def add_data_wait(self, seconds: float) -> None:
        """Host time one ``next(loader)`` took: the loop stood still waiting for data that long."""
        self.data_wait += seconds

    def end_step(self, step: int, lr: float, grad_norm: Any) -> None:
        terms = torch.stack(self.micro).mean(0)
        norm = torch.as_tensor(grad_norm if grad_norm is not None else math.nan, dtype=torch.float32)
        self.rows.append(torch.cat([terms, norm.to(terms.device).reshape(1)]))
        # The host reaches this line before an asynchronous device has finished the step; over the
        # log interval the difference evens out, since flush waits for the device.
        self.pending.append((step, lr, self.tokens, self.damaged, time.perf_counter()))
        self.micro, self.tokens, self.damaged = [], 0, 0

    def flush(self) -> list[tuple[int, dict[str, float]]]:
        """All ranks call this together: losses averaged and tokens summed over ranks."""
        counts = torch.tensor([[float(d), float(t)] for _, _, t, d, _ in self.pending], device=self.rows[0].device)
        table = torch.cat([torch.stack(self.rows), counts], dim=1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table)
            table[:, :-2] /= dist.get_world_size()  # mean losses; the grad norm is the same on every rank
        values = table.tolist()
        now = time.perf_counter()
        interval = max(now - self.last_flush, 1e-9)
        tokens_per_s = sum(row[-1] for row in values) / interval
        # Of the wall time since the last flush, the share the loop spent blocked on the loader. An upper
        # bound on the device's idle time for want of data: the host usually runs ahead of the device.
        shared = {"train/tokens_per_s": tokens_per_s, "train/data_wait_share": self.data_wait / interval}
        device = self.rows[0].device
        if device.type == "cuda":  # the peak since the process started, what sizing a micro-batch needs
            shared["train/max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        records = []
        for (step, lr, _, _, ended), row in zip(self.pending, values, strict=True):
            metrics = {f"train/{name}": value for name, value in zip(self.names, row, strict=False)}
            if row[-2]:  # only where it happened: a clean run's records are unchanged
                metrics["train/damaged_samples_skipped"] = row[-2]
            metrics.update(
                {
                    "train/lr": lr,
                    "train/grad_norm": row[-3],
                    **shared,
                    "train/samples": step * self.global_batch_size,
                    "train/elapsed_s": ended - self.started,
                }
            )
            records.append((step, metrics))
        self.rows, self.pending, self.last_flush, self.data_wait = [], [], now, 0.0
        return records


class MetricsLog:
    """Rank 0's ``metrics.jsonl`` and console output; other ranks' calls do nothing."""

    def __init__(self, output_dir: str | Path, *, is_main: bool, max_steps: int, start_step: int) -> None:
        self.is_main = is_main
        self.max_steps, self.start_step = max_steps, start_step
        self.path = Path(output_dir) / "metrics.jsonl"
        self.bar = None
        if not is_main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_after(self.path, start_step)
        if sys.stderr.isatty():
            self.bar = tqdm(total=max_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.is_main or not metrics:
            return
        line = json.dumps({"step": step, **metrics}) + "\n"
        # A full disk, a refused write or a removed output directory: one line naming the file (a torn last line
        # is cut on resume: truncate_after).
        what = f"the metrics of step {step} ({self.path.name})"
        with explaining_full_disk(what, self.path.parent, len(line)), self.path.open("a", encoding="utf-8") as f:
            f.write(line)
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(format_metrics(metrics), refresh=False)
        else:
            print(f"step {step}/{self.max_steps} | {format_metrics(metrics)}{self.timing(step, metrics)}", flush=True)

    def timing(self, step: int, metrics: dict[str, float]) -> str:
        """`` | elapsed 1m05s | eta 4m20s`` for a train record: the steps left at this run's mean step time."""
        elapsed = metrics.get("train/elapsed_s")
        if elapsed is None or step <= self.start_step:
            return ""
        eta = (self.max_steps - step) * elapsed / (step - self.start_step)
        return f" | elapsed {duration(elapsed)} | eta {duration(eta)}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def format_metrics(metrics: dict[str, float]) -> str:
    parts = []
    for key, value in metrics.items():
        if key == "train/elapsed_s":  # shown as elapsed / eta by MetricsLog.timing
            continue
        name = key.split("/", 1)[-1]
        parts.append(f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}")
    return " | ".join(parts)


def duration(seconds: float) -> str:
    """``42s``, ``3m07s``, ``2h05m``: what a person reads at a glance in a log line."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def truncate_after(path: Path, step: int) -> None:
    """Keep only the records up to ``step``: a resumed run rewrites the steps it replays."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the torn last line of a killed run
            log.warning("metrics: dropping an unreadable line of %s: %r", path, line[:80])
            continue
        if record["step"] <= step:
            kept.append(line)
    write_text_atomically(path, "".join(line + "\n" for line in kept))
