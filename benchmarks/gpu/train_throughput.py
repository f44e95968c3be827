"""End-to-end training throughput through the real engine and loader, and the naive step side by side.

    python benchmarks/gpu/train_throughput.py OUTDIR [--parts cases,steps] [--only NAME,...] [--data .gpu] [--quick]
        [--deadline UNIX_SECONDS]

Each case is a real run, ``python launch/run.sh PRESET ...`` (the DeepSpeed engine, the WebDataset
loader over real shards made by the preprocessing pipeline, masking, the Distiller, checkpointing and
export at the end), with a random-weight teacher of ``configs/teachers/bert-base-uncased``'s shape,
saved once with the carried tokenizer. From its ``metrics.jsonl`` it reports, over the log intervals
after the first (which holds start-up and warm-up):

* tokens/s: real tokens over wall time, measured by the loop itself (``train/tokens_per_s``), and its
  spread: the fastest interval's rate less the slowest's, over the case's rate;
* MFU: tokens/s x model FLOPs per token as ``plan`` counts them (``build_plan``) over the
  dense bf16 peak of the GPU (989 TFLOP/s for an H100), as ``benchmarks/distill_step.py`` does;
* peak GPU memory (``train/max_memory_gib``) beside what ``plan`` expects a rank to hold, and the share
  of wall time the loop waited for the loader (``train/data_wait_share``).

Then ``benchmarks/distill_step.py`` times this project's bare step and the naive reference step
(``benchmarks/naive_step.py``) on the same models and batches, fused AdamW on and off, and
``torch.compile`` of student and teacher (``Distiller.compile_models``): the ratio is the speed-up
over the usual way. Results go to OUTDIR/throughput.json and OUTDIR/throughput.md,
rewritten after every case, so a run cut short still returns what it measured.

``--deadline`` (Unix time) starts nothing with less than ``MIN_START_S`` left (named in the report's
``not_started``) and stops what runs at the deadline, recorded as such (``benchmarks/gpu/next.py`` gives each
item's runs its call's deadline; an item with a stopped or unstarted run is not answered, and a later call
measures it again).

``--quick`` is the CPU dry run: a 12-layer, 96-wide teacher, the 128-token data, micro-batches of 2
and a few steps; every code path runs, no figure means anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.step_floor import floor_markdown
from common.atomic import write_text_atomically
from common.config import load_config
from trainer.config import TrainConfig
from trainer.modeling import load_teacher_config
from trainer.planning.plan import build_plan
from trainer.runtime.profiling import profile_markdown

REPO = Path(__file__).resolve().parents[2]
H100_BF16_DENSE = 989e12  # FLOP/s, the datasheet figure the issue measures MFU against
CASE_TIMEOUT = 420
MIN_START_S = 45  # with less time to the deadline, a case or step is not started (process start alone is ~20 s)
STOPPED = "stopped at the deadline"  # the rc of what the deadline cut short
# The bare steps compared, by name (--only takes these too): the project's step as trained (fused AdamW on
# CUDA), which also profiles a few steps after timing them (where the time goes, before anything is optimised),
# the naive reference step, the compiled step (does compile pay, now that the encoders' masks stay eager), and
# fused AdamW off (measured once already: 1.09x). The project's step and
# TinyBERT-4's (at 64 x 512, where the campaigns measured 1.7x the planned peak) end with one step's peak
# memory, by site (--memory); the project's also with its floor by category, beside its profile, at the
# device's measured ceilings (--floor: how far each category's kernels are from their roofline). The compiled
# step's floor is the kernels Inductor made for it, counted as it compiles (benchmarks/compiled_floor.py), and its
# profile the kernels it ran (how far each is from that floor). "project-unpadded" is the project's step with the
# MLM decoders' vocabulary as it is (objective.vocab_multiple=1, the presets' setting before the third campaign
# measured the padded decoder's matmuls 1.97x faster alone): the padding's gain in the whole step, side by side.
# "naive" and "peer" are the fair baselines (issue 52): the naive script and TextBrewer (benchmarks/peer_step.py,
# installed from the carried wheel), each with its teacher under the same bf16 autocast as the project's step's
# bf16 teacher, and every step clipping its gradients to the preset's optimizer.grad_clip, as the engine does.
STEP_VARIANTS = {
    "project": ["--step=project", "--profile-steps=3", "--floor", "--memory"],
    "project-unpadded": ["--step=project"],
    "naive": ["--step=naive"],
    "peer": ["--step=peer"],
    "tinybert-memory": ["--step=project", "--memory"],
    "project-compiled": ["--step=project", "--compile", "--floor", "--profile-steps=3"],
    "project-no-fused-adamw": ["--step=project", "--no-fused-adamw"],
    # the fair comparison at the preset's own micro-batch (benchmarks/gpu/items.json, "fair-steps"), each timed in
    # windows (distill_step.py --window) for a median and a range
    "fair-project": ["--step=project"],
    "fair-naive": ["--step=naive"],
    "fair-peer": ["--step=peer"],
}
STEP_OVERRIDES = {"project-unpadded": ["objective.vocab_multiple=1"]}  # config keys a step changes
HEADLINE = "headline"  # --only's name for the first case of the list
# --only's names for the cases of benchmarks/gpu/next.py's items: (the full campaign's cases, --quick's stand-ins)
ITEM_CASES = {
    "engine-preset": (["distilbert-512-mb64", "distilbert-512-mb64-compiled"], ["distilbert-128-mb2"]),
    "attn0-preset": (
        ["distilbert-512-mb64", "distilbert-512-mb64-attn0"],
        ["distilbert-128-mb2", "distilbert-128-mb2-attn0"],
    ),
}
# The windowed steps: at least 5 timed windows of at least 3 optimizer steps each (--quick: 2 of 1)
WINDOWS, WINDOW_STEPS = 5, 3
COMPILED_PROFILED = "distilbert-512-mb32-compiled-profiled"  # the compiled engine step's profile (issue 52)
COMPILE = ["compile=true"]
# student.attention_dropout=0 (issue 52): a case's twin with the attention kernels drawing no dropout mask; --only
# attn0 measures each twin and its base case in one call, for their ratio side by side. What it costs in quality
# is the ablation's (a0) - (a) (docs/quality.md).
ATTN0 = "-attn0"


def timed_out(timeout: float) -> str:
    """The rc of a run killed at ``timeout``: its own limit, or the deadline (then measured again later)."""
    return "timeout" if timeout >= CASE_TIMEOUT else STOPPED


@dataclass
class Case:
    name: str
    preset: str
    seq: int
    micro: int
    # 6 measured intervals of 10 steps after the first: in the second campaign's 2 intervals a step, the
    # headline's variants differed by up to a third in directions no setting explains (docs/log/benchmarks.md)
    steps: int = 70
    log_every: int = 10
    global_batch: int | None = None  # None: one micro-batch per step
    overrides: list[str] = field(default_factory=list)


def full_cases() -> list[Case]:
    """The campaign, most telling first (``run.sh OUT cases`` runs them in this order). The first is the headline
    (``--only headline``): the issue's targets are set at the distilbert-base preset at 512 tokens. Then what
    explains the engine's distance from the bare step: single DeepSpeed settings changed, the engine's profile,
    larger micro-batches, compile. Then the two small presets at 512, DistilBERT's 4096-sequence global batch
    through gradient accumulation, and the 128-token sweep."""
    cases = [Case("distilbert-512-mb32", "distilbert-base", 512, 32)]
    # The headline with one or two settings changed, for ratios measured side by side (docs/log/benchmarks.md, "Why the
    # engine runs at half the bare step"): DeepSpeed's throughput timer back on (two device syncs a step, as
    # before deepspeed_config turned it off); ZeRO-2 without overlap_comm (a sync after every backward, which
    # pays only on several GPUs); that and contiguous_gradients off too, the fewest ops and syncs ZeRO-2 allows
    # (3,539 ops and 2 host reads a step against 4,289 and 3, "Host work per step"); ZeRO-1, for what ZeRO-2's
    # gradient partitioning costs on one GPU; DeepSpeed's bf16 overflow check back on (about 13 ops per parameter
    # and 2 host reads a step).
    variants = {
        "deepspeed-timers": "deepspeed.config=benchmarks/gpu/zero2-deepspeed-timers.json",
        "no-overlap": "deepspeed.config=benchmarks/gpu/zero2-no-overlap.json",
        "zero2-lean": "deepspeed.config=benchmarks/gpu/zero2-lean.json",
        "zero1": "deepspeed.config=configs/deepspeed/zero1.json",
        "bf16-skip-nonfinite": "deepspeed.bf16_skip_nonfinite=true",
    }
    for name, override in variants.items():
        cases += [Case(f"distilbert-512-mb32-{name}", "distilbert-base", 512, 32, overrides=[override])]
    # The headline again, unchanged, after its variants: how far the same case moves within one call
    cases += [Case("distilbert-512-mb32-repeat", "distilbert-base", 512, 32)]
    cases += [profiled(Case("distilbert-512-mb32-profiled", "distilbert-base", 512, 32, steps=13, log_every=10))]
    # the same compiled (issue 52): its compilation falls in the first interval, the profile in the last 3 steps
    cases += [profiled(Case(COMPILED_PROFILED, "distilbert-base", 512, 32, steps=13, log_every=10, overrides=COMPILE))]
    # The host's work per step hardly grows with the micro-batch, the GPU's does: if the engine is bound by its
    # host, its MFU climbs toward the bare step's as the micro-batch grows (about 35 GiB at 256).
    cases += [Case(f"distilbert-512-mb{m}", "distilbert-base", 512, m) for m in (64, 128, 256)]
    # compile=true through the real engine (its compilation falls in the first log interval, which is not counted);
    # at 256 the second campaign found the engine as fast as the bare step's kernels: what is left is theirs,
    # which is what compiling fuses
    for m in (32, 64, 256):  # 64: the preset's own micro-batch (the `next` item "engine-preset")
        cases += [Case(f"distilbert-512-mb{m}-compiled", "distilbert-base", 512, m, overrides=["compile=true"])]
    cases += [
        attention_dropout_off(case)
        for case in cases
        if case.name in ("distilbert-512-mb32", "distilbert-512-mb32-compiled", "distilbert-512-mb64")
    ]
    cases += [Case("tinybert-4l-312-512-mb64", "tinybert-4l-312", 512, 64)]
    cases += [Case("minilm-6l-384-512-mb64", "minilm-6l-384", 512, 64)]
    for m in (32, 64):  # 64: the preset's micro-batch since the second campaign
        cases += [
            Case(f"distilbert-512-gb4096-mb{m}", "distilbert-base", 512, m, steps=2, log_every=1, global_batch=4096)
        ]
    # the preset's own workload compiled: the third campaign's compiled bare step ran 1.28x its eager one
    gb4096 = {"steps": 2, "log_every": 1, "global_batch": 4096, "overrides": ["compile=true"]}
    cases += [Case("distilbert-512-gb4096-mb64-compiled", "distilbert-base", 512, 64, **gb4096)]
    cases += [Case(f"distilbert-128-mb{m}", "distilbert-base", 128, m) for m in (64, 128, 256)]
    cases += [Case("distilbert-512-mb16", "distilbert-base", 512, 16)]
    return cases


def attention_dropout_off(case: Case) -> Case:
    """The case with the student's attention dropout off, named ``<case>-attn0``."""
    return replace(case, name=case.name + ATTN0, overrides=[*case.overrides, "student.attention_dropout=0"])


