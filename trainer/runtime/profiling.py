"""Where a training step's time goes: ``torch.profiler`` over a few steps of the real loop.

``profile.steps=N`` (0, the default, is off) profiles steps ``profile.start_step`` to
``start_step + N - 1`` of a run, the DeepSpeed engine, the loader and the loop's own calls included,
and writes beside the run's metrics, for each rank:

* ``profile-rank{R}.json`` and ``.md``: time per step by category (matmul, attention, softmax and
  losses, ...), the top ops and, on CUDA, the top kernels and the share of wall time the GPU was busy;
* ``profile-rank{R}-trace.json`` with ``profile.trace=true``: the timeline, for Perfetto or
  ``chrome://tracing`` (tens of MB a step at full size).

A GPU busy well below 100 % means the step waits on the host: launches, Python, or a read of a device
value that made the host wait (``trainer.runtime.host_reads.HostReads`` finds those). The profiler's own cost
inflates the host side, so the busy share of a host-bound step reads lower than it is; the device's
time per step is not inflated. Time is each op's self time on the device (CUDA: the kernels it
launched; CPU: its own CPU time), so nothing is counted twice.

``benchmarks/distill_step.py --profile-steps`` reports the bare step the same way (:func:`summarize`).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from common.atomic import write_text_atomically
from trainer.config import ProfileConfig

# A compiled step's kernels are named by Inductor after the ops they fuse (``triton_per_fused_native_layer_norm_3``)
# and, on CUDA, recorded under those names while the profiler runs, so they fall into the same categories as the eager
# ops (``benchmarks/compiled_floor.py`` names its kernels so too). What a compiled graph runs without naming it (on a
# CPU, the C++ kernels Inductor generates) is charged to the graph's call, kept apart rather than hidden in "other".
OP_CATEGORIES = (
    ("compiled graph, unattributed", r"^## Call CompiledFxGraph"),
    ("attention", r"attention|flash|fmha|sdpa"),
    ("matmul", r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_addmm_activation)$|gemm|cutlass|sm90_xmma|nvjet"),
    ("softmax and losses", r"softmax|kl_div|cross_entropy|nll_loss|logsumexp|cosine"),
    ("masking and gathers", r"index|gather|scatter|multinomial|masked|where|bernoulli|rand|isin"),
    ("norms and activations", r"layer_norm|gelu|dropout|tanh"),
    ("optimizer", r"adam|_foreach_"),
    ("copies and casts", r"^aten::(copy_|_to_copy|to|clone|contiguous|cat|fill_|zero_)$|memcpy|memset"),
)


def op_category(name: str) -> str:
    return next((category for category, pattern in OP_CATEGORIES if re.search(pattern, name, re.IGNORECASE)), "other")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(prof: profile, count: int, wall_ms: float, on_cuda: bool) -> dict[str, Any]:
    """Per step, over ``count`` profiled steps that took ``wall_ms`` each: categories, top ops and, on CUDA,
    top kernels and the GPU's busy share."""
    averages = prof.key_averages()

    def per_step_ms(event: Any) -> float:  # the profiler reports microseconds over all steps
        return (event.self_device_time_total if on_cuda else event.self_cpu_time_total) / 1e3 / count

    ops = [e for e in averages if e.device_type == torch.autograd.DeviceType.CPU and per_step_ms(e) > 0]
    categories: dict[str, float] = {}
    for event in ops:
        categories[op_category(event.key)] = categories.get(op_category(event.key), 0.0) + per_step_ms(event)
    ops.sort(key=per_step_ms, reverse=True)
    result: dict[str, Any] = {
        "steps": count,
        "time": "device (CUDA kernels)" if on_cuda else "cpu",
        "wall_ms_per_step": wall_ms,
        "categories_ms_per_step": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
        "top_ops": [[e.key, round(per_step_ms(e), 3), e.count // count] for e in ops[:15]],
    }
    if on_cuda:
        kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
        busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / count
        result["busy_share"] = busy_ms / wall_ms
        result["top_kernels"] = [[e.key[:120], round(e.self_device_time_total / 1e3 / count, 3)] for e in kernels[:15]]
    return result


def profile_markdown(summary: dict[str, Any]) -> str:
    """The summary as Markdown tables: categories (ms per step and share), then the top ops and kernels."""
    total = sum(summary["categories_ms_per_step"].values()) or 1.0
    busy = f", GPU busy {summary['busy_share']:.0%} of wall time" if "busy_share" in summary else ""
    lines = [
        f"Profile of {summary['steps']} steps, {summary['time']} time: {summary['wall_ms_per_step']:.1f} ms wall "
        f"per step{busy}.",
        "",
        "| category | ms/step | share |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {v:.2f} | {v / total:.0%} |" for k, v in summary["categories_ms_per_step"].items()]
    lines += ["", "| top op | ms/step | calls/step |", "|---|---|---|"]
    lines += [f"| `{name}` | {ms:.2f} | {calls} |" for name, ms, calls in summary["top_ops"][:10]]
    if summary.get("top_kernels"):
        lines += ["", "| top kernel | ms/step |", "|---|---|"]
        lines += [f"| `{name}` | {ms:.2f} |" for name, ms in summary["top_kernels"][:10]]
    return "\n".join(lines)


def profiler_activities(device: torch.device) -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda" else [])]


class NoProfiler:
    """``profile.steps=0``: the loop calls the same two methods, which do nothing."""

    def step_begins(self, step: int) -> None:
        """Before step ``step``'s first micro-batch (1-based)."""

    def step_ended(self, step: int) -> None:
        """After step ``step``'s optimizer step."""


class StepProfiler(NoProfiler):
    """Profiles steps ``[first, first + count)``: the loop calls :meth:`step_begins` before a step's first
    micro-batch and :meth:`step_ended` after its optimizer step (``step``: the step's 1-based number)."""

    def __init__(self, cfg: ProfileConfig, output_dir: Path, rank: int, device: torch.device) -> None:
        self.first, self.count, self.trace = cfg.start_step, cfg.steps, cfg.trace
        self.stem = output_dir / f"profile-rank{rank}"
        self.device = device
        self.prof: profile | None = None
        self.started = 0.0

    def step_begins(self, step: int) -> None:
        if step == self.first:
            synchronize(self.device)  # the window holds these steps' work and nothing queued before
            self.prof = profile(activities=profiler_activities(self.device))
            self.prof.__enter__()
            self.started = time.perf_counter()

    def step_ended(self, step: int) -> None:
        if self.prof is None or step != self.first + self.count - 1:
            return
        synchronize(self.device)
        wall_ms = (time.perf_counter() - self.started) * 1e3 / self.count
        self.prof.__exit__(None, None, None)
        summary = summarize(self.prof, self.count, wall_ms, self.device.type == "cuda")
        summary["first_step"] = self.first
        write_text_atomically(self.stem.with_suffix(".json"), json.dumps(summary, indent=1) + "\n")
        write_text_atomically(self.stem.with_suffix(".md"), profile_markdown(summary) + "\n")
        if self.trace:
            self.prof.export_chrome_trace(str(self.stem) + "-trace.json")
        self.prof = None


def step_profiler(cfg: ProfileConfig, output_dir: Path, rank: int, device: torch.device) -> NoProfiler:
    return StepProfiler(cfg, output_dir, rank, device) if cfg.steps else NoProfiler()
