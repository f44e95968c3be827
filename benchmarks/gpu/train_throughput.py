"""The GPU items' measurements: training throughput through the real engine and loader, and the bare steps.

    python benchmarks/gpu/train_throughput.py OUTDIR [--parts cases,steps] [--only NAME,...] [--data .gpu] [--quick]
        [--deadline UNIX_SECONDS]

``benchmarks/gpu/next.py`` runs it once per repeat of an item of ``benchmarks/gpu/items.json``, with the item's
``--parts`` and ``--only``; it holds the cases and steps those items measure, nothing else (the campaign's
answered cases and steps are retired: benchmarks/README.md, "Retired").

Each case is a real run, ``python launch/run.sh PRESET ...`` (the DeepSpeed engine, the WebDataset
loader over real shards made by the preprocessing pipeline, masking, the Distiller, checkpointing and
export at the end), with a random-weight teacher of ``configs/teachers/bert-base-uncased``'s shape,
saved once with the carried tokenizer. From its ``metrics.jsonl`` it reports, over the log intervals
after the first (which holds start-up and warm-up):

* tokens/s: real tokens over wall time, measured by the loop itself (``train/tokens_per_s``), each interval's
  rate, and their spread: the fastest interval's rate less the slowest's, over the case's rate;
* MFU: tokens/s x model FLOPs per token as ``plan`` counts them (``build_plan``) over the
  dense bf16 peak of the GPU (989 TFLOP/s for an H100), as ``benchmarks/distill_step.py`` does;
* peak GPU memory (``train/max_memory_gib``) beside what ``plan`` expects a rank to hold, and the share
  of wall time the loop waited for the loader (``train/data_wait_share``).

A step is ``benchmarks/distill_step.py``: this project's bare step, the naive reference step
(``benchmarks/naive_step.py``) and the real peer's (``benchmarks/peer_step.py``) on the same models and batches,
and the compiled step with its profile and its floor. Results go to OUTDIR/throughput.json and
OUTDIR/throughput.md, rewritten after every case, so a run cut short still returns what it measured.

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
# The bare steps, by name (--only takes these too). "project-compiled": the compiled step, its profile beside the
# floor of the kernels Inductor made for it, counted as it compiles (benchmarks/compiled_floor.py): how far each
# category is from its floor (the item "compiled-floor"). The "fair-" steps (issue 52, the item "fair-steps"):
# the project's step, the naive script and TextBrewer's (benchmarks/peer_step.py, installed from the carried
# wheel) at the preset's own micro-batch, the naive and peer teachers under the same bf16 autocast as the project's
# bf16 teacher, every step clipping its gradients to the preset's optimizer.grad_clip, as the engine does; each
# timed in windows (distill_step.py --window) for a median and a range.
STEP_VARIANTS = {
    "project-compiled": ["--step=project", "--compile", "--floor", "--profile-steps=3"],
    "fair-project": ["--step=project"],
    "fair-naive": ["--step=naive"],
    "fair-peer": ["--step=peer"],
}
# The windowed steps: at least 5 timed windows of at least 3 optimizer steps each (--quick: 2 of 1)
WINDOWS, WINDOW_STEPS = 5, 3
COMPILED_PROFILED = "distilbert-512-mb32-compiled-profiled"  # the compiled engine step's profile (issue 52)
COMPILE = ["compile=true"]
# student.attention_dropout=0 (issue 52): a case's twin with the attention kernels drawing no dropout mask. What
# it costs in quality is the ablation's (a0) - (a) (docs/quality.md).
ATTN0 = "-attn0"
# --only's names for the items' cases (benchmarks/gpu/next.py): (the GPU's cases, --quick's stand-ins)
ITEM_CASES = {
    "engine-preset": (["distilbert-512-mb64", "distilbert-512-mb64-compiled"], ["distilbert-128-mb2"]),
    "attn0-preset": (
        ["distilbert-512-mb64", "distilbert-512-mb64-attn0"],
        ["distilbert-128-mb2", "distilbert-128-mb2-attn0"],
    ),
    "compiled-profiled": ([COMPILED_PROFILED], ["distilbert-128-mb2-compiled-profiled"]),
}


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
    overrides: list[str] = field(default_factory=list)


def full_cases() -> list[Case]:
    """The items' cases on the GPU: the distilbert-base preset at 512 tokens and its own micro-batch (64), eager,
    compiled and with attention dropout off; and the compiled engine step at 32 x 512 under the profiler, its
    compilation in the first interval, the profile in the last 3 steps."""
    preset = Case("distilbert-512-mb64", "distilbert-base", 512, 64)
    compiled = Case("distilbert-512-mb64-compiled", "distilbert-base", 512, 64, overrides=COMPILE)
    profiled_case = Case(COMPILED_PROFILED, "distilbert-base", 512, 32, steps=13, log_every=10, overrides=COMPILE)
    return [preset, compiled, attention_dropout_off(preset), profiled(profiled_case)]


def attention_dropout_off(case: Case) -> Case:
    """The case with the student's attention dropout off, named ``<case>-attn0``."""
    return replace(case, name=case.name + ATTN0, overrides=[*case.overrides, "student.attention_dropout=0"])