def profiled(case: Case) -> Case:
    """The case with its last 3 steps under the profiler (``profile.steps``): where the engine step's time goes.
    Its tokens/s are those of the profiled steps, slowed by the profiler: the profile is the figure."""
    case.overrides = [*case.overrides, "profile.steps=3", f"profile.start_step={case.steps - 2}"]
    return case


def quick_cases() -> list[Case]:
    """The CPU dry run's cases: each code path of the campaign's cases once, at CPU size. The headline, its
    attention-dropout twin (the ratio ``--only attn0`` reports) and the compiled engine step under the profiler
    (the ``compiled-floor`` item's ``compiled-profiled``: compile=true and profile.steps through the engine in one
    run). What the other GPU cases change is a setting of the trainer, tested there
    (tests/trainer/test_launcher.py: compile, eager profiles, accumulation; each preset's objective: tests/gpu's
    dry run); each full case's config is validated and planned by tests/test_gpu_campaign.py."""
    cases = [Case("distilbert-128-mb2", "distilbert-base", 128, 2, steps=4, log_every=2)]
    cases += [attention_dropout_off(cases[0])]
    quick = {"steps": 5, "log_every": 2, "overrides": COMPILE}
    cases += [profiled(Case("distilbert-128-mb2-compiled-profiled", "distilbert-base", 128, 2, **quick))]
    return cases


def random_teacher(config_dir: Path, tokenizer_dir: Path, dest: Path, quick: bool) -> Path:
    """A randomly initialised teacher of the config's shape (``--quick``: a small one), saved with the tokenizer.

    Throughput does not depend on the weights; the DistilBERT student copies whatever the teacher holds.
    """
    import torch
    from transformers import AutoTokenizer

    from trainer.modeling import model_from_config

    if (dest / "config.json").is_file():
        return dest
    config = load_teacher_config(str(config_dir))
    if quick:
        config.hidden_size, config.num_attention_heads, config.intermediate_size = 96, 12, 192
    torch.manual_seed(0)
    model_from_config(config).save_pretrained(dest, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir, use_fast=True).save_pretrained(dest)
    return dest


def case_overrides(case: Case, teacher: Path, data: Path, out: Path) -> list[str]:
    steps = case.steps
    return [
        f"teacher={teacher}",
        f"data={data}",
        f"output_dir={out}",
        f"max_steps={steps}",
        f"micro_batch_size={case.micro}",
        f"global_batch_size={case.global_batch or case.micro}",
        f"logging.every_steps={case.log_every}",
        f"eval.every_steps={steps}",
        "eval.max_batches=1",
        f"checkpoint.every_steps={steps}",
        "checkpoint.keep_last=1",
        "mlflow.enabled=false",
        *case.overrides,
    ]