def profiled(case: Case) -> Case:
    """The case with its last 3 steps under the profiler (``profile.steps``): where the engine step's time goes.
    Its tokens/s are those of the profiled steps, slowed by the profiler: the profile is the figure."""
    case.overrides = [*case.overrides, "profile.steps=3", f"profile.start_step={case.steps - 2}"]
    return case


def quick_cases() -> list[Case]:
    """The CPU dry run's stand-ins: the preset's case at CPU size, its attention-dropout twin, and the compiled
    engine step under the profiler (compile=true and profile.steps through the engine in one run). The compiled
    case at 64 x 512 differs from the profiled one only in a setting the trainer's tests cover
    (tests/trainer/test_launcher.py); each GPU case's config is validated and planned by
    tests/test_gpu_campaign.py."""
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
        f"global_batch_size={case.micro}",  # one micro-batch a step
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


def step_command(variant: str, teacher_config: Path, tokenizer: Path, data: Path, quick: bool) -> list[str]:
    """benchmarks/distill_step.py as ``variant``: the distilbert-base preset at 512 tokens, the compiled step at
    micro-batch 32 and the fair steps at the preset's own, in windows (quick: 2 x 128)."""
    windowed = variant.startswith("fair-")
    micro, seq, steps = (2, 128, 2) if quick else (None if windowed else 32, 512, 10)
    if windowed:
        window = 1 if quick else WINDOW_STEPS
        steps = (2 if quick else WINDOWS) * window
    base = [sys.executable, "benchmarks/distill_step.py", "configs/distilbert-base.yaml", f"teacher={teacher_config}"]
    base += [f"data={data}", f"--seq-len={seq}", f"--steps={steps}", "--warmup=2"]
    base += [f"micro_batch_size={micro}"] if micro else []
    base += [f"--window={window}"] if windowed else []
    base += ["--random-weights", f"--tokenizer={tokenizer}", "--json"]
    if quick:
        base += ["student.teacher_layers=null"]
    return [*base, *STEP_VARIANTS[variant]]


def plain(value: Any) -> str:
    """A table cell: the value, '-' where there is none, 'error' where measuring it failed."""
    if isinstance(value, dict) and "error" in value:
        return "error"
    return "-" if value is None else str(value)


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Training throughput on {report['device']}", "", report["versions"]]
    if report["cases"]:
        header = "| case | seq | micro | tokens/s | spread | MFU | peak GiB | planned GiB | planned act. GiB "
        header += "| data wait | rc |"
        lines += ["", header, "|---" * 11 + "|"]
    for r in report["cases"]:
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        rate = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        spread = f"{r['spread']:.1%}" if r.get("spread") is not None else "-"
        mem = f"{r['max_memory_gib']:.1f}" if r.get("max_memory_gib") else "-"
        wait = f"{r['data_wait_share']:.1%}" if r.get("data_wait_share") is not None else "-"
        act = f"{r['planned_activation_gib']:.2f}" if r.get("planned_activation_gib") is not None else "-"
        total = f"{r['planned_gib']:.1f}" if r.get("planned_gib") is not None else "-"
        lines.append(
            f"| {r['name']} | {r['seq']} | {r['micro']} | {rate} | {spread} | {mfu} | {mem} | {total} | {act} "
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
        elif r.get("floor"):  # the compiled step's: the kernels Inductor made for it
            heading = f"The bare step's floor by category (benchmarks/compiled_floor.py; {r['name']}):"
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

    def wanted(name: str, part: str) -> bool:
        return part in parts and (only is None or name in only)

    def time_left() -> float:
        """Seconds an item may run: CASE_TIMEOUT, or less before the deadline (0: do not start it)."""
        if args.deadline is None:
            return CASE_TIMEOUT
        left = args.deadline - time.time()
        return min(CASE_TIMEOUT, left) if left >= MIN_START_S else 0

    def save() -> None:
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