def planned(case: Case, overrides: list[str]) -> dict[str, float]:
    """What ``plan`` computes for the case on one rank: model FLOPs per token, the GiB one micro-batch saves for
    backward, and the GiB the rank should hold at its peak (weights, optimizer states, buckets, activations),
    to set beside the measured peak."""
    cfg = load_config(TrainConfig, str(REPO / "configs" / f"{case.preset}.yaml"), overrides)
    sized = build_plan(cfg, world_size=1, seq_len=case.seq)
    return {
        "flops_per_token": sized["flops_per_token"]["total"],
        "planned_activation_gib": sized["activation_gib"],
        "planned_gib": sized["memory_gib"]["total"],
        "vocab_multiple": cfg.objective.vocab_multiple,  # the decoder's padding the case ran
    }


def summarize(out: Path) -> dict[str, Any]:
    """Rates over the log intervals after the first; each interval holds the same number of tokens, so the
    rate of their sum is the harmonic mean of their rates."""
    lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    train = [r for r in map(json.loads, lines) if "train/loss" in r]
    flushes: dict[float, dict[str, Any]] = {}  # one flush = the records sharing its tokens_per_s
    for r in train:
        flushes.setdefault(r["train/tokens_per_s"], r)
    measured = list(flushes.values())[1:] or list(flushes.values())
    if not measured:
        return {"error": "no train records"}
    rates = [r["train/tokens_per_s"] for r in measured]
    rate = len(rates) / sum(1 / r for r in rates)
    return {
        "tokens_per_s": rate,
        "spread": (max(rates) - min(rates)) / rate,  # how far apart the intervals are: the figure's own noise
        "interval_tokens_per_s": rates,  # each interval's own rate: a stall shows as one, steady noise as all
        "data_wait_share": max(r["train/data_wait_share"] for r in measured),
        "max_memory_gib": max((r.get("train/max_memory_gib") or 0.0) for r in train) or None,
        "intervals": len(measured),
        "final_loss": train[-1]["train/loss"],
    }


def run_case(
    case: Case, teacher: Path, data_root: Path, work: Path, peak: float | None, timeout: float
) -> dict[str, Any]:
    out = work / case.name
    shutil.rmtree(out, ignore_errors=True)  # a run left there would be resumed, not measured
    data = data_root / f"data-{case.seq}"
    overrides = case_overrides(case, teacher, data, out)
    cmd = [sys.executable, "-u", "launch/run.sh", f"configs/{case.preset}.yaml", *overrides]
    started = time.perf_counter()
    log_path = work / f"{case.name}.log"
    with log_path.open("w") as log:
        try:
            proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = timed_out(timeout)
    result: dict[str, Any] = {**asdict(case), "rc": rc, "wall_s": time.perf_counter() - started}
    if rc != 0:
        result["error"] = log_path.read_text()[-2000:]
    result.update(summarize(out))
    result.update(planned(case, overrides))
    if (out / "profile-rank0.json").is_file():  # profile.steps: rank 0's summary (trainer/runtime/profiling.py)
        result["profile"] = json.loads((out / "profile-rank0.json").read_text())
    if "tokens_per_s" in result and peak:
        result["mfu"] = result["tokens_per_s"] * result["flops_per_token"] / peak
    return result


def json_result(command: list[str], timeout: float) -> dict[str, Any]:
    """The JSON a benchmark script prints last (after any log lines), or ``{"error": its stderr's tail}``."""
    try:
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": timed_out(timeout), "rc": timed_out(timeout)}
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    return json.loads(proc.stdout[proc.stdout.index("{") :])


# (preset, micro-batch) of a step not at the default; None: the preset's own
STEP_SHAPES = {"tinybert-memory": ("tinybert-4l-312", 64)}
STEP_SHAPES |= {name: ("distilbert-base", None) for name in ("fair-project", "fair-naive", "fair-peer")}


def step_command(variant: str, teacher_config: Path, tokenizer: Path, data: Path, quick: bool) -> list[str]:
    """benchmarks/distill_step.py as ``variant``: the distilbert-base preset at 32 x 512 unless ``STEP_SHAPES``
    says otherwise (quick: 2 x 128)."""
    preset, micro = STEP_SHAPES.get(variant, ("distilbert-base", 32))
    micro, seq, steps = (2, 128, 2) if quick else (micro, 512, 10)
    windowed = variant.startswith("fair-")
    if windowed:
        window = 1 if quick else WINDOW_STEPS
        steps = (2 if quick else WINDOWS) * window
    base = [sys.executable, "benchmarks/distill_step.py", f"configs/{preset}.yaml", f"teacher={teacher_config}"]
    base += [f"data={data}", f"--seq-len={seq}", f"--steps={steps}", "--warmup=2"]
    base += [f"micro_batch_size={micro}"] if micro else []
    base += [f"--window={window}"] if windowed else []
    base += ["--random-weights", f"--tokenizer={tokenizer}", "--json", *STEP_OVERRIDES.get(variant, [])]
    if quick:
        base += ["student.teacher_layers=null"]
    return [*base, *STEP_VARIANTS[variant]]


def plain(value: Any) -> str:
    """A table cell: the value, '-' where there is none, 'error' where measuring it failed."""
    if isinstance(value, dict) and "error" in value:
        return "error"
    return "-" if value is None else str(value)


def memory_markdown(steps: list[dict[str, Any]]) -> list[str]:
    """One step's peak memory, planned beside measured, and what held it (distill_step.py --memory)."""
    lines = []
    for r in steps:
        memory = r.get("memory")
        if not memory:
            continue
        if "error" in memory:
            lines += ["", f"Peak memory of one {r['name']} step: error ({memory['error']})"]
            continue
        device = f"{memory['device_peak_gib']:.2f}" if memory.get("device_peak_gib") is not None else "-"
        lines += [
            "",
            f"Peak memory of one {r['name']} step beyond the weights ({' '.join(r['args'])}, micro-batch "
            f"{r['micro_batch_size']} x {r['seq_len']}): planned {memory['planned_peak_gib']:.2f} GiB, its tensors "
            f"{memory['tracked_peak_gib']:.2f}, the device {device}. Held at the peak:",
            "",
            "| GiB | op <- where |",
            "|---|---|",
        ]
        lines += [f"| {site['gib']:.3f} | `{site['site']}` |" for site in memory["at_peak"]]
    return lines


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Training throughput on {report['device']}", "", report["versions"]]
    if report["cases"]:
        header = "| case | seq | micro | global | tokens/s | spread | MFU | peak GiB | planned GiB | planned act. GiB "
        header += "| data wait | rc |"
        lines += ["", header, "|---" * 12 + "|"]
    for r in report["cases"]:
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        rate = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        spread = f"{r['spread']:.1%}" if r.get("spread") is not None else "-"
        mem = f"{r['max_memory_gib']:.1f}" if r.get("max_memory_gib") else "-"
        wait = f"{r['data_wait_share']:.1%}" if r.get("data_wait_share") is not None else "-"
        gb = r["global_batch"] or r["micro"]
        act = f"{r['planned_activation_gib']:.2f}" if r.get("planned_activation_gib") is not None else "-"
        total = f"{r['planned_gib']:.1f}" if r.get("planned_gib") is not None else "-"
        lines.append(
            f"| {r['name']} | {r['seq']} | {r['micro']} | {gb} | {rate} | {spread} | {mfu} | {mem} | {total} | {act} "
            f"| {wait} | {r['rc']} |"
        )
    if report["steps"]:
        header = "| bare step (distill_step.py) | tokens/s | MFU | peak GiB | host syncs | ops/step |"
        lines += ["", header, "|---" * 6 + "|"]
    for r in report["steps"]:
        if "error" in r:
            lines.append(f"| {r['name']} ({' '.join(r['args'])}) | error | | | | |")
            continue
        mem = f"{r['max_memory_gib']:.1f}" if r.get("max_memory_gib") else "-"
        lines.append(
            f"| {r['name']} ({' '.join(r['args'])}) | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {mem} | "
            f"{r['host_sync_in_forward_backward']} | {plain(r.get('ops_per_step'))} |"
        )
    rates = {r["name"]: r.get("tokens_per_s") for r in report["cases"] if r.get("rc") == 0}
    twins = [(name[: -len(ATTN0)], name) for name in rates if name.endswith(ATTN0) and rates.get(name[: -len(ATTN0)])]
    if twins and all(rates[twin] for _, twin in twins):
        ratios = ", ".join(f"{base} **{rates[twin] / rates[base]:.2f}x**" for base, twin in twins)
        lines += ["", f"Attention dropout off (student.attention_dropout=0) / as the preset, tokens/s: {ratios}"]
    if report.get("naive_ratio"):
        lines += ["", f"Project step / naive step tokens/s: **{report['naive_ratio']:.2f}x**"]
    if report.get("peer_ratio"):
        peer = next(r.get("peer") or {} for r in report["steps"] if r["name"] == "peer")
        name = f"{peer.get('library', 'peer')} {peer.get('version', '')}".strip()
        lines += ["", f"Project step / real peer step ({name}) tokens/s: **{report['peer_ratio']:.2f}x**"]
    lines += memory_markdown(report["steps"])
    if report.get("not_started"):
        lines += ["", f"Not started, too close to the deadline: {', '.join(report['not_started'])}."]
    for r in report["steps"]:
        if r.get("profile") and "error" in r["profile"]:
            lines += ["", f"Where the bare step's time goes ({' '.join(r['args'])}): error ({r['profile']['error']})"]
        elif r.get("profile"):
            heading = f"Where the bare step's time goes ({' '.join(r['args'])}):"
            lines += ["", heading, "", profile_markdown(r["profile"])]
        if r.get("floor") and "error" in r["floor"]:
            lines += ["", f"The bare step's floor ({r['name']}): error ({r['floor']['error']})"]
        elif r.get("floor"):
            script = "compiled_floor.py" if r["floor"].get("step") == "compiled" else "step_floor.py"
            heading = f"The bare step's floor by category (benchmarks/{script}; {r['name']}):"
            lines += ["", heading, "", floor_markdown(r["floor"])]
    for r in report["cases"]:
        if r.get("profile"):
            heading = (
                f"Where the engine step's time goes ({r['name']}, steps {r['profile']['first_step']}-{r['steps']}):"
            )
            lines += ["", heading, "", profile_markdown(r["profile"])]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--data", type=Path, default=REPO / ".gpu", help="tokenizer/, data-128/, data-512/")
    parser.add_argument("--teacher-config", type=Path, default=REPO / "configs" / "teachers" / "bert-base-uncased")
    parser.add_argument("--work", type=Path, default=Path("/tmp/encoder-distill-throughput"))
    parser.add_argument("--quick", action="store_true", help="the CPU dry run")
    parser.add_argument("--parts", default="cases,steps", help="cases (training runs), steps (bare step comparison)")
    parser.add_argument("--only", default=None, help="comma-separated case and step names (default: all)")
    parser.add_argument("--deadline", type=float, default=None, help="Unix time by which to have stopped")
    args = parser.parse_args()
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.outdir.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    on_gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if on_gpu else "cpu"
    peak = H100_BF16_DENSE if on_gpu else None
    tokenizer = args.data / "tokenizer"
    teacher = random_teacher(args.teacher_config, tokenizer, args.work / "teacher", args.quick)
    import deepspeed
    import transformers

    versions = f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}"
    report: dict[str, Any] = {"device": device, "versions": versions, "peak_flops": peak, "cases": [], "steps": []}
    only = None if args.only is None else set(args.only.split(","))
    parts = set(args.parts.split(","))
    cases = quick_cases() if args.quick else full_cases()
    for alias, (full, quick) in ITEM_CASES.items():
        if only is not None and alias in only:
            only |= set(quick if args.quick else full)
    if only is not None and HEADLINE in only:
        only.add(cases[0].name)
    if only is not None and "compiled-profiled" in only:  # the compiled engine step's profile, at either size
        only |= {case.name for case in cases if case.name.endswith("-compiled-profiled")}
    if only is not None and "attn0" in only:  # each attention-dropout twin and its base, side by side
        only |= {name for case in cases if case.name.endswith(ATTN0) for name in (case.name, case.name[: -len(ATTN0)])}

    def wanted(name: str, part: str) -> bool:
        return part in parts and (only is None or name in only)

    def time_left() -> float:
        """Seconds an item may run: CASE_TIMEOUT, or less before the deadline (0: do not start it)."""
        if args.deadline is None:
            return CASE_TIMEOUT
        left = args.deadline - time.time()
        return min(CASE_TIMEOUT, left) if left >= MIN_START_S else 0

    def save() -> None:
        steps = {r["name"]: r.get("tokens_per_s") for r in report["steps"]}
        if steps.get("project") and steps.get("naive"):
            report["naive_ratio"] = steps["project"] / steps["naive"]
        if steps.get("project") and steps.get("peer"):
            report["peer_ratio"] = steps["project"] / steps["peer"]
        write_text_atomically(args.outdir / "throughput.json", json.dumps(report, indent=2) + "\n")
        write_text_atomically(args.outdir / "throughput.md", markdown(report))

    def record(kind: str, result: dict[str, Any]) -> None:
        report[kind].append(result)
        save()
        print(json.dumps({k: v for k, v in result.items() if k not in ("error", "profile", "floor")}), flush=True)
        if "error" in result:
            print(result["error"], file=sys.stderr, flush=True)

    skipped: list[str] = []

    def may_start(name: str, part: str) -> float:
        """Seconds ``name`` may run, or 0: not wanted, or too close to the deadline (then noted as not started)."""
        if not wanted(name, part):
            return 0
        if not (timeout := time_left()):
            skipped.append(name)
        return timeout

    data = args.data / ("data-128" if args.quick else "data-512")
    teacher_config = teacher if args.quick else args.teacher_config
    for case in cases:
        if timeout := may_start(case.name, "cases"):
            record("cases", {**run_case(case, teacher, args.data, args.work, peak, timeout), "device": device})
    for name, extra in STEP_VARIANTS.items():
        if timeout := may_start(name, "steps"):
            command = step_command(name, teacher_config, tokenizer, data, args.quick)
            record("steps", {"name": name, "args": extra, **json_result(command, timeout)})
    report["not_started"] = skipped  # too close to the deadline
    save()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
